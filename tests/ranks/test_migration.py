"""The migration shim: CUDA-written code runs on the cpu backend, and nothing outlives the scope."""
from __future__ import annotations

import copyreg
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hal.backend_registry import get_backend
from hal.backends.cpu import CpuBackend
from hal.errors import UnsupportedError
from hal.migration import (
    MAPPING,
    CudaLocationMap,
    Kind,
    MigrationWarning,
    map_ccl,
    map_device,
    migrate,
    plan,
    rewrite_map_location,
    run_script,
)
from hal.migration.mapping import _resolve

from ..plain_client import run_plain, shared

REPO = Path(__file__).resolve().parents[2]
CUDA_SCRIPT = REPO / "examples" / "cuda_train.py"
TWIN_SCRIPT = REPO / "examples" / "cpu_train_twin.py"
HAS_CUDA = torch.cuda.is_available()  # the CUDA machines run this file too: compare with the truth


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    return get_backend("cpu")


def _value(where: str) -> Any:
    owner, attr = _resolve(where)
    return getattr(owner, attr)


def _snapshot() -> dict[str, Any]:
    return {row.where: _value(row.where) for row in MAPPING if not row.is_env}


def _changed(before: dict[str, Any]) -> list[str]:
    return [where for where, value in before.items() if _value(where) is not value]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python ARGS``: forked from the plain server (torch imported once, no hal), or fresh with HAL_TEST_FORK=0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return run_plain(shared(), list(args), env, REPO, 120)


def _migrated(script: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from hal.backend_registry import get_backend; from hal.migration import run_script; "
        f"sys.exit(run_script(get_backend('cpu'), {str(script)!r}, {argv!r}))"
    )
    return _run(["-c", code])


def _json_lines(stdout: str) -> tuple[list[float], dict[str, Any]]:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    losses = [r["loss"] for r in records if "step" in r]
    summaries = [r for r in records if r.get("summary")]
    assert len(summaries) == 1, stdout
    return losses, summaries[0]


# --- 1. the CUDA example runs on cpu and matches its hand-written twin -------------------------
def test_cuda_script_matches_cpu_twin_exactly() -> None:
    migrated = _migrated(CUDA_SCRIPT, ["--steps", "5"])
    assert migrated.returncode == 0, migrated.stderr
    twin = _run([str(TWIN_SCRIPT), "--steps", "5"])
    assert twin.returncode == 0, twin.stderr
    losses, summary = _json_lines(migrated.stdout)
    twin_losses, twin_summary = _json_lines(twin.stdout)
    assert len(losses) == 5 and losses == twin_losses
    assert summary["device"] == twin_summary["device"] == "cpu"
    assert summary["peak_memory_bytes"] > 0
    # Every call the example makes has an equivalent but the peak-memory figure: on cpu it is the
    # process's peak RSS, said once at the script's own line.
    warned = [line for line in migrated.stderr.splitlines() if "MigrationWarning" in line]
    assert len(warned) == 1 and "max_memory_allocated returns the process's resident set size" in warned[0], migrated.stderr
    assert warned[0].startswith(f"{CUDA_SCRIPT}:"), warned[0]


def test_cuda_script_with_amp_runs(cpu: CpuBackend) -> None:
    migrated = _migrated(CUDA_SCRIPT, ["--steps", "3", "--amp"])
    assert migrated.returncode == 0, migrated.stderr
    losses, summary = _json_lines(migrated.stdout)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert summary["amp"] is True


@pytest.mark.skipif(HAS_CUDA, reason="the CUDA script runs natively here")
def test_unmigrated_cuda_script_fails_here() -> None:
    """The control: without the shim the CUDA script cannot run on this CPU-only torch."""
    plain = _run([str(CUDA_SCRIPT), "--steps", "1"])
    assert plain.returncode != 0


