"""Profiles: measured on this host's cpu, estimated from the catalog elsewhere (and labelled), refused for another model."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.cluster import parse_cluster, resolve
from hal.parallel.planner.estimate import estimate_device
from hal.parallel.planner.make_profile import make_profile
from hal.parallel.planner.profile_store import load_profile

MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, max_seq_len=32)
CLUSTER = {"groups": [{"backend": "cpu", "device": "cpu-generic", "count": 4, "cores": 2},
                      {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2, "node": 1}]}


@pytest.fixture(scope="module")
def profile():
    return make_profile(resolve(parse_cluster(CLUSTER)), MODEL, "fp32", 32, quick=True, links=False)


def test_profile_round_trip_and_labels(profile, tmp_path) -> None:
    path = tmp_path / "p.json"
    profile.save(path)
    back = load_profile(path, MODEL, "fp32")
    cpu, h100 = back.devices["cpu-generic"], back.devices["nvidia-h100-sxm"]
    assert cpu.source == "measured" and cpu.threads == 1 and back.estimated() == ["nvidia-h100-sxm"]
    assert h100.estimated and "estimated from the catalog" in h100.basis and "documented default" in h100.basis
    assert back.to_dict() == profile.to_dict()
    f1, b1, a1 = cpu.layer(1, 1, 32, False)
    f2, b2, a2 = cpu.layer(1, 2, 32, False)
    assert f1 > 0 and f2 > 0 and b1 > 0 and 0 < a1 < a2  # more rows: more saved activations (times: no order asserted)
    assert cpu.layer(1, 2, 32, True)[2] < a2  # recompute keeps the layer input only
    assert cpu.layer(1, 2, 32, True)[2] == 2 * 32 * 64 * 4
    assert h100.layer(1, 1, 32, False)[0] < f1  # an H100 estimate beats one cpu thread
    assert h100.layer(1, 1, 32, False)[2] == pytest.approx(a1)  # activations: the measured device's bytes


def test_the_fused_head_is_measured_beside_the_plain_one_and_survives_a_round_trip(profile, tmp_path) -> None:
    """The cpu's fused head runs the reference linear-CE (it forms the logits: bytes a token of the vocabulary's size,
    no weight gradient held); the estimated H100, of another backend, takes the Triton kernel's bytes from the formula
    (the input's gradient a token, the weight's each micro-batch), not the cpu's. A profile written before the fused
    head was measured (no key, or null) still loads, with none."""
    cpu, h100 = profile.devices["cpu-generic"], profile.devices["nvidia-h100-sxm"]
    assert cpu.fused_head is not None and cpu.fused_head.forward_s > 0 and cpu.fused_head.activation_bytes > MODEL.vocab_size
    assert cpu.fused_head.fixed_bytes < 64 * 4  # no vocab x hidden buffer on the reference path
    assert h100.fused_head is not None and h100.fused_head.activation_bytes == 3 * MODEL.hidden_size * 4  # fp32
    assert h100.fused_head.fixed_bytes == MODEL.vocab_size * MODEL.hidden_size * 4
    assert cpu.head_for(True) is cpu.fused_head and cpu.head_for(False) is cpu.head
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path, MODEL, "fp32").devices["cpu-generic"].fused_head == cpu.fused_head
    for older in (lambda d: d.pop("fused_head"), lambda d: d.update(fused_head=None)):
        data = json.loads(path.read_text())
        older(data["devices"]["cpu-generic"])
        path.write_text(json.dumps(data))
        back = load_profile(path, MODEL, "fp32").devices["cpu-generic"]
        assert back.fused_head is None and back.head_for(True) == cpu.head


def test_the_split_backward_is_measured_and_prices_a_split_schedule(profile, tmp_path) -> None:
    """hal profile times the zero-bubble split of a layer's backward (I with the linears' weight gradients deferred, then
    W): a fraction, kept through a round trip, lent to the estimated device; a zbv plan is priced with it (W's share
    moves the prediction), and a profile from before it was measured still loads, priced with half and saying so."""
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.planner.cost import CostModel, Placement

    cpu, h100 = profile.devices["cpu-generic"], profile.devices["nvidia-h100-sxm"]
    assert cpu.weight_share is not None and 0.0 < cpu.weight_share < 1.0
    assert h100.weight_share == cpu.weight_share
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path, MODEL, "fp32").devices["cpu-generic"].weight_share == cpu.weight_share
    cluster = resolve(parse_cluster({"groups": [{"backend": "cpu", "device": "cpu-generic", "count": 2, "cores": 2}]}))
    plan = parse_plan({"schedule": "zbv", "micro_batches": 4, "micro_batch_size": 1,
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]})
    kinds = tuple(cluster.types[:1]) * 2

    def predict(share: float | None, split_cost: tuple[float, float] | None = (1.0, 1.0)) -> Any:
        changed = dataclasses.replace(cpu, weight_share=share, split_cost=split_cost)
        prof = dataclasses.replace(profile, devices={**profile.devices, "cpu-generic": changed})
        return CostModel(cluster, prof, MODEL, 32).predict(plan, Placement.pack(plan, kinds), measured_order=True)

    low, high, older = predict(0.1), predict(0.9), predict(None)
    assert low.step_s != pytest.approx(high.step_s, rel=1e-6)
    assert not any("assumed half" in e or "priced with whole layers" in e for e in low.estimated)
    assert any("assumed half the backward" in e for e in older.estimated)
    # the split program's own cost (a compiled layer's graph breaks): measured, and it prices the split plan
    assert cpu.split_cost is not None and all(x > 0 for x in cpu.split_cost) and h100.split_cost is None  # no cuda donor
    assert predict(0.3, (2.0, 2.0)).step_s > 1.5 * predict(0.3, (1.0, 1.0)).step_s
    assert any("priced with whole layers" in e for e in predict(0.3, None).estimated)
    data = json.loads(path.read_text())
    data["devices"]["cpu-generic"].pop("weight_share")
    path.write_text(json.dumps(data))
    assert load_profile(path, MODEL, "fp32").devices["cpu-generic"].weight_share is None
    data["devices"]["cpu-generic"]["split_cost"] = [1.2]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="split_cost: must be a list of 2 numbers"):
        load_profile(path, MODEL, "fp32")
    data["devices"]["cpu-generic"]["split_cost"] = None
    data["devices"]["cpu-generic"]["weight_share"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="weight_share: must be a fraction between 0 and 1"):
        load_profile(path, MODEL, "fp32")


def test_saved_bytes_leave_out_parameters_and_views_of_them() -> None:
    """A linear layer saves its input and its weight (as a transposed view in fp32): only the input is an activation."""
    import torch

    from hal.parallel.planner.measure import saved_bytes

    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 64, requires_grad=True)
    with saved_bytes() as box:
        layer(x).sum().backward()
    assert box[0] == x.numel() * 4


def test_a_profile_for_another_model_or_precision_is_refused(profile, tmp_path) -> None:
    path = tmp_path / "p.json"
    profile.save(path)
    with pytest.raises(ConfigError, match=r"measured for another model \(differs in hidden_size\)"):
        load_profile(path, dataclasses.replace(MODEL, hidden_size=128), "fp32")
    with pytest.raises(ConfigError, match="measured at precision fp32, the config trains bf16-mixed"):
        load_profile(path, MODEL, "bf16-mixed")
    load_profile(path, dataclasses.replace(MODEL, max_seq_len=64), "fp32")  # sequence length: points carry it
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not a profile"):
        load_profile(tmp_path / "bad.json", MODEL, "fp32")
    damaged = json.loads(path.read_text())
    damaged["devices"]["cpu-generic"]["layers"] = [{"tp": 1}]  # the right stamp, a broken body
    (tmp_path / "damaged.json").write_text(json.dumps(damaged))
    with pytest.raises(ConfigError, match=r"a damaged profile \(TypeError: .*\); run hal profile again"):
        load_profile(tmp_path / "damaged.json", MODEL, "fp32")


def test_a_device_without_catalog_figures_is_not_invented() -> None:
    ascend = resolve(parse_cluster({"groups": [{"backend": "ascend", "device": "huawei-ascend-910b", "count": 8}]})).types[0]
    with pytest.raises(ConfigError, match=r"no dense bf16 peak .* declare it on the cluster group"):
        estimate_device(ascend, MODEL, "bf16-mixed", 32, None)


def test_a_compiling_config_gets_its_layers_timed_compiled() -> None:
    """A compiled layer is another program: hal profile of a config that compiles times the layers compiled (here
    aot_eager: traced, no code generated), the profile says so, and the cost model labels a plan whose stages
    were timed the other way."""
    import torch

    from hal.parallel.config.plan import ParallelPlan, StagePlan
    from hal.parallel.planner.cost import CostModel, Placement

    cluster = resolve(parse_cluster({"groups": [{"backend": "cpu", "device": "cpu-generic", "count": 1, "cores": 2}]}))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    before = sum(counters["stats"].values())
    compiled = make_profile(cluster, MODEL, "fp32", 32, quick=True, links=False, compile_backend="aot_eager")
    assert sum(counters["stats"].values()) > before  # dynamo traced the layers
    assert compiled.meta["compiled_layers"] == "aot_eager" and "layers compiled (aot_eager)" in compiled.devices["cpu-generic"].basis
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in compiled.devices["cpu-generic"].layers)
    eager = make_profile(cluster, MODEL, "fp32", 32, quick=True, links=False)
    assert eager.meta["compiled_layers"] is None
    plan = ParallelPlan((StagePlan("cpu", 1, 4),), "1f1b", 2, 1)
    kinds = Placement.pack(plan, (cluster.types[0],))
    for profile, stage_compiles, label in ((compiled, True, None), (eager, False, None),
                                           (compiled, False, "run eager layers, timed compiled"),
                                           (eager, True, "compile their layers, timed eager")):
        pred = CostModel(cluster, profile, MODEL, 32).predict(dataclasses.replace(plan, compile=stage_compiles), kinds)
        notes = [e for e in pred.estimated if "timed" in e]
        assert (notes == []) if label is None else (label in notes[0]), (stage_compiles, notes)


BIG = ModelConfig(vocab_size=32000, hidden_size=8192, num_layers=2, num_heads=64, num_kv_heads=8,
                  ffn_hidden_size=28672, max_seq_len=4096)  # one layer at 2 rows x 4096 tokens: ~7e12 FLOPs


def _gpus_and_this_cpu() -> tuple[Any, Any]:
    """4 H100 (estimated here) beside this host's cpu: the cluster as probed, and the same declared."""
    groups = [{"backend": "cuda", "device": "nvidia-h100-sxm", "count": 4}, {"backend": "cpu", "device": "cpu-generic",
                                                                           "count": 2, "cores": 2}]
    declared = resolve(parse_cluster({"groups": groups}))
    return dataclasses.replace(declared, probed=True), declared


