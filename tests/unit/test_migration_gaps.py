"""The CUDA APIs real scripts used that the shim once left unmapped: each now maps to the target, or
warns once at the caller's line saying what happens instead, or refuses in one line (CUDA graphs)."""
from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest
import torch

from hal.backend_registry import get_backend
from hal.backends.cpu import CpuBackend
from hal.errors import ConfigError
from hal.migration import MigrationUnsupported, MigrationWarning, migrate


@pytest.fixture()
def cpu() -> CpuBackend:
    return get_backend("cpu")


@pytest.fixture()
def caught() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def _ours(records: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in records if issubclass(w.category, MigrationWarning)]


def test_legacy_tensor_types_build_and_convert_on_the_target(cpu: CpuBackend, caught: list) -> None:
    with migrate(cpu):
        made = torch.cuda.FloatTensor([1, 2, 3])
        empty = torch.cuda.LongTensor(2, 3)
        assert made.dtype == torch.float32 and made.device.type == "cpu" and made.tolist() == [1.0, 2.0, 3.0]
        assert empty.dtype == torch.int64 and empty.shape == (2, 3)
        assert isinstance(made, torch.cuda.FloatTensor) and not isinstance(made, torch.cuda.HalfTensor)
        half = torch.ones(2).type("torch.cuda.HalfTensor")
        double = torch.ones(2).type(torch.cuda.DoubleTensor)
        assert half.dtype == torch.float16 and double.dtype == torch.float64
        assert made.type() == "torch.cuda.FloatTensor"  # the name a CUDA script compares against
        assert torch.ones(1, dtype=torch.int32).type(torch.float64).dtype == torch.float64  # other forms untouched
    assert torch.ones(1).type() == "torch.FloatTensor" and not isinstance(made, torch.cuda.FloatTensor)
    assert _ours(caught) == []  # exact mappings warn nothing


def test_get_device_matches_is_cuda(cpu: CpuBackend) -> None:
    t = torch.ones(1)
    with migrate(cpu):
        assert t.is_cuda and t.get_device() == 0
    assert t.get_device() == -1


def test_is_bf16_supported_honours_including_emulation(cpu: CpuBackend) -> None:
    from hal.capabilities import DtypeSupport

    support = cpu.capabilities().support("bf16")
    with migrate(cpu):
        assert torch.cuda.is_bf16_supported() is (support in (DtypeSupport.NATIVE, DtypeSupport.EMULATED))
        assert torch.cuda.is_bf16_supported(including_emulation=False) is (support is DtypeSupport.NATIVE)


class _Doubler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype_seen = x.dtype
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * 2


def test_custom_fwd_keeps_casting_inputs_and_autocast_queries_see_the_target(cpu: CpuBackend) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    with migrate(cpu):
        cuda_style = torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)(_Doubler.forward)
        amp_style = torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)(_Doubler.forward)

        class Cuda(_Doubler):
            forward = staticmethod(cuda_style)
            backward = staticmethod(torch.cuda.amp.custom_bwd(_Doubler.backward))

        class Amp(_Doubler):
            forward = staticmethod(amp_style)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x @ x
            assert y.dtype == torch.bfloat16
            assert Cuda.apply(y).dtype == torch.float32 and Amp.apply(y).dtype == torch.float32
            assert torch.is_autocast_enabled("cuda") and torch.is_autocast_enabled()
            assert torch.get_autocast_dtype("cuda") == torch.bfloat16
        Cuda.apply(x).sum().backward()
        assert not torch.is_autocast_enabled("cuda")
    assert torch.allclose(x.grad, torch.full_like(x, 2.0))


def test_device_properties_and_capability_warn_at_the_callers_line(cpu: CpuBackend, caught: list) -> None:
    with migrate(cpu):
        props = torch.cuda.get_device_properties(0)
        line = props_line = _line()  # noqa: F841 - the call above is one line up
        cap = torch.cuda.get_device_capability()
    assert props.total_memory > 0 and props.multi_processor_count >= 1 and props.name
    assert (props.major, props.minor) == cap and cap in ((8, 0), (7, 0), (6, 0))
    ours = _ours(caught)
    assert [w.filename for w in ours] == [__file__, __file__]
    assert ours[0].lineno == line - 1 and "get_device_properties on cpu" in str(ours[0].message)


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_memory_statistics_say_they_are_host_rss(cpu: CpuBackend, caught: list) -> None:
    with migrate(cpu):
        for _ in range(2):
            assert torch.cuda.memory_allocated() > 0
    ours = _ours(caught)
    assert len(ours) == 1 and "resident set size" in str(ours[0].message) and ours[0].filename == __file__


def test_nvtx_ranges_become_profiler_ranges(cpu: CpuBackend, caught: list) -> None:
    from torch.profiler import ProfilerActivity, profile

    with migrate(cpu):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.cuda.nvtx.range_push("hal-push")
            torch.ones(4).sum()
            torch.cuda.nvtx.range_pop()
            with torch.cuda.nvtx.range("hal-{}", "ctx"):
                torch.ones(4).sum()
            torch.cuda.nvtx.mark("dropped")
    names = {e.name for e in prof.events()}
    assert {"hal-push", "hal-ctx"} <= names
    assert len(_ours(caught)) == 1 and "mark is dropped" in str(_ours(caught)[0].message)


