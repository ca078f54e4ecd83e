"""The Ascend and Cambricon stand-ins: ``npu`` / ``mlu`` devices over host memory and HCCL / CNCL over gloo.

Every check runs in a child process: a stand-in renames PyTorch's one PrivateUse1 device, which lasts as long as the
process, so the suite's own workers never hold one. The children train, save, load and communicate on the stand-in
device and compare with the same code on the CPU; the device's documented limits are refused as the hardware would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ..conftest import run_hal
from ..plain_client import run_plain, shared

REPO = Path(__file__).resolve().parents[2]


def child(code: str, standin: str = "ascend", timeout: float = 180, **env: str) -> dict:
    """Run ``code`` under HAL_STANDIN=``standin`` as ``python -c`` (forked from the plain server, which imported torch
    and no hal; HAL_TEST_FORK=0: a fresh interpreter); the JSON it prints last."""
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("HAL_")}, "HAL_STANDIN": standin,
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    source = textwrap.dedent(code)
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=full, timeout=timeout,
                              cwd=REPO)
    else:
        done = run_plain(shared(), ["-c", source], full, REPO, timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


TRAIN = """
    import json, torch
    from hal.backend_registry import get_backend

    backend = get_backend("{backend}")
    status = backend.availability()

    def losses(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(4):
            x, y = torch.randn(5, 8).to(device), torch.randint(0, 4, (5,)).to(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            out.append(loss.item())
        held = backend.memory_allocated(0) if device != "cpu" else 0  # the model, its grads and AdamW's state
        return out, str(next(model.parameters()).device), held

    cpu, _, _ = losses("cpu")
    dev, where, held = losses("{device}")
    from hal.errors import HalError
    other = get_backend("{other}").availability()  # one vendor runtime per process: answered by a child process
    try:
        get_backend("{other}").synchronize()
        used = None
    except HalError as exc:
        used = str(exc)
    try:
        backend.set_reduced_precision_matmul(True)
        tf32 = None
    except HalError as exc:
        tf32 = str(exc)
    print(json.dumps({{"available": status.available, "reason": status.reason, "cpu": cpu, "dev": dev, "where": where,
                      "allocated": held, "after": backend.memory_allocated(0), "peak": backend.max_memory_allocated(0),
                      "name": backend.device_name(0), "other": [other.available, other.reason, used], "tf32": tf32,
                      "tf32_native": backend.capabilities(0).dtypes.get("tf32")}}))
"""


@pytest.mark.parametrize("backend,device,model,other", [("ascend", "npu", "Ascend910B2", "cambricon"),
                                                        ("cambricon", "mlu", "MLU370-X8", "ascend")])
def test_a_model_trains_on_the_standin_device_as_on_the_cpu(backend: str, device: str, model: str, other: str) -> None:
    got = child(TRAIN.format(backend=backend, device=device, other=other), standin=f"{backend}:{model},{other}")
    assert got["available"] and "stand-in: host-backed, not hardware" in got["reason"], got["reason"]
    assert got["where"] == f"{device}:0" and got["dev"] == got["cpu"], got  # host kernels: the same bits
    assert 0 < got["allocated"] <= got["peak"] and got["after"] < got["allocated"], got  # the stand-in's own bytes
    assert got["name"] == model, got
    # the other vendor's stand-in: available as a child process holding its runtime sees it, unusable here
    available, reason, used = got["other"]
    assert available and "probed in a child process (one vendor runtime per process" in reason, reason
    assert used and "cannot run in this process: one vendor runtime per process" in used and "\n" not in used, used
    if backend == "cambricon":  # an MLU370 has no TF32: the backend refuses to switch it on
        assert got["tf32_native"] == "absent" and got["tf32"], got


def test_the_device_refuses_what_the_hardware_refuses_and_keeps_what_it_keeps() -> None:
    got = child("""
        import io, json, torch
        from hal.backend_registry import get_backend

        get_backend("ascend").require_available()
        import torch_npu
        x = torch.arange(6.0).reshape(2, 3).to("npu")
        said = {}
        for name, fn in {"fp64": lambda: x.double().sum(), "mixed": lambda: x + torch.ones(2, 3),
                         "numpy": lambda: x.numpy()}.items():
            try:
                fn()
                said[name] = None
            except (RuntimeError, TypeError) as exc:
                said[name] = str(exc)
        buf = io.BytesIO(); torch.save({"x": x}, buf)
        buf.seek(0); on_cpu = torch.load(buf, map_location="cpu")["x"]
        buf.seek(0); back = torch.load(buf)["x"]
        with torch.autocast("npu", dtype=torch.bfloat16):
            mm = (x @ x.t()).dtype
        scaled = {}
        for name, make in {"hal": lambda: get_backend("ascend").grad_scaler(),
                           "torch": lambda: torch.amp.GradScaler("npu")}.items():
            w = torch.ones(3, device="npu", requires_grad=True)
            opt = torch.optim.SGD([w], lr=0.1)
            scaler = make()
            try:
                scaler.scale((w * 2).sum()).backward(); scaler.step(opt); scaler.update()
                scaled[name] = [type(scaler).__name__, w.detach().cpu().tolist()]
            except RuntimeError as exc:
                scaled[name] = str(exc)
        print(json.dumps({**said, "scalar": (x + torch.tensor(1.0)).sum().item(), "cpu_load": str(on_cpu.device),
                          "load": str(back.device), "equal": torch.equal(on_cpu, x.cpu()), "autocast": str(mm),
                          "package": torch_npu.__version__, "hf32": torch_npu.npu.matmul.allow_hf32,
                          "rms": str(torch_npu.npu_rms_norm(x, torch.ones(3, device="npu"))[0].device), "scaled": scaled}))
    """)
    assert "float64" in got["fp64"] and "not hardware" in got["fp64"], got["fp64"]
    assert "same device" in got["mixed"] and "npu:0 and cpu" in got["mixed"], got["mixed"]
    assert "to numpy" in got["numpy"], got["numpy"]
    assert got["scalar"] == 21.0  # a 0-dim host tensor meets the device, as on CUDA
    assert got["cpu_load"] == "cpu" and got["load"] == "npu:0" and got["equal"], got
    assert got["autocast"] == "torch.bfloat16" and got["hf32"] is False and got["rms"] == "npu:0", got
    assert got["package"].endswith("+standin")
    # torch's scaler takes the scale's reciprocal in float64 on the device, which the NPU refuses; hal's in float32
    assert "float64" in got["scaled"]["torch"], got["scaled"]
    assert got["scaled"]["hal"][0] == "Fp32ReciprocalGradScaler" and got["scaled"]["hal"][1] == pytest.approx([0.8] * 3), got


def test_checkpoints_pinned_memory_streams_and_recurrent_layers_work_on_the_device() -> None:
    """What the migration corpus found: torch.load(map_location=<the device>) crashed torch (a device written in Python
    has no storages), pin_memory() needs a C++ runtime's allocator, record_stream took no stand-in stream, in-place
    shape changes (GRU's transpose_, ATen's arange into an out= tensor) left the wrapper's shape behind, and the fused
    recurrent cells had no kernel to run. What the operator survey found: torch.tensor(data, device=npu) hit torch's
    own assert (its C++ constructor excludes the Python key)."""
    got = child("""
        import io, json, torch
        from hal.backend_registry import get_backend

        get_backend("ascend").require_available()
        x = torch.arange(6.0).reshape(2, 3).to("npu")
        buf = io.BytesIO(); torch.save({"x": x, "nested": [x * 2]}, buf)
        tags = []
        buf.seek(0); torch.load(buf, map_location=lambda s, loc: tags.append(loc) or s)
        loads = {}
        for name, where in {"none": None, "str": "npu", "index": "npu:0", "device": torch.device("npu", 0),
                            "dict": {"npu:0": "npu:0"}, "lambda": lambda s, loc: s.npu(0), "cpu": "cpu"}.items():
            buf.seek(0)
            out = torch.load(buf, map_location=where)
            loads[name] = [str(out["x"].device), str(out["nested"][0].device), out["nested"][0].cpu().tolist()]
        try:
            torch.ones(2).untyped_storage().npu()
            outside = None
        except RuntimeError as exc:
            outside = str(exc)
        host = torch.ones(4)
        pinned = host.pin_memory()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2, pin_memory=True)
        batches = [b[0].is_pinned() for b in loader]
        y = pinned.to("npu", non_blocking=True)
        y.record_stream(torch.npu.current_stream())
        z = torch.randn(4, 3).to("npu"); z.t_()
        grown = torch.empty(0, device="npu"); torch.add(torch.ones(3, device="npu"), 1, out=grown)
        def rnn(kind, device):
            torch.manual_seed(0)
            layer = getattr(torch.nn, kind)(6, 5, batch_first=True).to(device)
            inp = torch.randn(3, 4, 6).to(device).requires_grad_()
            out, _ = layer(inp)
            (out * out).sum().backward()
            return [list(out.shape), out.detach().cpu(), inp.grad.cpu(), layer.weight_hh_l0.grad.cpu()]
        close = {}
        for kind in ("GRU", "LSTM"):
            a, b = rnn(kind, "cpu"), rnn(kind, "npu")
            close[kind] = [a[0] == b[0]] + [torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(a[1:], b[1:])]
        built = torch.tensor([[1.5, 2.5]], device="npu", requires_grad=True)  # found by the operator survey
        made = [str(built.device), built.requires_grad, built.is_leaf, built.cpu().tolist(),
                torch.tensor([], dtype=torch.uint8, device="npu").dtype == torch.uint8,
                torch.as_tensor([3, 4], device="npu").cpu().tolist(), str(torch.tensor(1.0).device)]
        print(json.dumps({"made": made, "tags": tags, "loads": loads, "outside": outside, "pinned": [pinned.is_pinned(), host.is_pinned()],
                          "batches": batches, "copied": [str(y.device), y.sum().item()], "t_": [list(z.shape), list(z.cpu().shape)],
                          "rnn": close, "arange": list(torch.arange(4, device="npu").shape), "out": grown.cpu().tolist()}))
    """)
    assert got["tags"] == ["npu:0", "npu:0"], got  # the file holds what the hardware writes: storages tagged npu:0
    for name, (x, nested, values) in got["loads"].items():
        assert (x, nested) == (("cpu", "cpu") if name == "cpu" else ("npu:0", "npu:0")) and values == [[0, 2, 4], [6, 8, 10]], (name, got)
    assert "has no storages" in got["outside"] and "\n" not in got["outside"], got["outside"]
    assert got["pinned"] == [True, False] and got["batches"] == [True, True] and got["copied"] == ["npu:0", 4.0], got
    assert got["t_"] == [[3, 4], [3, 4]] and got["arange"] == [4] and got["out"] == [2.0] * 3, got  # metadata kept in step
    assert got["rnn"] == {"GRU": [True] * 4, "LSTM": [True] * 4}, got["rnn"]
    assert got["made"] == ["npu:0", True, True, [[1.5, 2.5]], True, [3, 4], "cpu"], got["made"]


# a few cases of every suite (the whole run — 1,529 cases on the ascend stand-in, 1,325 on the cambricon one — takes
# about 4 minutes each: by hand). The collectives job runs on the ascend stand-in here (its world-2 job is most of
# the test's time); CNCL's stand-in carries the collectives of the three-device and replica journeys above.
CONFORMANCE_SELECTION = ["contract::*", "ops::rms_norm/*/float32/normal/*", "precision::reduced_precision/*",
                         "training::loss_curve/fp32", "onnx::Softmax/test_softmax_example"]
COLLECTIVES_SELECTION = ["collectives::all_reduce/sum/float32/*world2", "collectives::gather/float32/world2"]


@pytest.mark.parametrize("backend", ["ascend", "cambricon"])
def test_conformance_runs_every_suite_on_the_standin_and_its_report_says_so(backend: str, tmp_path: Path) -> None:
    report = tmp_path / "report"
    selection = CONFORMANCE_SELECTION + (COLLECTIVES_SELECTION if backend == "ascend" else [])
    done = run_hal("conformance", "run", "--backend", backend, "--standin", backend, "--world-size", "2",
                   "-k", ",".join(selection), "--report", str(report), "--json", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["standin"] == "stand-in: host-backed, not hardware" and results["verified_on_hardware"] is False
    suites = {case["id"].split("::")[0] for case in results["cases"]}
    assert suites == {"contract", "ops", "precision", "training", "onnx"} | ({"collectives"} if backend == "ascend" else set())
    for case in results["cases"]:  # passed, or not run with the reason said
        assert case["status"] == "pass" or (case["status"] in ("unsupported", "skip") and case.get("reason")), case
    unsupported = {case["id"]: case["reason"] for case in results["cases"] if case["status"] == "unsupported"}
    if backend == "ascend":  # HCCL has no gather (hal routes it through the host); HF32 rounding cannot show on the host
        assert "HCCL has no Gather" in unsupported["collectives::gather/float32/world2"], unsupported
        assert "runs on a stand-in" in unsupported["precision::reduced_precision/hf32/switch"], unsupported
    assert any(c["id"].startswith("ops::rms_norm/npu_rms_norm") for c in results["cases"]) == (backend == "ascend")
    assert "stand-in: host-backed, not hardware" in (report / "report.html").read_text(encoding="utf-8")
    assert "stand-in" in (report / "summary.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("amp", [False, True])
def test_the_readme_migration_example_runs_on_npu_tensors_as_on_the_cpu(amp: bool) -> None:
    """4c: `hal run --backend ascend --standin ascend examples/cuda_train.py`: the CUDA-written script on the npu
    stand-in, its losses those of the cpu target (fp32: the same bits; with --amp, fp16 autocast and its loss scaler
    on each device: within 1e-6 relative)."""
    flags = ["--steps", "4", *(["--amp"] if amp else [])]
    on_npu = run_hal("run", "--backend", "ascend", "--standin", "ascend", "examples/cuda_train.py", *flags)
    assert on_npu.returncode == 0, on_npu.stderr[-3000:]
    on_cpu = run_hal("run", "--backend", "cpu", "examples/cuda_train.py", *flags)
    assert on_cpu.returncode == 0, on_cpu.stderr[-3000:]
    losses = lambda out: [json.loads(line)["loss"] for line in out.splitlines() if line.startswith('{"step"')]  # noqa: E731
    npu, cpu = losses(on_npu.stdout), losses(on_cpu.stdout)
    assert len(npu) == len(cpu) == 4, (on_npu.stdout, on_cpu.stdout)
    assert npu == cpu if not amp else npu == pytest.approx(cpu, rel=1e-6), (npu, cpu)
    assert "hal run: backend ascend" in on_npu.stderr and "stand-in: host-backed, not hardware" in on_npu.stderr


def test_hal_ops_on_the_ascend_standin_picks_torch_npus_fused_ops() -> None:
    """4h: the registry's torch_npu checks find the stand-in (they looked only for the installed package: every fused
    op showed as a fallback, "torch_npu is not installed"); float64 stays the reference, as an NPU has none."""
    done = run_hal("ops", "--backend", "ascend", "--standin", "ascend", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    ops = json.loads(done.stdout)["ops"]
    for op, impl in {"rms_norm": "npu_rms_norm", "swiglu": "npu_swiglu", "rotary_embedding": "npu_rotary_mul",
                     "scaled_dot_product_attention": "npu_fusion_attention"}.items():
        assert [ops[op][d]["impl"] for d in ("float32", "bfloat16", "float16")] == [impl] * 3, (op, ops[op])
        assert ops[op]["float64"]["impl"] == "reference", (op, ops[op])
    plain = json.loads(run_hal("ops", "--backend", "ascend", "--json").stdout)["ops"]  # no stand-in asked: said why
    assert plain["rms_norm"]["float32"]["impl"] == "reference" and plain["rms_norm"]["float32"]["fallback_from"], plain


def test_a_vendor_without_a_standin_is_one_line() -> None:
    done = run_hal("devices", "--standin", "cuda")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "'cuda' has no stand-in" in done.stderr and "ascend" in done.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend,library", [("ascend", "hccl"), ("cambricon", "cncl")])
def test_the_standin_library_moves_device_tensors_and_refuses_its_gaps(backend: str, library: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from ..dist_harness import ok_values, run_world

    monkeypatch.setenv("HAL_STANDIN", backend)
    world = 2
    got = ok_values(run_world("tests.standin_cases", "ccl_run", world, backend=backend), world)
    device = {"ascend": "npu", "cambricon": "mlu"}[backend]
    for rank, r in got.items():
        assert r["device"] == f"{device}:0" and r["library"] == f"cpu:gloo,{device}:{library}", r  # a rank: its one device
        assert r["all_reduce"] == [3.0] * 4 and r["all_gather"] == [0.0] * 4 + [1.0] * 4, r
        assert r["reduce_scatter"] == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)], r
        assert r["all_to_all"] == [0.0, 1.0] and r["p2p"] == [10.0 + (rank - 1) % world] * 3, r
        assert "float64" in r["refused"]["float64"] and "not hardware" in r["refused"]["float64"], r["refused"]
        if backend == "ascend":
            assert "HCCL has no gather" in r["refused"]["gather"], r["refused"]
        assert r["hal_all_reduce"] == [1.0] * 3 and r["hal_all_gather"] == [0.0, 0.0, 1.0, 1.0], r
        assert r["hal_gather"] == ([[0.0, 0.0], [1.0, 1.0]] if rank == 0 else None), r  # hal routes around the gap


def test_hal_devices_lists_both_standins_each_in_a_process_of_its_own() -> None:
    done = run_hal("devices", "--standin", "ascend,cambricon", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    entries = {b["name"]: b for b in report["backends"]}
    for name, model in (("ascend", "Ascend910B2"), ("cambricon", "MLU590")):
        entry = entries[name]
        assert entry["available"] and entry["standin"] == "stand-in: host-backed, not hardware", entry["reason"]
        assert entry["device_count"] == 8 and entry["devices"][0]["name"] == model, entry
        assert entry["contract"]["streams_events"]["state"] == "supported", entry["contract"]
        assert not entry["verified_on_hardware"]
    assert report["auto"]["backend"] == "cpu" and "a stand-in: name it" in report["auto"]["reason"], report["auto"]


PIPELINE = """
model: {{vocab_size: 64, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 64, max_seq_len: 16}}
parallel:
  micro_batches: 2
  micro_batch_size: 2
  stages:
    - {{backend: cpu, devices: 1, layers: 1}}
    - {{backend: {second}, devices: 1, layers: 1}}
