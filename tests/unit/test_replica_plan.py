"""The replicas' plan: parsing, the rows' arithmetic, bad input as one line, auto shares and the sync's buckets."""
from __future__ import annotations

import pytest

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.replicas import ReplicatedPlan, RowSteps, auto_rows, parse_replicated, validate_replicated
from hal.parallel.config.topology import Topology
from hal.parallel.replicas.sync import Holding, plan_buckets

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                    max_seq_len=8)
TWO_STAGES = [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]
INTERLEAVED = {"rows": "auto", "micro_batch_size": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2,  # 4, 8, ... rows
               "stages": TWO_STAGES}
DUALPIPEV = {"rows": "auto", "micro_batch_size": 2, "schedule": "dualpipev", "virtual_stages": 2,  # 8, 10, ... rows
             "stages": TWO_STAGES}
TP2 = {"rows": 12, "micro_batch_size": 4, "stages": [{"backend": "cpu", "devices": 2, "layers": 4, "tp": 2}]}
DP2 = {"rows": 4, "micro_batch_size": 2, "stages": [{"backend": "cpu", "devices": 2, "layers": 4, "dp": 2}]}


def test_replicas_own_consecutive_ranks_and_rows() -> None:
    rep = parse_replicated({"replicas": [TP2, DP2]})
    assert rep.global_batch == 16 and rep.world_size == 4
    assert [(r.rows, r.plan.micro_batches, r.first_rank) for r in rep.replicas] == [(12, 3, 0), (4, 2, 2)]
    assert rep.row_ranges() == [range(0, 12), range(12, 16)]
    assert [rep.replica_of(rank) for rank in range(4)] == [0, 0, 1, 1]
    topologies = [Topology.from_plan(r.plan, r.first_rank) for r in rep.replicas]
    assert [list(t.ranks) for t in topologies] == [[0, 1], [2, 3]] and topologies[1].coord(3).dp == 1
    assert ReplicatedPlan.from_dict(rep.to_dict()) == rep
    validate_replicated(rep, MODEL, world_size=4, check_backends=False)


