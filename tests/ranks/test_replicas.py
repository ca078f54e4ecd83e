"""Replicas on different islands compute the single-device training: every replica its own declared island (each
cross-replica byte goes through the bridge), uneven shares, different layouts."""
from __future__ import annotations

import pytest
import torch

from ..dist_harness import run_world
from ..engine_cases import reference
from ..moe_cases import reference as moe_reference


def _stage(devices: int, layers: int, **grid: object) -> dict[str, object]:
    return {"backend": "cpu", "devices": devices, "layers": layers, **grid}


CASES = {
    "a: shares 3:1, tp2 beside dp2": {
        "replicas": [{"rows": 12, "micro_batch_size": 4, "stages": [_stage(2, 4, tp=2)]},
                     {"rows": 4, "micro_batch_size": 2, "stages": [_stage(2, 4, dp=2)]}]},
    "b: a 2-stage 1f1b pipeline beside a 1-stage gpipe replica, tied embeddings": {
        "replicas": [{"rows": 6, "micro_batch_size": 2, "stages": [_stage(1, 3), _stage(1, 1)]},
                     {"rows": 2, "micro_batch_size": 1, "schedule": "gpipe", "stages": [_stage(1, 4)]}]},
    "c: three replicas, ZeRO-1 inside the first": {
        "replicas": [{"rows": 4, "micro_batch_size": 2, "zero1": True, "stages": [_stage(2, 4, dp=2)]},
                     {"rows": 2, "micro_batch_size": 2, "stages": [_stage(1, 4)]},
                     {"rows": 6, "micro_batch_size": 3, "stages": [_stage(1, 4)]}]},
    "d: MoE, ep2 inside one replica": {
        "replicas": [{"rows": 4, "micro_batch_size": 2, "stages": [_stage(2, 4, dp=2, ep=2)]},
                     {"rows": 2, "micro_batch_size": 2, "stages": [_stage(1, 4)]}]},
    "e: shares moved every step (12:4, 4:12, 8:8), tp2 beside dp2": {
        "replicas": [{"rows": 12, "micro_batch_size": 4, "stages": [_stage(2, 4, tp=2)]},
                     {"rows": 4, "micro_batch_size": 2, "stages": [_stage(2, 4, dp=2)]}]},
}
SHARES = {"e: shares moved every step (12:4, 4:12, 8:8), tp2 beside dp2": [[12, 4], [4, 12], [8, 8]]}
TIED = {"b: a 2-stage 1f1b pipeline beside a 1-stage gpipe replica, tied embeddings"}
# case b's pipeline replica spans two islands (as a mixed replica of the planner's, a stage on each vendor): its
# stages' boundary and each stage's part of the exchange go through the bridge
ISLANDS = {"b: a 2-stage 1f1b pipeline beside a 1-stage gpipe replica, tied embeddings": [0, 1, 2]}
MOE = {"d: MoE, ep2 inside one replica": {"moe_aux_loss_weight": 0.0, "moe_z_loss_weight": 0.0}}
STEPS, LR = 10, 3e-3  # 10 AdamW steps within 1e-4: a replica's layout shows from step 2; drift is test_engine's