train: {{steps: 2, lr: 1.0e-2, seed: 3, data: synthetic}}
"""


@pytest.mark.multiprocess
def test_a_pipeline_with_a_standin_stage_trains_as_the_cpu_pipeline(tmp_path: Path) -> None:
    """The heterogeneous proof on a vendor path: stage 1 on the ascend stand-in (its activations crossing the bridge
    between the cpu and npu islands) gives the all-cpu run's losses, bit for bit."""
    runs = {}
    for second in ("cpu", "ascend"):
        config = tmp_path / f"{second}.yaml"
        config.write_text(PIPELINE.format(second=second))
        done = run_hal("train", str(config), "--standin", "ascend", "--json", "--run-dir", str(tmp_path / second),
                       timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[second] = json.loads(done.stdout)
    assert runs["ascend"]["losses"] == runs["cpu"]["losses"], (runs["ascend"]["losses"], runs["cpu"]["losses"])
    assert [s["backend"] for s in runs["ascend"]["stages"]] == ["cpu", "ascend"]
    assert runs["ascend"]["standin"] == {"backends": ["ascend"], "note": "stand-in: host-backed, not hardware"}
    assert "standin" not in runs["cpu"]  # no stage of it ran on a stand-in


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "train.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """examples/vendors_standin.yaml's model and data on one cpu rank: the run every layout must equal."""
    import yaml

    tmp = tmp_path_factory.mktemp("one")
    doc = yaml.safe_load((REPO / "examples" / "vendors_standin.yaml").read_text())
    doc["parallel"]["stages"] = [{"backend": "cpu", "devices": 1, "layers": 4}]
    (tmp / "one.yaml").write_text(yaml.safe_dump(doc))
    done = run_hal("train", str(tmp / "one.yaml"), "--steps", "3", "--run-dir", str(tmp / "run"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(tmp / "run")


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["example: cpu | ascend tp2 | cambricon", "cpu | ascend | cambricon dp2"])
def test_three_device_types_in_one_pipeline_train_as_one_device(layout: str, one_device: list[float],
                                                                 tmp_path: Path) -> None:
    """The heterogeneous proof across three device types (issue 55, 4d): the shipped example, and the same model with
    a dp2 stage on the cambricon stand-in, under ``--standin ascend,cambricon`` (the launcher asks a child process for
    the second vendor's answers: one vendor runtime per process) give the one-cpu-rank losses (fp32, 1e-6)."""
    import yaml

    config = REPO / "examples" / "vendors_standin.yaml"
    if "dp2" in layout:
        doc = yaml.safe_load(config.read_text())
        doc["parallel"]["stages"] = [{"backend": "cpu", "devices": 1, "layers": 1},
                                     {"backend": "ascend", "devices": 1, "layers": 2},
                                     {"backend": "cambricon", "devices": 2, "layers": 1, "dp": 2}]
        config = tmp_path / "dp2.yaml"
        config.write_text(yaml.safe_dump(doc))
    done = run_hal("train", str(config), "--standin", "ascend,cambricon", "--steps", "3", "--json",
                   "--run-dir", str(tmp_path / "run"), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert [s["backend"] for s in summary["stages"]] == ["cpu", "ascend", "cambricon"]
    assert summary["standin"] == {"backends": ["ascend", "cambricon"], "note": "stand-in: host-backed, not hardware"}
    got = _losses(tmp_path / "run")
    assert len(got) == len(one_device) == 3
    assert got == pytest.approx(one_device, rel=1e-6, abs=0), (got, one_device)


MOE = {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64,
       "max_seq_len": 32, "moe_num_experts": 4, "moe_top_k": 2,
       "moe_aux_loss_weight": 0.0}  # the balancing loss is over each dp group: a layout changes it, not the model


def _stand_in_run(tmp_path: Path, name: str, parallel: dict, *flags: str, **train: object) -> dict:
    """``hal train`` of the MoE model under ``parallel`` (4 steps of the byte corpus); the summary."""
    import yaml

    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"precision": "fp32", "model": MOE, "parallel": parallel,
                                      "train": {"steps": 4, "lr": 3e-3, "seed": 0, "data": "corpus", **train}}))
    done = run_hal("train", str(config), "--json", "--run-dir", str(tmp_path / name), *flags, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.multiprocess
def test_replicas_on_an_ascend_and_a_cambricon_island_resume_anywhere_and_export(tmp_path: Path) -> None:
    """Issue 55, 4e-4g: an MoE model with its experts split (dp2 ep2) in a replica on the ascend stand-in and one on
    the cambricon stand-in, synced over the bridge between the islands, trains as one cpu rank does; the checkpoint
    the npu and mlu ranks wrote resumes under a cpu-only and an mlu plan, and its Hugging Face export gives
    transformers the model's logits."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import full_model
    from hal.parallel.state.checkpoint import read_meta, read_tensors, resolve

    from ..hf_cases import hf_logits, ids

    one = {"micro_batches": 4, "micro_batch_size": 2, "stages": [{"backend": "cpu", "devices": 1, "layers": 2}]}
    twin = _stand_in_run(tmp_path, "one", one)["losses"]
    replicas = {"replicas": [
        {"rows": 4, "micro_batch_size": 2, "stages": [{"backend": "ascend", "devices": 2, "layers": 2, "dp": 2, "ep": 2}]},
        {"rows": 4, "micro_batch_size": 2, "stages": [{"backend": "cambricon", "devices": 2, "layers": 2, "dp": 2, "ep": 2}]}]}
    islands = _stand_in_run(tmp_path, "islands", replicas, "--standin", "ascend,cambricon", checkpoint_every=2)
    assert islands["losses"] == pytest.approx(twin, rel=1e-6, abs=0), (islands["losses"], twin)
    assert islands["standin"]["backends"] == ["ascend", "cambricon"]
    checkpoint = tmp_path / "islands" / "checkpoints" / "step-000002"
    meta = read_meta(checkpoint)
    assert meta["standin"] == "stand-in: host-backed, not hardware", meta.get("standin")

    on_cpu = _stand_in_run(tmp_path, "on_cpu", one, "--resume", str(checkpoint))
    assert on_cpu["losses"] == pytest.approx(twin[2:], rel=1e-6, abs=0), (on_cpu["losses"], twin)
    mlu = {**one, "stages": [{"backend": "cambricon", "devices": 1, "layers": 2}]}
    on_mlu = _stand_in_run(tmp_path, "on_mlu", mlu, "--resume", str(checkpoint), "--standin", "cambricon")
    assert on_mlu["losses"] == pytest.approx(twin[2:], rel=1e-6, abs=0), (on_mlu["losses"], twin)

    out = tmp_path / "hf"
    done = run_hal("export", str(checkpoint), "--to", "hf", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model_type"] == "mixtral"
    params, _ = read_tensors(resolve(checkpoint), meta)
    ours = full_model(ModelConfig(**meta["model"]), 0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(params[name])
        tokens = ids() % MOE["vocab_size"]
        err = float((ours(tokens) - hf_logits(out, tokens)).abs().max())
    assert err <= 1e-5, f"max |logit difference| {err:.3g}"