BAD = {
    "shares that do not add up": ({"replicas": [TP2, DP2], "global_batch": 15}, "add up to 16 (12 + 4)"),
    "a replica of zero rows": ({"replicas": [{**DP2, "rows": 0}]}, "'parallel.replicas[0].rows' must be a positive"),
    "rows not a multiple of the micro-batch": ({"replicas": [{**TP2, "rows": 10}]}, "not a multiple of its micro_batch_size 4"),
    "micro_batches disagreeing with rows": ({"replicas": [{**TP2, "micro_batches": 2}]}, "but rows is 12"),
    "a replica with its own model": ({"replicas": [{**TP2, "model": {"num_layers": 2}}]}, "replicas train one model"),
    "an H of 0": ({"replicas": [TP2, DP2], "replica_sync": {"every": 0}}, "'parallel.replica_sync.every' must be a positive"),
    "compression with one replica": ({"replicas": [TP2], "replica_sync": {"compress": "bf16"}}, "there is one replica"),
    "auto without a global batch": ({"replicas": [{**TP2, "rows": "auto"}, DP2]}, "global_batch is not given"),
    "a plan key beside the replicas": ({"replicas": [TP2], "schedule": "gpipe"}, "unknown key 'parallel.schedule'"),
    "auto shares of 5 rows in micro-batches of 2": (
        {"replicas": [{**DP2, "rows": "auto"}, {**DP2, "rows": "auto"}], "global_batch": 5},
        "leaves 5 rows for the auto replicas, which no split into whole micro-batches their schedules run adds up to "
        "(replica 0: 2, 4, ... rows, replica 1: 2, 4, ... rows); use global_batch 4 or 6"),
    "an interleaved auto replica left 6 rows": ({"replicas": [INTERLEAVED, {**DP2, "rows": 2}], "global_batch": 8},
                                                "(replica 0: 4, 8, ... rows); use global_batch 6 or 10"),
    "a DualPipeV auto replica left too few rows": (
        {"replicas": [DUALPIPEV, {**DP2, "rows": "auto"}], "global_batch": 8},
        "leaves 8 rows for the auto replicas, fewer than the fewest whole micro-batches their schedules run (replica 0: "
        "8, replica 1: 2); use global_batch 10 or more"),
    "an outer step of 2 or more": ({"replicas": [TP2, DP2], "replica_sync": {"every": 4, "outer_lr": 2.5}},
                                   "outer_lr is 2.5; an outer step of 2 or more overshoots"),
    "outer settings without local SGD": ({"replicas": [TP2, DP2], "replica_sync": {"outer_lr": 0.5}}, "every is 1"),
    "no replicas": ({"replicas": []}, "non-empty list of replicas"),
    "an outer momentum that never decays": ({"replicas": [TP2, DP2], "replica_sync": {"every": 4, "outer_momentum": 1.5}},
                                            "outer_momentum is 1.5; a momentum of 1 or more never decays"),
    "an outer momentum of exactly 1": ({"replicas": [TP2, DP2], "replica_sync": {"every": 4, "outer_momentum": 1}},
                                       "give one below 1"),
    "overlap with local SGD": ({"replicas": [TP2, DP2], "replica_sync": {"every": 4, "overlap": "on"}},
                               "overlap applies to the every-step gradient sync"),
    "overlap with one replica": ({"replicas": [TP2], "replica_sync": {"overlap": "on"}}, "sets overlap but there is one"),
    "an unknown overlap": ({"replicas": [TP2, DP2], "replica_sync": {"overlap": "yes"}}, "overlap"),
    "an unknown wire": ({"replicas": [TP2, DP2], "replica_sync": {"compress": "int4"}}, "compress"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_replicas_are_one_line(name: str) -> None:
    raw, words = BAD[name]
    with pytest.raises(ConfigError) as err:
        parse_replicated(raw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_replica_the_model_refuses_is_named_and_the_world_must_match() -> None:
    rep = parse_replicated({"replicas": [TP2, {**DP2, "stages": [{"backend": "cpu", "devices": 2, "layers": 3, "dp": 2}]}]})
    with pytest.raises(ConfigError, match=r"parallel\.replicas\[1\]: .*add up to 3"):
        validate_replicated(rep, MODEL, world_size=4, check_backends=False)
    with pytest.raises(ConfigError, match="the replicas use 4 devices"):
        validate_replicated(parse_replicated({"replicas": [TP2, DP2]}), MODEL, world_size=3, check_backends=False)


G2, G4 = RowSteps(2, 2), RowSteps(4, 4)  # any whole number of micro-batches of 2 (of 4) rows


def test_auto_rows_follow_speed_in_whole_micro_batches() -> None:
    assert auto_rows([3.0, 1.0], 16, [G4, G2], [None, None]) == [12, 4]
    assert auto_rows([1.0, 1.0, 1.0], 12, [G2, None, G2], [None, 4, None]) == [4, 4, 4]
    assert auto_rows([100.0, 1.0], 8, [G2, G2], [None, None]) == [6, 2]  # every replica keeps one micro-batch
    rows = auto_rows([2.0, 1.0], 30, [G4, G2], [None, None])
    assert sum(rows) == 30 and rows[0] % 4 == 0 and rows[1] % 2 == 0 and rows[0] > rows[1]
    with pytest.raises(ValueError):
        auto_rows([1.0, 1.0], 3, [G2, G2], [None, None])


def test_auto_rows_give_each_schedule_a_count_it_runs() -> None:
    """An interleaved replica takes multiples of its stages' micro-batches, a DualPipeV one at least twice its stages:
    the shares by speed honour both and still add up (they once ignored it: every rank ended in a traceback)."""
    from hal.parallel.config.replicas import row_steps

    rep = parse_replicated({"replicas": [INTERLEAVED, DUALPIPEV, {**DP2, "rows": "auto"}], "global_batch": 30})
    steps = [row_steps(r.plan, 30) for r in rep.replicas]
    assert steps == [RowSteps(4, 4), RowSteps(8, 2), RowSteps(2, 2)]
    for speeds in ([1.0, 1.0, 1.0], [10.0, 1.0, 1.0], [1.0, 10.0, 1.0], [1.0, 1.0, 10.0], [3.0, 1.0, 0.1]):
        rows = auto_rows(speeds, 30, steps, [None, None, None])
        assert sum(rows) == 30 and rows[0] % 4 == 0 and rows[1] >= 8 and rows[1] % 2 == 0 and rows[2] % 2 == 0, rows
        resolved = rep.with_rows(rows)
        assert all(r.plan.schedule.problem(r.plan.num_stages, r.plan.micro_batches) is None for r in resolved.replicas)
    assert auto_rows([10.0, 1.0, 1.0], 30, steps, [None, None, None])[0] == 20  # the fast one gets the most


def _holding(replica: int, stage: int, rank: int, names: list[str], tied: tuple[str, ...] = ()) -> Holding:
    return Holding(replica, stage, rank, tuple((n, (64, 8)) for n in names), tied)


def test_buckets_never_span_a_stage_and_speakers_take_turns() -> None:
    """Replica 0: one stage of two ranks; replica 1: two stages (layers 0 | 1 and the head), one rank each."""
    names = ["embed.weight", "layers.0.w", "layers.1.w", "head.weight"]
    holdings = [_holding(0, 0, 0, names), _holding(0, 0, 1, names),
                _holding(1, 0, 2, names[:2]), _holding(1, 1, 3, names[2:])]
    stage_ranks = {(0, 0): [0, 1], (1, 0): [2], (1, 1): [3]}
    buckets = plan_buckets(holdings, 2, lambda r, s: stage_ranks[(r, s)], bucket_bytes=64 * 8 * 4)
    assert [b.names for b in buckets] == [(n,) for n in names]
    assert [b.speakers for b in buckets] == [(0, 2), (1, 2), (0, 3), (1, 3)]
    merged = plan_buckets(holdings, 2, lambda r, s: stage_ranks[(r, s)], bucket_bytes=1 << 20)
    assert [b.names for b in merged] == [tuple(names[:2]), tuple(names[2:])]  # cut where replica 1's stage changes


def test_a_second_tied_copy_is_not_summed_twice_and_a_foreign_parameter_is_named() -> None:
    names = ["embed.weight", "layers.0.w"]
    holdings = [_holding(0, 0, 0, names), _holding(1, 0, 1, names[:1] + ["layers.0.w"]),
                _holding(1, 1, 2, ["embed.weight"], tied=("embed.weight",))]
    buckets = plan_buckets(holdings, 2, lambda r, s: [r + s], bucket_bytes=1 << 20)
    assert [b.names for b in buckets] == [tuple(names)]
    with pytest.raises(ValueError, match="replica 1 holds no parameter 'layers.0.w'"):
        plan_buckets([_holding(0, 0, 0, names), _holding(1, 0, 1, names[:1])], 2, lambda r, s: [r], 1 << 20)


def test_a_rebalance_moves_whole_granules_toward_the_faster_replica_within_bounds() -> None:
    from hal.parallel.replicas.shares import rebalanced_rows

    anything = lambda i, n: True  # noqa: E731
    # replica 0 takes 2 s for 8 rows (4 rows/s), replica 1 1 s for 8 (8 rows/s): 16 rows want 5.3 : 10.7
    assert rebalanced_rows([8, 8], [2.0, 1.0], [2, 2], [True, True], anything, max_change=1.0) == [6, 10]
    # bounded: at most a quarter of a replica's rows a look (one granule at least)
    assert rebalanced_rows([8, 8], [2.0, 1.0], [2, 2], [True, True], anything) == [6, 10]
    assert rebalanced_rows([40, 40], [2.0, 1.0], [2, 2], [True, True], anything) == [30, 50]
    # speeds within the noise margin, fixed replicas, and a schedule refusing the count: no change
    assert rebalanced_rows([8, 8], [1.04, 1.0], [2, 2], [True, True], anything) is None
    assert rebalanced_rows([8, 8], [2.0, 1.0], [2, 2], [True, False], anything) is None
    assert rebalanced_rows([8, 8], [2.0, 1.0], [2, 2], [True, True], lambda i, n: n >= 8) is None
    # granules of two sizes move their lcm; a replica keeps one granule
    assert rebalanced_rows([12, 4], [1.0, 4.0], [4, 2], [True, True], anything, max_change=1.0) is None
    assert rebalanced_rows([4, 12], [1.0, 3.0], [2, 4], [True, True], anything, max_change=1.0) == [8, 8]
    assert rebalanced_rows([2, 2], [1.0, float("nan")], [2, 2], [True, True], anything) is None


def test_a_replica_that_slows_the_job_is_named_with_the_fastest_alone() -> None:
    from hal.parallel.replicas.shares import drag_note

    # replica 0: 52 rows in 0.4 s (130 rows/s: 64 rows alone in 0.49 s); the step with the exchange takes 0.76 s
    note = drag_note([52, 12], [0.4, 0.45], 0.76)
    assert note is not None and note.startswith("replica 0 alone would step in about 0.492 s") and "replica(s) 1" in note
    assert drag_note([52, 12], [0.4, 0.45], 0.5) is None  # the second island pays for itself
    assert drag_note([52, 12], [0.4, float("nan")], 0.76) is None and drag_note([64], [0.4], 0.5) is None


def test_overlap_reads_yamls_bare_on_and_off() -> None:
    """``overlap: on`` in a YAML file arrives as True (YAML 1.1 booleans): it means on, as written."""
    import yaml

    for text, want in (("on", "on"), ("off", "off"), ("'on'", "on")):
        raw = yaml.safe_load(f"replicas: []\nreplica_sync: {{overlap: {text}}}")
        raw["replicas"] = [TP2, DP2]
        assert parse_replicated(raw).sync.overlap == want