@pytest.mark.parametrize("name", list(CASES))
def test_replicas_match_single_process(name: str) -> None:
    raw = CASES[name]
    tied, moe = name in TIED, MOE.get(name)
    sizes = [sum(s["devices"] for s in r["stages"]) for r in raw["replicas"]]
    rows = sum(r["rows"] for r in raw["replicas"])
    single = {"schedule": "gpipe", "micro_batches": 1, "micro_batch_size": rows, "stages": [_stage(1, 4)]}
    ref = moe_reference(single, moe, STEPS, LR) if moe is not None else reference(single, STEPS, LR, tied=tied)
    islands = ISLANDS.get(name) or [i for i, n in enumerate(sizes) for _ in range(n)]
    results = run_world("tests.replica_cases", "replica_run", sum(sizes), deadline_s=300, islands=islands, raw=raw,
                        steps=STEPS, lr=LR, tied=tied, moe=moe, shares=SHARES.get(name))
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [outcome[1] for outcome in results.values()]
    for v in values:
        assert abs(v["losses"][0] - ref["losses"][0]) <= 1e-5 * abs(ref["losses"][0]), (v["losses"][0], ref["losses"][0])
        for got, want in zip(v["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-4 * abs(want), (v["losses"], ref["losses"])
        assert all(n == len(sizes) for n in v["bridged"]), v["bridged"]  # one island a speaker: through the bridge
    for replica in range(len(sizes)):
        seen = set()
        for v in (v for v in values if v["replica"] == replica):
            for pname, grad in v["grads"].items():
                want = ref["grads"][pname]
                torch.testing.assert_close(torch.tensor(grad, dtype=want.dtype), want, rtol=1e-5, atol=1e-7,
                                           msg=f"{name}: replica {replica}: gradient of {pname}")
                seen.add(pname)
        assert seen == set(ref["grads"]), (replica, set(ref["grads"]) - seen)
    assert sum(v["bytes_sent"] for v in values) > 0


LOCAL = {"replicas": [{"rows": 4, "micro_batch_size": 2, "stages": [_stage(2, 4, tp=2)]},
                      {"rows": 2, "micro_batch_size": 2, "stages": [_stage(1, 4)]}]}


def _run_twice(local_sgd: dict, inner: str, steps: int) -> list[dict]:
    results = run_world("tests.replica_cases", "replica_run", 3, deadline_s=300, islands=[0, 0, 1], raw=LOCAL,
                        steps=steps, lr=0.05 if inner == "sgd" else LR, inner=inner, local_sgd=local_sgd, runs=2)
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    return [outcome[1] for outcome in results.values()]


def test_local_sgd_every_step_is_the_gradient_sync_and_every_h_sends_less() -> None:
    """H = 1, outer lr 1, no momentum, inner SGD: the every-step gradient sync's parameters (the outer step of the
    weighted mean delta is the step of the weighted mean gradient). Both runs in one world."""
    values = _run_twice({"every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}, "sgd", 6)
    for v in values:
        for pname, want in v["first"]["params"].items():
            torch.testing.assert_close(v["second"]["params"][pname], want, rtol=1e-5, atol=1e-6, msg=pname)
        assert v["second"]["losses"][0] == v["first"]["losses"][0]
    # every step a delta crosses, as many bytes as the gradient sync's
    assert sum(v["second"]["bytes_sent"] for v in values) == sum(v["first"]["bytes_sent"] for v in values) > 0


def test_local_sgd_meets_every_h_steps_and_the_replicas_leave_equal() -> None:
    """H = 4 with Nesterov momentum over 8 AdamW steps: two meetings (a quarter of the sync's bytes), after which
    every replica holds the same parameters; the run still learns."""
    values = _run_twice({"every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}, "adamw", 8)
    sync_bytes = sum(v["first"]["bytes_sent"] for v in values)
    local_bytes = sum(v["second"]["bytes_sent"] for v in values)
    assert local_bytes * 4 == sync_bytes, (local_bytes, sync_bytes)
    ref = values[0]["second"]["params"]
    for v in values[1:]:
        for pname, want in ref.items():
            assert torch.equal(v["second"]["params"][pname], want), pname  # one outer step, the same bits everywhere
    losses = values[0]["second"]["losses"]
    assert losses[-1] < losses[0], losses


FP8 = {"replicas": [{"rows": 6, "micro_batch_size": 2, "stages": [_stage(1, 4)]},
                    {"rows": 2, "micro_batch_size": 2, "stages": [_stage(1, 4)]}]}


def test_fp8_on_the_wire_keeps_what_it_rounds_away_and_trains_close_to_exact() -> None:
    """compress: fp8 — a quarter of the bytes; error feedback makes the sum over steps of what crossed equal the sum of
    the true values minus the last residual (without it, a value fp8 cannot hold beside its block's largest is lost
    every step); a replicated run's first loss is exact (it precedes any sync) and its steps stay near exact."""
    steps = 12
    results = run_world("tests.replica_cases", "fp8_wire_run", 2, deadline_s=300, islands=[0, 1], steps=steps,
                        replicated={"raw": FP8, "steps": STEPS, "lr": LR})
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    a, b = (outcome[1] for outcome in results.values())
    assert torch.equal(a["summed"], b["summed"]), "every speaker must hold the same sum, bit for bit"
    exact = a["exact"]
    assert a["wire_bytes"] == 3072 + 3 * 4  # 3000 values padded to 3 blocks of 1024, one byte each, and 3 scales
    step_error = (a["summed"] - exact).abs().max()
    assert 0 < step_error <= 2 * 448 / 16, step_error  # one step: within each block's rounding, but not exact
    # the small values (1e-3 beside 448: below fp8's reach at that block's scale)
    small = slice(6, 1024)
    fed = (a["summed"][:, small].sum(0) - exact[:, small].sum(0)).abs().max()
    lost = (a["unfed"][:, small].sum(0) - exact[:, small].sum(0)).abs().max()
    assert lost > steps * 1e-3, lost  # without feedback: every step's small values rounded off, the loss grows
    assert fed <= 2 * 2 ** -9, fed  # with it: never more than one step's rounding of each sender
    # over every step, what crossed + what the senders still hold = the true sum
    torch.testing.assert_close(a["summed"].sum(0) + a["residuals"], exact.sum(0), rtol=1e-5, atol=1e-4)

    ref = reference({"schedule": "gpipe", "micro_batches": 1, "micro_batch_size": 8, "stages": [_stage(1, 4)]}, STEPS, LR)
    runs = [a["replicated"], b["replicated"]]
    for run in runs:
        assert abs(run["losses"][0] - ref["losses"][0]) <= 1e-5 * ref["losses"][0]
        drift = max(abs(g - w) / w for g, w in zip(run["losses"], ref["losses"]))
        assert drift <= 0.02, (run["losses"], ref["losses"])
        for pname, want in ref["grads"].items():
            got = torch.tensor(run["grads"][pname], dtype=want.dtype)
            assert (got - want).norm() <= 0.1 * want.norm() + 1e-8, pname
    assert runs[0]["losses"] == runs[1]["losses"]
    params = sum(t.numel() for t in ref["grads"].values())
    fp32_bytes = 2 * 4 * params * STEPS  # both speakers, every step
    assert 0.25 <= sum(r["bytes_sent"] for r in runs) / fp32_bytes <= 0.27


OVERLAP = {"replicas": [{"rows": 6, "micro_batch_size": 2, "stages": [_stage(2, 4, dp=2)]},
                        {"rows": 2, "micro_batch_size": 1, "stages": [_stage(1, 2), _stage(1, 2)]}]}


def test_the_exchange_during_the_backward_starts_buckets_early_and_computes_the_same_training() -> None:
    """Small buckets (many a stage), a dp2 replica beside a 2-stage pipeline replica, every stage overlapping: most
    buckets start from the gradient hooks, before the backward ends, and the run is the single-device training."""
    results = run_world("tests.replica_cases", "replica_run", 4, deadline_s=300, islands=[0, 0, 1, 1], raw=OVERLAP,
                        steps=STEPS, lr=LR, bucket_bytes=4096)
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [outcome[1] for outcome in results.values()]
    ref = reference({"schedule": "gpipe", "micro_batches": 1, "micro_batch_size": 8, "stages": [_stage(1, 4)]}, STEPS, LR)
    for v in values:
        assert isinstance(v["overlapped"], int) and v["overlapped"] >= 2 * STEPS, v["overlapped"]  # buckets a step, early
        for got, want in zip(v["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-4 * abs(want), (v["losses"], ref["losses"])
        for pname, grad in v["grads"].items():
            want = ref["grads"][pname]
            torch.testing.assert_close(torch.tensor(grad, dtype=want.dtype), want, rtol=1e-5, atol=1e-7, msg=pname)
