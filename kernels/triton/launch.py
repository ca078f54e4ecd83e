"""What every Triton launcher here shares: picking the runnable kernel for a device, block settings.

Triton's interpreter is chosen when triton is imported (``TRITON_INTERPRET=1`` turns every
``@triton.jit``, triton.language's own helpers included, into an interpreted function), so a CPU
tensor can run a kernel only in a process that set it before the first ``import triton``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
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


def check_device(kernel: Any, device: torch.device) -> None:
    """Refuse, with the fix, a CPU tensor for a compiled kernel (it would be read as a device pointer)."""
    if device.type == "cpu" and not interpreted(kernel):
        raise RuntimeError(INTERPRET_HINT)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the launch: Triton launches on the current device and stream."""
    if device.type == "cpu" or device.index is None or not hasattr(torch, "accelerator"):
        yield
        return
    index = getattr(torch.accelerator, "device_index", None)  # torch 2.8+
    if index is None or torch.accelerator.current_device_index() == device.index:
        yield
        return
    with index(device.index):
        yield


def row_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program holding a whole row of ``n`` elements (Liger's settings)."""
    block = triton.next_power_of_2(max(int(n), 1))
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"a row of {n} elements exceeds one program's block ({MAX_FUSED_SIZE})")
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def program_count(device: torch.device, rows: int, per_sm: int = 4) -> int:
    """Programs for a persistent grid over ``rows``: a few per multiprocessor (8 on the interpreter)."""
    return max(1, min(int(rows), per_sm * _multiprocessors(device)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cpu":
        return 2  # the interpreter runs programs one after another: few programs, few partial sums
    try:  # Triton's own driver query (its tutorials' idiom, Triton 2.x-3.9 on CUDA and HIP)
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["multiprocessor_count"])
    except Exception:  # a driver without the query: a grid that fills an H100 still runs anywhere
        return 132
