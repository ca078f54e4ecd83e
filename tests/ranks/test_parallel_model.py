"""The parallel model equals the single-process model: tp (± sp, ± tied), pipeline splits, tp=1 purity."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hal.parallel.models.layers import ShardSpec, vocab_parallel_cross_entropy
from hal.parallel.models.shards import gather_full_grads, gather_full_params
from hal.parallel.models.stage import build_stage, full_model, sync_tied_embedding_grads

from .. import parallel_model_cases as cases
from ..dist_harness import ok_values as _ok
from ..dist_harness import run_world

TOL = 1e-5
MODULE = "tests.parallel_model_cases"




def _close(loss: float, ref: float) -> bool:
    return abs(loss - ref) <= TOL * abs(ref)


def _assert_errors(errors: dict[str, float], what: str) -> None:
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"{what}: relative errors above {TOL}: {bad}"


# --- one launch of 2 processes: tensor parallelism, and a 2-process pipeline with tied embeddings ----
@pytest.fixture(scope="module")
def world2() -> dict[str, dict[int, Any]]:
    return {
        "tp": _ok(run_world(MODULE, "tp_equivalence", 2), 2),
        "pp": _ok(run_world(MODULE, "pipeline_tied_two_ranks", 2), 2),
    }


@pytest.mark.parametrize("case", ["tp2 sp=False tied=False", "tp2 sp=True tied=False", "tp2 sp=True tied=True", "tp2 sp=False tied=True"])
def test_tp2_matches_single_process(world2: dict[str, dict[int, Any]], case: str) -> None:
    for rank, rows in world2["tp"].items():
        row = next(r for r in rows if r["case"] == case)
        assert _close(row["loss"], row["ref_loss"]), (rank, row["loss"], row["ref_loss"])
        assert _close(2 * row["halved"], row["ref_loss"]), "token_count must divide the token sum"
        assert sorted(row["grads"]) == row["names"], f"rank {rank}: gathered names differ from the reference's"
        _assert_errors(row["params"], f"{case} rank {rank} initial params")
        _assert_errors(row["grads"], f"{case} rank {rank} grads")
        # Really sharded: each rank holds half of every split weight.
        assert row["local_shapes"]["embed.weight"] == (128, 64)
        assert row["local_shapes"]["layers.0.attn.qkv.weight"] == ((4 + 2 * 2) * 16 // 2, 64)
        assert row["local_shapes"]["layers.0.mlp.down.weight"] == (64, 64)
        assert row["local_shapes"]["norm.weight"] == (64,)


def test_two_process_pipeline_with_tied_embeddings(world2: dict[str, dict[int, Any]]) -> None:
    values = world2["pp"]
    assert _close(values[1]["loss"], values[1]["ref_loss"])
    assert set(values[0]["grads"]) == {"embed.weight", *(f"layers.0.{n}" for n in _LAYER_PARAMS)}
    assert set(values[1]["grads"]) == {"embed.weight", "norm.weight", *(f"layers.1.{n}" for n in _LAYER_PARAMS)}
    for rank, v in values.items():
        _assert_errors(v["grads"], f"rank {rank}")


_LAYER_PARAMS = ("attn_norm.weight", "attn.qkv.weight", "attn.out.weight", "mlp_norm.weight", "mlp.gate_up.weight", "mlp.down.weight")


def test_heterogeneous_pipelines_with_tied_embeddings() -> None:
    """World 4: tp2+sp → tp2+sp, and tp2 → dp2 (tied sums on the shard and full-vocab paths)."""
    values = _ok(run_world(MODULE, "pipeline_mixed", 4), 4)
    for plan in ("a", "b"):
        for rank, v in values.items():
            if rank >= 2:
                assert _close(v[plan]["loss"], v["ref_loss"]), (plan, rank, v[plan]["loss"], v["ref_loss"])
            _assert_errors(v[plan]["grads"], f"plan {plan} rank {rank}")
            assert "embed.weight" in v[plan]["grads"]


# --- in one process -----------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_split_in_one_process_equals_full_model(tied: bool) -> None:
    config = cases.small_config(tied)
    ref_loss, ref_grads, ref_params = cases.reference(config)
    ids, labels = cases.data()
    s0 = build_stage(config, range(0, 1), first=True, last=False, tp_comm=None, sp=False, seed=cases.SEED)
    s1 = build_stage(config, range(1, 2), first=False, last=True, tp_comm=None, sp=False, seed=cases.SEED)
    h = s0(ids)
    handed = h.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(s1(handed), labels, None)
    loss.backward()
    h.backward(handed.grad)
    assert _close(loss.item(), ref_loss)
    grads0, grads1 = gather_full_grads(s0), gather_full_grads(s1)
    if tied:  # what sync_tied_embedding_grads does between two processes
        total = grads0["embed.weight"] + grads1["embed.weight"]
        grads0["embed.weight"] = grads1["embed.weight"] = total
        sync_tied_embedding_grads(s0, None)  # no partner: a no-op
    else:
        assert "head.weight" in grads1 and "embed.weight" not in grads1
    assert set(grads0) | set(grads1) == set(ref_grads)
    assert not (set(grads0) & set(grads1)) - {"embed.weight"}
    _assert_errors(cases.compare({**grads0, **grads1}, ref_grads), "pipeline grads")
    _assert_errors(cases.compare({**gather_full_params(s0), **gather_full_params(s1)}, ref_params), "pipeline params")


class RecordingComm:
    """A size-1 'communicator' that records any method called on it."""

    size, group_rank, rank, ranks = 1, 0, 0, (0,)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise AssertionError(f"tp=1 called {name}")

        return record


@pytest.mark.parametrize("sp", [False, True])
def test_tp1_runs_no_collective_and_equals_full_model(sp: bool) -> None:
    config = cases.small_config(tied=True)
    ref_loss, ref_grads, _ = cases.reference(config)
    comm = RecordingComm()
    stage = build_stage(config, range(config.num_layers), first=True, last=True, tp_comm=comm, sp=sp, seed=cases.SEED)  # type: ignore[arg-type]
    ids, labels = cases.data()
    loss = vocab_parallel_cross_entropy(stage(ids), labels, stage.tp_comm)
    loss.backward()
    grads = gather_full_grads(stage)
    sync_tied_embedding_grads(stage, comm)  # type: ignore[arg-type]
    assert comm.calls == []
    assert loss.item() == ref_loss
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_init_depends_only_on_seed_and_name() -> None:
    config = cases.small_config()
    a, b = full_model(config, 3), full_model(config, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = full_model(config, 4)
    assert not torch.equal(a.embed.weight, c.embed.weight)
    tail = build_stage(config, range(1, 2), first=False, last=True, tp_comm=None, sp=False, seed=3)
    assert torch.equal(tail.layers["1"].mlp.down.weight, a.layers["1"].mlp.down.weight)
    assert torch.equal(a.layers["0"].attn_norm.weight, torch.ones(64))


def test_shard_spec_round_trip_keeps_fused_parts_apart() -> None:
    spec = ShardSpec(0, (4, 2, 2))  # q | k | v
    full = torch.arange(8.0).unsqueeze(-1).expand(8, 3).contiguous()
    shards = [spec.shard(full, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 4, 6] and shards[1][:, 0].tolist() == [2, 3, 5, 7]
    assert torch.equal(spec.unshard(shards), full)
    row = ShardSpec(1, (6,))
    m = torch.randn(3, 6)
    assert torch.equal(row.unshard([row.shard(m, r, 3) for r in range(3)]), m)
