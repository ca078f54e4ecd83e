"""MoE layers in the pipeline engine: plans mixing MoE stages (dp, any schedule) with dense stages (tp, dp)
train as the single-process model does — the first step's loss and every gradient within 1e-5 (fp32), 12
AdamW steps within 1e-4 — and the balancing loss counts each micro-batch's tokens over its dp replicas.

The first plan of each schedule (1F1B, zero-bubble) trains STEPS (8) steps; the other layouts (ep, tp, sp, shared
experts, top-1, sigmoid) train 3 — what a layout breaks shows from step 2 on — which keeps the suite inside
its time on two cores."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hal.errors import ConfigError
from hal.parallel.config.plan import parse_plan, validate_plan

from ..conftest import REPO, run_hal
from ..dist_harness import run_world
from ..moe_cases import model_config, reference

STEPS, LR = 8, 3e-3  # AdamW steps of the long runs (one plan per schedule): drift shows within them
VARIANT_STEPS = 3


def _stage(layers: int, **grid: Any) -> dict[str, Any]:
    devices = grid.get("tp", 1) * grid.get("dp", 1)
    return {"backend": "cpu", "devices": devices, "layers": layers, **grid}


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dense tp2 -> moe dp2, 1f1b": (
        {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
         "stages": [_stage(2, tp=2), _stage(2, dp=2)]},
        {"moe_first_dense": 2}),
    "moe every layer, 4 stages, 1f1b, shared gated expert, sigmoid top-1": (
        {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
         "stages": [_stage(1), _stage(1), _stage(1), _stage(1)]},
        {"moe_top_k": 1, "moe_scoring": "sigmoid", "moe_shared_ffn_size": 16, "moe_shared_gate": True}),
    "dense tp2 -> moe dp2 ep2, 1f1b": (
        {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
         "stages": [_stage(2, tp=2), _stage(2, dp=2, ep=2)]},
        {"moe_first_dense": 2}),
    "one stage dp4 ep4, dense layer then moe": (
        {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 4, "stages": [_stage(4, dp=4, ep=4)]},
        {"moe_first_dense": 1, "moe_shared_ffn_size": 16, "moe_shared_gate": True}),
    "one stage dp4 ep2 (expert shards over 2 replicas each), top-1": (
        {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 4, "stages": [_stage(4, dp=4, ep=2)]},
        {"moe_top_k": 1, "moe_every": 2}),
    "moe tp2 -> moe tp2 (experts split over tp), shared gated expert": (
        {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
         "stages": [_stage(2, tp=2), _stage(2, tp=2)]},
        {"moe_shared_ffn_size": 16, "moe_shared_gate": True}),
    "one stage tp2 x dp2 ep2: experts split over tp and shared over ep": (
        {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 4, "stages": [_stage(4, tp=2, dp=2, ep=2)]},
        {"moe_first_dense": 1}),
    "moe tp2+sp -> moe dp2 ep2: the sequence gathered into the experts, shared gated expert": (
        {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
         "stages": [_stage(2, tp=2, sp=True), _stage(2, dp=2, ep=2)]},
        {"moe_shared_ffn_size": 16, "moe_shared_gate": True}),
    "one stage dp2 ep2, layers compiled (aot_eager): the exchange and balance all-reduce eager between graphs": (
        {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2, "compile": True, "compile_backend": "aot_eager",
         "stages": [_stage(2, dp=2, ep=2)]},
        {"moe_first_dense": 1, "num_layers": 2}),
    "moe dp2 -> moe dp2, zero-bubble, every other layer": (
        {"schedule": "zero-bubble", "micro_batches": 4, "micro_batch_size": 2,
         "stages": [_stage(2, dp=2), _stage(2, dp=2)]},
        {"moe_every": 2}),
}


LONG_RUNS = {"dense tp2 -> moe dp2, 1f1b", "moe dp2 -> moe dp2, zero-bubble, every other layer"}  # STEPS steps each
assert LONG_RUNS <= set(CASES) and {CASES[n][0]["schedule"] for n in LONG_RUNS} == {c[0]["schedule"] for c in CASES.values()}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_plan_matches_single_process(name: str) -> None:
    _matches_single_process(name, *CASES[name], steps=STEPS if name in LONG_RUNS else VARIANT_STEPS)


def test_an_ep_group_spanning_two_islands_goes_through_the_bridge() -> None:
    """dp4 ep4 with ranks 0-1 and 2-3 declared separate islands: the ep (and dp) group spans both, so the token
    all-to-alls and the count exchange go through the bridge — the same training as one device."""
    name = "one stage dp4 ep4, dense layer then moe"
    values = _matches_single_process(name + ", islands 0,0,1,1", *CASES[name], islands=[0, 0, 1, 1], steps=4)
    assert [v["ep_islands"] for v in values] == [2, 2, 2, 2]  # every rank's ep group spans both islands


def _matches_single_process(name: str, plan: dict[str, Any], moe: dict[str, Any], islands: list[int] | None = None,
                            steps: int = STEPS, backend: str = "cpu", first: float = 1e-5, later: float = 1e-4,
                            grad_rtol: float = 1e-5, grad_atol: float = 1e-7) -> list[dict[str, Any]]:
    """The plan's run on ``backend`` ranks against the single process on the cpu: the first loss within ``first``,
    every step's within ``later`` (relative), step 1's gradients within ``grad_rtol`` / ``grad_atol``."""
    world = sum(s["devices"] for s in plan["stages"])
    ref = reference(plan, moe, STEPS, LR)  # cached, shared: a shorter run reads its first steps
    if backend != "cpu":
        plan = {**plan, "stages": [{**s, "backend": backend} for s in plan["stages"]]}
    results = run_world("tests.moe_cases", "engine_run", world, deadline_s=300, plan_raw=plan, moe=moe, steps=steps,
                        lr=LR, islands=islands, backend=backend)
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [outcome[1] for outcome in results.values()]
    last = max(v["coord"][0] for v in values)
    for v in values:
        if v["coord"][0] == last:
            assert abs(v["losses"][0] - ref["losses"][0]) <= first * abs(ref["losses"][0]), (v["losses"][0], ref["losses"][0])
            assert len(v["losses"]) == steps, (len(v["losses"]), steps)
            for got, want in zip(v["losses"], ref["losses"]):
                assert abs(got - want) <= later * abs(want), (v["losses"], ref["losses"])
    seen = set()
    for v in values:
        for pname, grad in v["grads"].items():
            want = ref["grads"][pname]
            torch.testing.assert_close(torch.tensor(grad, dtype=want.dtype), want, rtol=grad_rtol, atol=grad_atol,
                                       msg=f"{name}: gradient of {pname}")
            seen.add(pname)
    assert seen == set(ref["grads"]), set(ref["grads"]) - seen
    # each MoE layer's load: over the dp replicas of its stage, the single process's per-expert counts
    for layer, want in ref["load"].items():
        holders = [v["load"][layer] for v in values if layer in v["load"]]
        assert holders, f"no rank reported MoE layer {layer}"
        assert [sum(c) for c in zip(*holders)] == want
    return values


def test_the_aux_losses_gradients_carry_the_loss_scale() -> None:
    """fp16-mixed scales the loss by S and every rank unscales its gradients by S: the balancing and z losses'
    gradients must be scaled too, or unscaling would shrink them S times. Every gradient at scale 8 is exactly 8×."""
    plan, moe = CASES["dense tp2 -> moe dp2, 1f1b"]
    one = run_world("tests.moe_cases", "scaled_grads", 4, deadline_s=120, plan_raw=plan, moe=moe, scale=1.0)
    eight = run_world("tests.moe_cases", "scaled_grads", 4, deadline_s=120, plan_raw=plan, moe=moe, scale=8.0)
    checked = 0
    for rank in one:
        assert one[rank][0] == "ok" and eight[rank][0] == "ok", (one[rank], eight[rank])
        for name, grad in one[rank][1].items():
            torch.testing.assert_close(torch.tensor(eight[rank][1][name]), 8 * torch.tensor(grad), rtol=1e-6, atol=0,
                                       msg=name)
            checked += "router" in name
    assert checked  # the routers' gradients were among them


def test_the_aux_loss_reaches_the_router_through_the_pipeline() -> None:
    """The same plan with the balancing and z losses weighted 0 gives other router gradients: the aux terms
    are in the gradients the equivalence test compares, not dropped on the way."""
    plan, moe = CASES["dense tp2 -> moe dp2, 1f1b"]
    with_aux = reference(plan, moe, 1, LR)["grads"]
    without = reference(plan, {**moe, "moe_aux_loss_weight": 0.0, "moe_z_loss_weight": 0.0}, 1, LR)["grads"]
    name = "layers.2.mlp.router.gate.weight"
    assert not torch.allclose(with_aux[name], without[name], rtol=1e-6, atol=1e-9)
    assert torch.equal(with_aux["layers.0.attn.qkv.weight"] != 0, without["layers.0.attn.qkv.weight"] != 0)


@pytest.mark.parametrize("stage_extra, run_line", [
    ({"precision": "fp8-mixed"}, "no fp8 path"),
])
def test_what_an_moe_stage_cannot_run_is_one_line(stage_extra: dict[str, Any], run_line: str) -> None:
    plan = parse_plan({"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 2},
                                  {"backend": "cpu", "devices": 1, "layers": 2, **stage_extra}]})
    with pytest.raises(ConfigError, match=run_line) as info:
        validate_plan(plan, model_config({"moe_first_dense": 2}), world_size=None, check_backends=False)
    assert "\n" not in str(info.value) and "stage 1" in str(info.value)


# --- hal train with an MoE model ---------------------------------------------------------------------------
def _moe_config(tmp_path: Path, **model: Any) -> Path:
    raw = yaml.safe_load((REPO / "examples" / "moe_cpu.yaml").read_text(encoding="utf-8"))
    raw["model"].update(model)
    raw["train"].pop("checkpoint_every", None)
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_hal_train_logs_each_moe_layers_load_and_aux_loss(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_hal("train", str(REPO / "examples" / "moe_cpu.yaml"), "--steps", "3", "--run-dir", str(run_dir), "--json",
                     timeout=300)
    assert result.returncode == 0, result.stderr
    assert "experts min/max" in result.stderr and "via all_to_all" in result.stderr  # ep 2 on cpu: the all-to-alls
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(records) == 3
    for record in records:
        moe = record["moe"]
        assert set(moe["layers"]) == {"2", "3"}  # moe_first_dense: 2 of 4 layers
        for layer in moe["layers"].values():
            # every (token, choice) pair of the step, counted once over the dp replicas: 8 rows × 64 tokens × top-2
            assert sum(layer["load"]) == 8 * 64 * 2 and len(layer["load"]) == 8
            assert layer["min_max"] == min(layer["load"]) / max(layer["load"])
            assert layer["aux_loss"] >= 1.0 - 1e-6  # E·Σ f·P is at least 1 for softmax scores
        assert moe["min_max"] == min(v["min_max"] for v in moe["layers"].values())
        assert moe["exchange"] == "all_to_all" and all(v["exchange"] == "all_to_all" for v in moe["layers"].values())


@pytest.mark.parametrize("model, stage, says", [
    ({"moe_top_k": 9}, None, "moe_top_k 9 is above model.moe_num_experts 8"),
    ({"moe_ffn_hidden_size": 15}, {"backend": "cpu", "devices": 2, "layers": 2, "tp": 2},
     "tp 2 does not divide model.moe_ffn_hidden_size 15"),
    ({"moe_first_dense": 4}, None, "no layer is an MoE layer"),
    ({"moe_aux_loss_weight": 1e308}, None, "key 'model.moe_aux_loss_weight' must be at most 1000"),  # a NaN loss otherwise
])
def test_bad_moe_runs_are_one_line_and_exit_2(tmp_path: Path, model: dict[str, Any], stage: dict[str, Any] | None,
                                              says: str) -> None:
    path = _moe_config(tmp_path, **model)
    if stage is not None:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        raw["parallel"]["stages"][1] = stage
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = run_hal("train", str(path), "--steps", "1", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_compiling_an_moe_stage_under_fallback_error_is_one_line(tmp_path: Path) -> None:
    """Compiling around the experts is a downgrade: fallback: error refuses it before any rank starts."""
    raw = yaml.safe_load(_moe_config(tmp_path).read_text(encoding="utf-8"))
    raw["fallback"] = "error"
    raw["parallel"]["stages"][1]["compile"] = True
    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = run_hal("train", str(path), "--steps", "1", "--run-dir", str(tmp_path / "run"), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "compiles MoE layers" in lines[0] and "fallback: error refuses" in lines[0]
    assert not (tmp_path / "run").exists()


def _moe_run_config(tmp_path: Path, name: str, moe_stage: dict[str, Any], steps: int) -> Path:
    """moe_cpu.yaml with ``moe_stage`` for its MoE stage, ``steps`` steps, a checkpoint half way (resumed from)."""
    raw = yaml.safe_load((REPO / "examples" / "moe_cpu.yaml").read_text(encoding="utf-8"))
    raw["parallel"]["stages"][1] = moe_stage
    raw["train"]["checkpoint_every"] = steps // 2
    raw["train"]["steps"] = steps
    raw["train"]["grad_clip"] = 1.0  # the global norm counts each expert shard once
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_an_ep_checkpoint_resumes_at_another_ep_degree(tmp_path: Path) -> None:
    """6 steps with the MoE stage at dp2 ep2 uninterrupted; its step-3 checkpoint resumed with dp2 ep1 (every expert
    on both replicas): the same losses. And a run at ep1 throughout has them too (ep changes nothing numerically)."""
    def train(config: Path, run: str, *args: str) -> dict[str, Any]:
        result = run_hal("train", str(config), "--run-dir", str(tmp_path / run), "--json", *args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    ep2 = _moe_run_config(tmp_path, "ep2", {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2, "ep": 2}, 6)
    ep1 = _moe_run_config(tmp_path, "ep1", {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2}, 6)
    full = train(ep2, "full")["losses"]
    resumed = train(ep1, "resumed", "--resume", str(tmp_path / "full" / "checkpoints" / "step-000003"))
    assert resumed["first_step"] == 4 and resumed["losses"] == pytest.approx(full[3:], rel=1e-5)
    assert train(ep1, "plain")["losses"] == pytest.approx(full, rel=1e-5)


def test_a_tp2_moe_checkpoint_resumes_at_dp2_ep2(tmp_path: Path) -> None:
    """The MoE stage with its experts split over tp2: 4 steps uninterrupted; its step-2 checkpoint resumed with the
    stage at dp2 ep2 — the same losses (checkpoints hold full experts; the clipped global norm counts each TP slice once)."""
    def train(config: Path, run: str, *args: str) -> dict[str, Any]:
        result = run_hal("train", str(config), "--run-dir", str(tmp_path / run), "--json", *args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    tp2 = _moe_run_config(tmp_path, "tp2", {"backend": "cpu", "devices": 2, "layers": 2, "tp": 2}, 4)
    ep2 = _moe_run_config(tmp_path, "ep2", {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2, "ep": 2}, 4)
    full = train(tp2, "full")["losses"]
    resumed = train(ep2, "resumed", "--resume", str(tmp_path / "full" / "checkpoints" / "step-000002"))
    assert resumed["first_step"] == 3 and resumed["losses"] == pytest.approx(full[2:], rel=1e-5)
    assert train(ep2, "plain")["losses"] == pytest.approx(full, rel=1e-5)


def test_zero1_with_ep_trains_as_plain_adamw_and_its_checkpoint_resumes_without_it(tmp_path: Path) -> None:
    """One MoE stage at dp4 ep2 (two replicas of each expert shard): ZeRO-1 shards the dense state over 4 ranks and
    each expert shard's over its 2 replicas. 4 steps equal the same run without ZeRO-1; its step-2 checkpoint,
    resumed without it at dp4 ep1, gives the last 2."""
    raw = yaml.safe_load((REPO / "examples" / "moe_cpu.yaml").read_text(encoding="utf-8"))
    raw["train"]["checkpoint_every"] = 2  # the ZeRO-1 run's step-2 checkpoint is resumed without it
    raw["train"]["steps"] = 4

    def config(name: str, **plan: Any) -> Path:
        stage = {"backend": "cpu", "devices": 4, "layers": 4, "dp": 4, "ep": plan.pop("ep")}
        body = {**raw, "model": {**raw["model"], "moe_first_dense": 0},
                "parallel": {**raw["parallel"], "stages": [stage], "micro_batch_size": 4, **plan}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body), encoding="utf-8")
        return path

    def train(path: Path, run: str, *args: str) -> dict[str, Any]:
        result = run_hal("train", str(path), "--run-dir", str(tmp_path / run), "--json", *args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    plain = train(config("plain", ep=2), "plain")["losses"]
    sharded = config("zero1", ep=2, zero1=True)
    assert train(sharded, "zero1")["losses"] == pytest.approx(plain, rel=1e-5)
    resumed = train(config("ep1", ep=1), "resumed", "--resume", str(tmp_path / "zero1" / "checkpoints" / "step-000002"))
    assert resumed["first_step"] == 3 and resumed["losses"] == pytest.approx(plain[2:], rel=1e-5)


@pytest.mark.parametrize("stage, says", [
    ({"backend": "cpu", "devices": 2, "layers": 2, "dp": 2, "ep": 3}, "ep 3 does not divide the stage's dp 2"),
    ({"backend": "cpu", "devices": 1, "layers": 2, "dp": 1, "ep": 1}, None),
])
def test_ep_refusals(tmp_path: Path, stage: dict[str, Any], says: str | None) -> None:
    from hal.parallel.config.plan import parse_plan, validate_plan

    plan = {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
            "stages": [{"backend": "cpu", "devices": 2, "layers": 2, "dp": 2, "ep": 2}, stage]}
    model = model_config({"moe_first_dense": 2, "moe_num_experts": 4})
    with pytest.raises(ConfigError, match="holds no MoE layer"):  # stage 0's layers 0-1 are dense
        validate_plan(parse_plan(plan), model, world_size=None, check_backends=False)
    plan["stages"][0] = {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2}
    if says is None:
        validate_plan(parse_plan(plan), model, world_size=None, check_backends=False)
        with pytest.raises(ConfigError, match="does not divide model.moe_num_experts 3"):
            bad = dict(plan, stages=[plan["stages"][0], {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2, "ep": 2}])
            validate_plan(parse_plan(bad), model_config({"moe_first_dense": 2, "moe_num_experts": 3}), world_size=None,
                          check_backends=False)
        zero1_ep = dict(plan, zero1=True, stages=[plan["stages"][0], {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2, "ep": 2}])
        validate_plan(parse_plan(zero1_ep), model, world_size=None, check_backends=False)  # ZeRO-1 with ep runs
    else:
        with pytest.raises(ConfigError, match=says):
            validate_plan(parse_plan(plan), model, world_size=None, check_backends=False)
