"""What every Triton launcher here shares: picking the runnable kernel for a device, block settings.

Triton's interpreter is chosen when triton is imported (``TRITON_INTERPRET=1`` turns every
``@triton.jit``, triton.language's own helpers included, into an interpreted function), so a CPU
tensor can run a kernel only in a process that set it before the first ``import triton``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
from typing import Any, Iterator

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

try:  # where the interpreter lives in Triton 2.2 - 3.9
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - a Triton without the interpreter
    InterpretedFunction = ()  # type: ignore[assignment,misc]

MAX_FUSED_SIZE = 65536  # elements of one row held in one program (fp32 registers; Liger uses the same cap)
INTERPRET_HINT = ("Triton kernels run on CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
                  "before triton is first imported in the process")


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` object) runs in Triton's interpreter, and so does
    triton.language (whose own helpers, tl.sum among them, are ``@triton.jit`` functions too)."""
    language = not isinstance(tl.sum, JITFunction)  # an interpreted (or builtin) tl.sum
    return language and bool(InterpretedFunction) and isinstance(kernel, InterpretedFunction)


@triton.jit
def _probe(X):
    """A kernel that is never launched: what ``triton.jit`` makes in this process (compiled or interpreted)."""
    tl.store(X, tl.load(X))


def probe_kernel() -> Any:
    return _probe


_RAW = contextvars.ContextVar("hal_triton_raw_launches", default=False)


@contextlib.contextmanager
def raw_launches() -> Iterator[None]:
    """Launch kernels as they are inside this block: the eager path (``library._call``), where nothing traces
    and ``wrap_triton``'s wrapper would only add its dispatch (about 0.1 ms of host time a launch)."""
    token = _RAW.set(True)
    try:
        yield
    finally:
        _RAW.reset(token)


def launcher(kernel: Any) -> Any:
    """``kernel`` as the ops launch it: wrapped for torch.compile to trace into (a triton op's body must call
    its kernels through ``torch.library.wrap_triton``), or as it is where it is interpreted or runs eagerly."""
    if _RAW.get() or not isinstance(kernel, JITFunction) or interpreted(kernel) or not hasattr(torch.library, "wrap_triton"):
        return kernel
    return torch.library.wrap_triton(kernel)


def _runs_with_every_argument() -> bool:
    """Whether this Triton's ``JITFunction.run`` hands its compiled kernel every argument, constexprs included,
    in declaration order (read in Triton 3.6 and 3.9) -- the convention ``CachedLauncher`` relies on."""
    try:
        source = inspect.getsource(JITFunction.run)
        runs = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata"
                in source and "*bound_args.values())" in source)
        return runs and hasattr(triton, "knobs")
    except (OSError, TypeError, AttributeError):  # no source to read: take the ordinary launch
        return False


CACHED_LAUNCH_ENV = "HAL_TRITON_CACHED_LAUNCH"  # 0: every launch through Triton's own binding
DIRECT_LAUNCH = _runs_with_every_argument() and os.environ.get(CACHED_LAUNCH_ENV, "1").strip() != "0"


def _hooked() -> bool:
    """Whether a launch hook is registered (Triton 3.4+ keeps an empty chain of them when none is)."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLauncher:
    """Launch a compiled kernel again without Triton binding and specialising every argument (on an H100 host
    with Triton 3.6: 17-21 us of host time a launch through Triton, 10-15 us this way, key included).

    The first launch of each specialisation goes through Triton (which compiles it); later ones reuse the
    compiled kernel, found by a key at least as fine as Triton's own: every constexpr's value, each tensor's
    dtype, device and 16-byte alignment, each integer's range and whether it is 1 or a multiple of 16. Where
    Triton is interpreted, a launch hook is set (a profiler), or ``DIRECT_LAUNCH`` is false (a Triton whose
    launcher this was not checked against), every launch is Triton's own: ``why_not_cached`` says which."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self.constexpr = [bool(getattr(p, "is_constexpr", False)) for p in params] if params else []
        self.direct = DIRECT_LAUNCH and bool(params) and not interpreted(kernel)
        self.compiled: dict[tuple[Any, ...], Any] = {}

    def _key(self, args: tuple[Any, ...], num_warps: int) -> tuple[Any, ...]:
        key: list[Any] = [num_warps]
        add = key.append
        for value, const in zip(args, self.constexpr):
            if const:
                add(value)
            elif type(value) is int:  # noqa: E721 - bool (a subclass) is keyed by its value below
                add((value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63))
            elif isinstance(value, torch.Tensor):
                add((value.dtype, value.get_device(), value.data_ptr() % 16 == 0))
            else:
                add(value)
        return tuple(key)

    def why_not_cached(self) -> str | None:
        """Why launches go through Triton's own binding (None: they are cached)."""
        if not DIRECT_LAUNCH:
            return f"{CACHED_LAUNCH_ENV}=0 or a Triton whose launcher this was not checked against"
        if not self.direct:
            return "the kernel is interpreted or has no parameter list"
        if _hooked():
            return "a launch hook is set (a profiler)"
        return None

    def __call__(self, grid: tuple[int, ...], *args: Any, num_warps: int = 4) -> None:
        if not self.direct or len(args) != len(self.constexpr) or _hooked():
            self.kernel[grid](*args, num_warps=num_warps)
            return
        key = self._key(args, num_warps)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps)  # Triton binds, compiles and launches
            if compiled is not None:
                self.compiled[key] = compiled
            return
        driver = triton.runtime.driver.active
        stream = driver.get_current_stream(driver.get_current_device())
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *args)  # no hooks: checked above


def check_device(kernel: Any, device: torch.device) -> None:
    """Refuse, with the fix, a CPU tensor for a compiled kernel (it would be read as a device pointer)."""
    if device.type == "cpu" and not interpreted(kernel):
        raise RuntimeError(INTERPRET_HINT)


_ALREADY = contextlib.nullcontext()


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for the launch: Triton launches on the current device and stream. Where it is
    current already (nearly always), nothing to enter: a shared null context (a generator-based one costs a few
    microseconds of host time a launch)."""
    if device.type == "cpu" or device.index is None or not hasattr(torch, "accelerator"):
        return _ALREADY
    index = getattr(torch.accelerator, "device_index", None)  # torch 2.8+
    if index is None or torch.accelerator.current_device_index() == device.index:
        return _ALREADY
    return index(device.index)


def row_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program holding a whole row of ``n`` elements: Liger's settings, except 4 warps
    (not 8) for rows of 2048, 10-20 % faster in the norms' forward and backward on an H200 (hidden 2048; at 4096
    8 warps stayed best)."""
    block = triton.next_power_of_2(max(int(n), 1))
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"a row of {n} elements exceeds one program's block ({MAX_FUSED_SIZE})")
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 4096 else 4
    return block, warps


def program_count(device: torch.device, rows: int, per_sm: int = 4) -> int:
    """Programs for a persistent grid over ``rows``: a few per multiprocessor (8 on the interpreter)."""
    return max(1, min(int(rows), per_sm * _multiprocessors(device)))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cpu":
        return 2  # the interpreter runs programs one after another: few programs, few partial sums
    try:  # Triton's own driver query (its tutorials' idiom, Triton 2.x-3.9 on CUDA and HIP)
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["multiprocessor_count"])
    except Exception:  # a driver without the query: a grid that fills an H100 still runs anywhere
        return 132
