"""A run is a set of replicas: a plain plan is the set of one, and its ReplicaSet answers every call with nothing
to do — the same rows, weight 1, no exchange, no checkpoint parts — so the training loop needs no branch."""
from __future__ import annotations

import math

import pytest
import torch

from hal.parallel.config.plan import parse_plan
from hal.parallel.config.replicas import ReplicatedPlan, parse_parallel
from hal.parallel.config.run import TrainConfig
from hal.parallel.data.batches import global_batch
from hal.parallel.replicas.replica_set import CheckpointParts, ReplicaSet

STAGES = {"micro_batches": 4, "micro_batch_size": 2,
          "stages": [{"backend": "cpu", "devices": 1, "layers": 1}, {"backend": "cpu", "devices": 1, "layers": 1}]}
TWO = {"replicas": [{"rows": 6, "micro_batch_size": 2, "stages": [{"backend": "cpu", "devices": 2, "layers": 2, "dp": 2}]},
                    {"rows": 2, "micro_batch_size": 2, "stages": [{"backend": "cpu", "devices": 1, "layers": 2}]}]}
TRAIN = TrainConfig(seed=5)
SEQ, VOCAB = 8, 64


def test_a_plain_plan_parses_into_the_set_of_one_replica_with_every_row() -> None:
    replicas = parse_parallel(STAGES)
    plan = parse_plan(STAGES)
    assert replicas == ReplicatedPlan.single(plan)
    assert not replicas.several and replicas.plan == plan and replicas.world_size == 2
    assert replicas.replicas[0].rows == replicas.global_batch == plan.global_batch_size == 8
    assert replicas.replicas[0].where == "parallel" and replicas.sync.every == 1 and replicas.sync.compress == "none"
    assert replicas.timeline_files() == ["timeline.json"] and replicas.writer == 1  # the last stage's first rank
    assert ReplicatedPlan.from_dict(replicas.to_dict()).plans() == [plan]


def test_several_replicas_have_no_single_plan_to_ask_for() -> None:
    replicas = parse_parallel(TWO)
    assert replicas.several and [r.where for r in replicas.replicas] == ["parallel.replicas[0]", "parallel.replicas[1]"]
    with pytest.raises(ValueError, match="2 replicas, each with its own plan"):
        _ = replicas.plan
    assert replicas.first_stage(1) == 1 and replicas.timeline_files() == ["timeline-replica-0.json", "timeline-replica-1.json"]


def test_the_set_of_one_trains_the_plans_own_batch_and_adds_nothing() -> None:
    one = ReplicaSet(parse_parallel(STAGES), rank=1)
    plan = one.plan
    for step in range(3):
        mine = one.batch(TRAIN, step, SEQ, VOCAB)
        same = global_batch(TRAIN.data, TRAIN.seed, step, plan.micro_batches, plan.micro_batch_size, SEQ, VOCAB)
        assert torch.equal(mine, same) and one.weight == 1.0
    one.before_backward()
    assert one.after_backward(None, 2.5) == 2.5  # type: ignore[arg-type]  # nothing to sync: the engine is not asked
    one.after_optimizer(1)
    timing = one.timing(0.1)
    assert timing[:2] == [0.0, 0.0] and math.isnan(timing[2])
    one.rebalance(1, 10, None)  # type: ignore[arg-type]  # no shares to move: the engine is not touched
    assert one.rebalanced is None and one.copies == 1 and not one.exchanges and one.index == 0
    assert one.checkpoint_parts(stage=1) == CheckpointParts()
    assert one.checkpoint_meta() == {"plan": plan.to_dict()}


def test_each_replica_trains_its_own_rows_of_one_global_batch_weighted_by_its_tokens() -> None:
    replicas = parse_parallel(TWO)
    sets = [ReplicaSet(replicas, rank) for rank in (0, 2)]  # replica 0's first rank, replica 1's only one
    whole = global_batch(TRAIN.data, TRAIN.seed, 4, 1, replicas.global_batch, SEQ, VOCAB)[0]
    parts = [s.batch(TRAIN, 4, SEQ, VOCAB) for s in sets]
    assert [tuple(p.shape) for p in parts] == [(3, 2, SEQ + 1), (1, 2, SEQ + 1)]
    assert torch.equal(torch.cat([p.reshape(-1, SEQ + 1) for p in parts]), whole)
    assert sets[0].weight == pytest.approx(0.75) and sets[0].weight + sets[1].weight == pytest.approx(1.0)
    assert sets[1].checkpoint_parts(stage=0).write is False and "replicas" in sets[1].checkpoint_meta()