def test_a_layer_too_big_for_the_cpu_is_decided_before_anything_is_measured() -> None:
    """A probed cluster of GPUs and this host's cpu (the cpu present here, the GPUs estimated): the cpu is left out,
    said; the cpu alone, or a cpu the user declared, is refused in one line — before any timing."""
    from hal.launch import run_function
    from hal.parallel.planner.make_profile import fit_to_host

    probed, declared = _gpus_and_this_cpu()
    said: list[str] = []
    fitted = fit_to_host(probed, BIG, 4096, quick=True, progress=said.append)
    assert [t.device for t in fitted.types] == ["nvidia-h100-sxm"]
    assert len(said) == 1 and "cpu-generic" in said[0] and "left out" in said[0] and said[0] in fitted.notes
    assert fit_to_host(probed, MODEL, 32, quick=True) is probed  # a small model: nothing left out
    for cluster in (declared, dataclasses.replace(probed, types=probed.types[1:])):
        with pytest.raises(ConfigError, match="too much to time on the cpu"):
            fit_to_host(cluster, BIG, 4096, quick=True)
        steps: list[str] = []  # make_profile says each measurement as it starts it: the links first
        with pytest.raises(ConfigError, match="too much to time on the cpu"):
            make_profile(cluster, BIG, "fp32", 4096, links=True, launch=run_function, progress=steps.append)
        assert steps == [], steps  # refused from the shapes, before anything was timed


MID = ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=4,
                  ffn_hidden_size=8192, max_seq_len=2048)  # one layer at 2 rows x 2048 tokens: ~4e11 FLOPs


def test_the_host_cpu_beside_accelerators_is_left_out_where_its_calibration_would_take_minutes() -> None:
    """A layer the cpu can time alone, but not on a rank a core for a GPU host's calibration pipelines (on a 1 x H200
    host a 1.2B config's profile ran past 200 s): beside accelerators, a probed cpu is left out (said); the cpu alone,
    or declared beside them, is kept."""
    from hal.parallel.planner.make_profile import fit_to_host

    probed, declared = _gpus_and_this_cpu()
    said: list[str] = []
    fitted = fit_to_host(probed, MID, 2048, quick=True, progress=said.append)
    assert [t.device for t in fitted.types] == ["nvidia-h100-sxm"]
    assert len(said) == 1 and "beside the accelerators" in said[0] and said[0] in fitted.notes
    alone = dataclasses.replace(probed, types=probed.types[1:])
    assert fit_to_host(alone, MID, 2048, quick=True) is alone
    assert fit_to_host(declared, MID, 2048, quick=True) is declared