def test_run_script_exit_code_argv_and_path(cpu: CpuBackend, tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        assert sys.argv == [{str(script)!r}, "a", "--b"], sys.argv
        assert sys.path[0] == {str(tmp_path)!r}
        sys.exit(3)
    """))
    argv, path = list(sys.argv), list(sys.path)
    assert run_script(cpu, str(script), ["a", "--b"]) == 3
    assert sys.argv == argv and sys.path == path
    script.write_text("x = 1\n")
    assert run_script(cpu, str(script), []) == 0
    script.write_text("raise ValueError('boom')\n")
    assert run_script(cpu, str(script), []) == 1


# --- 2. every patched attribute is restored, and nothing leaks ----------------------------------
def test_restores_every_target_on_normal_exit(cpu: CpuBackend) -> None:
    before, dispatch = _snapshot(), dict(copyreg.dispatch_table)
    with migrate(cpu) as scope:
        assert len(scope.applied) == len(MAPPING)
        assert set(_changed(before)) == set(before)  # every attribute row really was patched
        leaked_zeros, leaked_device = torch.zeros, torch.device
    assert _changed(before) == []
    assert dict(copyreg.dispatch_table) == dispatch
    assert torch.device("cuda").type == "cuda" and torch.device is torch._C.device
    assert torch.cuda.is_available() is HAS_CUDA
    assert leaked_device("cuda").type == "cuda"  # a leaked alias is a pass-through now
    if HAS_CUDA:
        assert leaked_zeros(1, device="cuda").is_cuda
    else:
        with pytest.raises((RuntimeError, AssertionError)):
            leaked_zeros(1, device="cuda")


def test_restores_every_target_on_exception(cpu: CpuBackend) -> None:
    before = _snapshot()
    with pytest.raises(KeyError):
        with migrate(cpu):
            assert torch.device("cuda").type == "cpu"
            raise KeyError("boom")
    assert _changed(before) == []
    assert torch.device("cuda").type == "cuda"
    assert torch.cuda.is_available() is HAS_CUDA


def test_reentrant_nesting_restores_only_at_the_outermost_exit(cpu: CpuBackend) -> None:
    before = _snapshot()
    with migrate(cpu):
        with migrate(cpu):
            assert torch.device("cuda").type == "cpu"
        assert torch.device("cuda").type == "cpu"  # the inner exit must not restore
        assert torch.cuda.is_available() is True
    assert _changed(before) == []


def test_cuda_type_backend_patches_nothing() -> None:
    for name in ("cuda", "rocm"):
        backend = get_backend(name)
        assert plan(backend) == ()
        before = _snapshot()
        with migrate(backend):
            assert _changed(before) == []


def test_torch_internals_see_the_real_cuda_module(cpu: CpuBackend) -> None:
    """torch's own code must not take CUDA-only paths for host tensors."""
    t = torch.ones(2)
    scope: dict[str, Any] = {"__name__": "torch._hal_probe", "t": t, "torch": torch}
    with migrate(cpu):
        assert t.is_cuda is True and torch.cuda.is_available() is True
        exec("seen = (t.is_cuda, torch.cuda.is_available())", scope)
    assert scope["seen"] == (False, HAS_CUDA)


# --- 3. dtypes are never changed -------------------------------------------------------------
def test_fp64_stays_fp64(cpu: CpuBackend) -> None:
    with migrate(cpu):
        made = torch.zeros(3, dtype=torch.float64, device="cuda")
        moved = torch.randn(2, 2, dtype=torch.float64).cuda()
        converted = torch.ones(2, dtype=torch.float64).to(torch.device("cuda", 0))
        module = torch.nn.Linear(2, 2).double().cuda()
    for tensor in (made, moved, converted, module.weight):
        assert tensor.dtype == torch.float64 and tensor.device.type == "cpu"


def test_cuda_autocast_keeps_fp16_default(cpu: CpuBackend) -> None:
    a = torch.randn(8, 8)
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # the trap: cpu's own default
    with migrate(cpu):
        with torch.cuda.amp.autocast():
            assert (a @ a).dtype == torch.float16
        with torch.autocast("cuda"):
            assert (a @ a).dtype == torch.float16
        with torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16  # an explicit dtype is honoured
        with torch.cuda.amp.autocast(enabled=False):
            assert (a @ a).dtype == torch.float32
        assert isinstance(torch.cuda.amp.GradScaler(), torch.amp.GradScaler)


# --- 4. an unmapped CUDA function warns once --------------------------------------------------
def test_unmapped_function_warns_exactly_once(cpu: CpuBackend) -> None:
    row = next(r for r in MAPPING if r.where == "cuda.get_arch_list")
    assert row.kind is Kind.NO_EQUIVALENT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with migrate(cpu):
            arches = torch.cuda.get_arch_list()
            assert torch.cuda.get_arch_list() == arches  # the CUDA original's answer
            torch.cuda.synchronize()  # mapped: no warning
    ours = [w for w in caught if issubclass(w.category, MigrationWarning)]
    assert len(ours) == 1
    assert "torch.cuda.get_arch_list has no equivalent on cpu" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the caller


# --- 5. torch.load of CUDA-tagged checkpoints --------------------------------------------------
def test_map_location_rewrite_rules() -> None:
    default = rewrite_map_location(None, "cpu")
    assert isinstance(default, dict) and default.get("cuda:0", "cuda:0") == "cpu"
    assert default.get("cpu", "cpu") == "cpu"
    assert rewrite_map_location("cuda:1", "cpu") == "cpu"
    assert rewrite_map_location("cuda:1", "npu") == "npu:1"
    assert rewrite_map_location(torch.device("cuda", 1), "cpu") == torch.device("cpu")
    user = rewrite_map_location({"cuda:1": "cuda:0"}, "npu")
    assert isinstance(user, CudaLocationMap)
    assert dict(user) == {"cuda:1": "npu:0"}  # keys are saved tags: never rewritten
    assert user.get("cuda:3", "cuda:3") == "npu:3" and user.get("cpu", "cpu") == "cpu"
    assert rewrite_map_location("cpu", "npu") == "cpu"


@pytest.fixture()
def cuda_tagged_checkpoint(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A checkpoint whose storages are tagged "cuda:0", as one saved on a GPU would be."""
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(6, dtype=torch.float64).reshape(2, 3)}, buffer)
    monkeypatch.undo()
    return buffer.getvalue()


@pytest.mark.parametrize("map_location", [None, "cuda", {"cuda:0": "cuda:1"}, lambda storage, loc: None])
def test_cuda_tagged_checkpoint_loads(cpu: CpuBackend, cuda_tagged_checkpoint: bytes, map_location: Any) -> None:
    if not HAS_CUDA:  # the control: a CPU-only torch cannot load it unaided
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(cuda_tagged_checkpoint), map_location=map_location)
    with migrate(cpu):
        loaded = torch.load(io.BytesIO(cuda_tagged_checkpoint), map_location=map_location)
    assert loaded["w"].device.type == "cpu" and loaded["w"].dtype == torch.float64
    assert torch.equal(loaded["w"], torch.arange(6, dtype=torch.float64).reshape(2, 3))


def test_devices_pickle_under_migration(cpu: CpuBackend) -> None:
    """torch.device is a proxy inside the scope; a saved device must still name torch.device."""
    buffer = io.BytesIO()
    with migrate(cpu):
        torch.save({"device": torch.device("cuda:1"), "t": torch.ones(1)}, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert loaded["device"] == torch.device("cpu") and type(loaded["device"]) is torch._C.device


# --- 6. nccl becomes the backend's CCL --------------------------------------------------------
def test_nccl_process_group_is_gloo_on_cpu(cpu: CpuBackend, tmp_path: Path) -> None:
    with migrate(cpu):
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
        try:
            assert dist.get_backend() == "gloo"
            group = dist.new_group(backend="nccl")
            assert dist.get_backend(group) == "gloo"
            value = torch.tensor([2.5], device="cuda")
            dist.all_reduce(value)
            assert value.item() == 2.5
        finally:
            dist.destroy_process_group()
    assert not dist.is_initialized()


def test_ccl_and_device_names_for_a_device_backend() -> None:
    class FakeNpu(CpuBackend):  # the cpu backend's methods, an accelerator's names
        name, device_type, ccl, visible_devices_env = "fakenpu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"

    npu = FakeNpu()
    assert map_ccl("nccl", npu) == "cpu:gloo,npu:hccl"
    assert map_ccl("cpu:gloo,cuda:nccl", npu) == "cpu:gloo,npu:hccl"
    assert map_ccl("gloo", npu) == "gloo"
    assert map_ccl("cuda:nccl", get_backend("cpu")) == "gloo"
    assert map_device("cuda:2", "npu") == "npu:2" and map_device("cuda", "npu") == "npu"
    assert map_device(torch.float64, "npu") is torch.float64 and map_device(True, "npu") is True


def test_env_vars_renamed_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeNpu(CpuBackend):
        name, device_type, ccl, visible_devices_env = "fakenpu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    with migrate(FakeNpu()):
        assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "1,3"
        assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert "ASCEND_RT_VISIBLE_DEVICES" not in os.environ and "PYTORCH_NPU_ALLOC_CONF" not in os.environ


def test_cuda_visible_devices_warns_on_cpu(cpu: CpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.warns(MigrationWarning, match="CUDA_VISIBLE_DEVICES is set but has no equivalent on cpu"):
        with migrate(cpu):
            pass


# --- 7. TF32 on a backend without a reduced-precision mode ---------------------------------------
def test_allow_tf32_warns_once_and_changes_nothing(cpu: CpuBackend) -> None:
    flag, precision = torch._C._get_cublas_allow_tf32(), torch.get_float32_matmul_precision()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with migrate(cpu):
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cuda.matmul.allow_tf32 = True
            assert torch.backends.cuda.matmul.allow_tf32 is False
    ours = [str(w.message) for w in caught if issubclass(w.category, MigrationWarning)]
    assert len(ours) == 1 and "torch.backends.cuda.matmul.allow_tf32 has no equivalent on cpu" in ours[0]
    assert torch._C._get_cublas_allow_tf32() == flag
    assert torch.get_float32_matmul_precision() == precision
    assert cpu.reduced_precision_matmul_enabled() is False


# --- device mapping details ----------------------------------------------------------------
def test_device_proxy_forms(cpu: CpuBackend) -> None:
    with migrate(cpu):
        forms = [
            torch.device("cuda"), torch.device("cuda:1"), torch.device("cuda", 0),
            torch.device(type="cuda", index=1), torch.device(0), torch.device(torch._C.device("cuda", 2)),
        ]
        assert all(type(d) is torch._C.device and d == torch._C.device("cpu") for d in forms)
        assert isinstance(torch.device("cuda"), torch.device)
        assert torch.device("meta").type == "meta" and torch.device("cpu") == torch._C.device("cpu")
        assert torch.Generator(device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=0).device.type == "cpu"


def test_hal_source_never_names_the_cuda_module() -> None:
    sources = sorted((REPO / "hal" / "migration").glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "mapping.py", "session.py", "runner.py"}
    for path in sources:
        assert not re.search(r"torch\.cuda\b|\.cuda\(", path.read_text()), path.name


def test_proxy_classes_stay_usable(cpu: CpuBackend) -> None:
    with migrate(cpu):
        class Scaler(torch.amp.GradScaler):  # a script subclassing a patched class gets the real base
            pass

        assert issubclass(Scaler, torch.amp.grad_scaler.GradScaler) and isinstance(Scaler("cpu"), torch.amp.GradScaler)
        with pytest.raises(UnsupportedError, match="already active"):
            with migrate(get_backend("cuda")):
                pass
        assert torch.device("cuda").type == "cpu"  # the refused nesting left the scope intact


def test_warnings_name_the_scripts_line_under_hal_run(tmp_path: Path) -> None:
    """The shim's own warnings and torch's warnings raised inside its wrappers both point at the script."""
    script = tmp_path / "warns.py"
    script.write_text(textwrap.dedent("""\
        import torch
        a = torch.ones(2)
        b = torch.tensor(a, device="cuda")
        n = torch.cuda.memory_allocated()
        print("done", b.device)
    """))
    result = _run(["-m", "hal", "run", "--backend", "cpu", str(script)])
    assert result.returncode == 0 and "done cpu" in result.stdout, result.stderr
    assert f"{script}:3: UserWarning: To copy construct from a tensor" in result.stderr
    assert f"hal: warning: {script}:4: torch.cuda.memory_allocated returns the process's resident set size" in result.stderr
    assert "hal/migration" not in result.stderr