def test_cuda_graph_capture_is_refused_in_one_line_naming_the_caller(cpu: CpuBackend) -> None:
    with migrate(cpu):
        with pytest.raises(MigrationUnsupported) as info:
            torch.cuda.CUDAGraph()
        assert isinstance(info.value, RuntimeError)  # a script's `except RuntimeError` fallback still runs
        assert str(info.value).startswith(f"{__file__}:") and "\n" not in str(info.value)
        with pytest.raises(MigrationUnsupported, match="torch.cuda.graph has no equivalent on cpu"):
            torch.cuda.graph(None)
        model = torch.nn.Linear(2, 2)
        assert torch.cuda.make_graphed_callables(model, (torch.ones(1, 2),)) is model
        assert torch.cuda.is_current_stream_capturing() is False


def test_data_parallel_runs_unreplicated_with_a_warning(cpu: CpuBackend, caught: list) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with migrate(cpu):
        wrapped = torch.nn.DataParallel(model)
        from torch.nn.parallel import DataParallel

        again = DataParallel(model)
        assert isinstance(wrapped, DataParallel) and wrapped.module is model
        assert torch.equal(wrapped(x), model(x)) and torch.equal(again(x), model(x))
        assert list(wrapped.state_dict()) == ["module.weight", "module.bias"]  # CUDA checkpoints' keys
        assert torch.equal(torch.nn.parallel.data_parallel(model, x), model(x))
    messages = [str(w.message) for w in _ours(caught)]
    assert len(messages) == 2 and all("unreplicated" in m for m in messages)


def test_seeding_warns_only_when_host_numbers_change(cpu: CpuBackend, caught: list) -> None:
    with migrate(cpu):
        torch.manual_seed(3)
        torch.cuda.manual_seed_all(3)  # the usual pair: the state is unchanged, nothing to say
        assert _ours(caught) == []
        torch.cuda.manual_seed(4)
    ours = _ours(caught)
    assert len(ours) == 1 and "host generator" in str(ours[0].message) and ours[0].filename == __file__


def test_cudnn_tf32_warns_and_other_cudnn_flags_pass_through(cpu: CpuBackend, caught: list) -> None:
    before = torch.backends.cudnn.benchmark
    with migrate(cpu):
        torch.backends.cudnn.allow_tf32 = True
        assert torch.backends.cudnn.allow_tf32 is False  # the target has no TF32 convolutions
        torch.backends.cudnn.benchmark = not before
        assert torch.backends.cudnn.benchmark is (not before)
        torch.backends.cudnn.benchmark = before
    ours = _ours(caught)
    assert len(ours) == 1 and "cudnn.allow_tf32" in str(ours[0].message) and ours[0].filename == __file__
    assert type(torch.backends.cudnn).__name__ == "CudnnModule"  # restored


def test_two_ordinals_in_one_process_warn_and_one_does_not(cpu: CpuBackend, caught: list) -> None:
    with migrate(cpu):
        torch.ones(1, device="cuda:1")
        torch.ones(1, device="cuda")
        assert _ours(caught) == []  # one ordinal per process (a DDP rank's) is exact
        torch.ones(1, device="cuda:0")
    ours = _ours(caught)
    assert len(ours) == 1 and "cuda:0, cuda:1 all map to the one cpu device" in str(ours[0].message)


def test_device_count_is_the_cpu_targets_only(cpu: CpuBackend) -> None:
    with migrate(cpu, device_count=2):
        assert torch.cuda.device_count() == 2
    with pytest.raises(ConfigError, match="only for the cpu target"):
        migrate(get_backend("cuda"), device_count=2)


def test_init_device_mesh_maps_its_device_type(cpu: CpuBackend) -> None:
    from torch.distributed import device_mesh

    seen: list[str] = []
    real = device_mesh.init_device_mesh
    device_mesh.init_device_mesh = lambda device_type, *a, **k: seen.append(device_type)  # type: ignore[assignment]
    try:
        with migrate(cpu):
            device_mesh.init_device_mesh("cuda", (2,))
            device_mesh.init_device_mesh(device_type="cuda:0", mesh_shape=(2,))
    finally:
        device_mesh.init_device_mesh = real
    assert seen == ["cpu", "cpu"]


def test_the_lifted_import_hook_leaves_with_the_outermost_scope(cpu: CpuBackend) -> None:
    import sys

    def hooks() -> int:
        return sum(type(f).__name__ == "_LiftedImports" for f in sys.meta_path)

    before = hooks()
    outer, inner = migrate(cpu), migrate(cpu)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # exits out of order: the scope stays until the last one leaves
    assert torch.device("cuda").type == "cpu"
    inner.__exit__(None, None, None)
    assert hooks() == before and torch.device("cuda").type == "cuda"



def _destroyed_group(tmp_path: object, name: str) -> Any:
    """A one-rank world, its group destroyed: a weak reference to the group's object."""
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("nccl" if dist.is_nccl_available() else "gloo", init_method=f"file://{tmp_path}/{name}",
                            rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    return group


def test_a_destroyed_group_lives_until_the_scope_ends(cpu: CpuBackend, tmp_path: object) -> None:
    """The DDP tutorial's ending (destroy the group, then return from main) hung a gloo rank now and then: the group's
    last reference was the DDP model's, so its destructor ran from the model's, holding the interpreter lock that
    gloo's worker thread was waiting for (pytorch/pytorch#56297). In the scope the destroyed group's object lives
    until the scope ends, so no model the script drops holds its last reference."""
    import torch.distributed as dist

    assert _destroyed_group(tmp_path, "plain")() is None  # torch's own: gone with the destroy
    with migrate(cpu):
        group = _destroyed_group(tmp_path, "scoped")
        assert group() is not None and not dist.is_initialized()
    assert group() is None  # the scope's end let it go
