"""Every backend honours the contract, with its vendor runtime absent; torch.cuda stays in hal/backends/."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hal.backend import CONTRACT_ITEMS, Availability, Backend
from hal.backend_registry import all_backends
from hal.errors import BackendUnavailable, UnsupportedError

from ..conftest import REPO

BUILTINS = ("cpu", "cuda", "rocm", "ascend", "cambricon")

# The contract as frozen for this release: adding, removing or renaming a method must be a
# deliberate change to this list too.
CONTRACT_METHODS = {
    "availability", "is_available", "require_available", "device_count", "set_device", "prepare_autograd", "current_device",
    "device_name", "device", "synchronize", "Stream", "Event", "current_stream", "stream",
    "memory_allocated", "memory_reserved", "max_memory_allocated", "reset_peak_memory_stats",
    "mem_get_info", "total_memory", "empty_cache", "manual_seed", "manual_seed_all", "get_rng_state",
    "set_rng_state", "autocast", "grad_scaler", "set_reduced_precision_matmul",
    "reduced_precision_matmul_enabled", "set_deterministic", "capabilities", "process_group_backend",
    "register_ops", "pinned", "host_memory_stats", "empty_host_cache", "Graph", "graph", "profiler", "contract",
    "runtime_versions", "device_uuid", "host_transfer_bytes",
}
IDENTITY = ("name", "device_type", "vendor", "ccl", "visible_devices_env", "reduced_precision_matmul_format",
            "hardware_verification", "ccl_reduce_ops", "ccl_gaps")


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_")
    }


def test_contract_is_the_frozen_list() -> None:
    assert set(_public_methods(Backend)) == CONTRACT_METHODS


def test_every_builtin_backend_is_registered() -> None:
    assert set(BUILTINS) <= set(all_backends())


@pytest.mark.parametrize("name", BUILTINS)
def test_backend_implements_contract_with_same_signatures(name: str) -> None:
    backend = all_backends()[name]
    cls = type(backend)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves abstract methods: {cls.__abstractmethods__}"
    contract = _public_methods(Backend)
    mine = _public_methods(cls)
    for method, signature in contract.items():
        assert method in mine, f"{cls.__name__} lacks {method}"
        ours = [(p.name, p.kind, p.default) for p in mine[method].parameters.values()]
        theirs = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        assert ours == theirs, f"{cls.__name__}.{method} signature drifted: {mine[method]} != {signature}"
    for attr in IDENTITY:
        assert hasattr(cls, attr), f"{cls.__name__} lacks identity attribute {attr}"
    assert backend.name == name


@pytest.mark.parametrize("name", BUILTINS)
def test_availability_has_a_specific_reason(name: str) -> None:
    status = all_backends()[name].availability()
    assert isinstance(status, Availability)
    assert len(status.reason) > 15 and status.reason != "placeholder"


@pytest.mark.parametrize("name", ["cuda", "rocm", "ascend", "cambricon"])
def test_unavailable_backend_refuses_device_calls_with_its_reason(name: str) -> None:
    backend = all_backends()[name]
    status = backend.availability()
    if status.available:
        pytest.skip(f"{name} is available on this machine")
    assert backend.device_count() == 0
    assert backend.hardware_verification is None or name == "cuda"
    for call in (lambda: backend.set_device(0), lambda: backend.synchronize(), lambda: backend.memory_allocated(),
                 lambda: backend.Stream(), lambda: backend.manual_seed(0), lambda: backend.capabilities(0),
                 backend.Graph, backend.host_memory_stats, backend.profiler):
        with pytest.raises(BackendUnavailable) as info:
            call()
        assert status.reason in str(info.value)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_backend_answers_every_contract_item(name: str) -> None:
    """Each item: supported, unsupported with a reason, or unavailable with the runtime's reason; never silent."""
    backend = all_backends()[name]
    status = backend.availability()
    answers = backend.contract()
    assert tuple(answers) == CONTRACT_ITEMS
    for item, answer in answers.items():
        assert answer.item == item and answer.api, answer
        assert answer.state in (("supported", "unsupported") if status.available else ("unavailable",)), answer
        if answer.state == "unavailable":
            assert answer.reason == status.reason
        elif answer.state == "unsupported":
            assert len(answer.reason) > 15, answer


def test_an_unsupported_item_refuses_with_its_reason() -> None:
    cpu = all_backends()["cpu"]
    for call, item in ((cpu.Graph, "graph_capture"), (cpu.host_memory_stats, "host_cache"),
                       (cpu.empty_host_cache, "host_cache")):
        with pytest.raises(UnsupportedError) as info:
            call()
        assert cpu.contract()[item].reason in str(info.value)
    with pytest.raises(UnsupportedError, match="no graph capture on the host"):
        cpu.graph(object())


def test_process_group_backend_strings() -> None:
    backends = all_backends()
    assert backends["cpu"].process_group_backend() == "gloo"
    assert backends["cuda"].process_group_backend() == "cpu:gloo,cuda:nccl"
    assert backends["ascend"].process_group_backend() == "cpu:gloo,npu:hccl"
    assert backends["cambricon"].process_group_backend() == "cpu:gloo,mlu:cncl"


def test_no_vendor_package_imported_by_listing_backends() -> None:
    code = ("import sys, hal; hal.all_backends(); import hal.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch_npu', 'torch_mlu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


FORBIDDEN = re.compile(r"torch\.cuda\b|\.cuda\(")


# Where torch.cuda may appear: the backends (the only code that touches it) and the command's texts that tell a
# user what their CUDA-written script sees (hal run / hal launch); examples are user code and tests probe it.
CUDA_ALLOWED = ("hal/backends/", "hal/cli/")


def cuda_leaks(root: Path) -> list[str]:
    offenders = []
    for path in sorted([*(root / "hal").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(CUDA_ALLOWED):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FORBIDDEN.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    return offenders


def test_no_torch_cuda_outside_backends() -> None:
    """The house rule: only hal/backends/ may touch torch.cuda."""
    offenders = cuda_leaks(REPO)
    assert not offenders, "torch.cuda outside hal/backends/:\n" + "\n".join(offenders)


def test_forbidden_pattern_catches_a_leak(tmp_path: Path) -> None:
    """The check above can fail: it flags the forms it is meant to flag, where they are not allowed."""
    assert FORBIDDEN.search("x = torch.cuda.synchronize()")
    assert FORBIDDEN.search("model.cuda()")
    assert not FORBIDDEN.search("backend.synchronize()")
    for rel in ("hal/backends/cuda.py", "hal/parallel/loop/trainer.py", "benchmarks/moe.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("import torch\ntorch.cuda.synchronize()\n")
    assert cuda_leaks(tmp_path) == ["benchmarks/moe.py:2: torch.cuda.synchronize()",
                                    "hal/parallel/loop/trainer.py:2: torch.cuda.synchronize()"]


def test_the_entry_points_declare_exactly_the_built_in_list() -> None:
    """pyproject.toml's hal.backends entry points and hal.backend_registry.BUILTIN_ORDER name the same five."""
    from hal.backend_registry import BUILTIN_ORDER
    from hal.plugins import entry_points, is_builtin

    assert sorted(ep.name for ep in entry_points("hal.backends") if is_builtin(ep)) == sorted(BUILTIN_ORDER)
