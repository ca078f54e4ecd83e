"""Whether an op ran on the host while its tensors were on the device: the runtime's own fallback warning, or the
bytes the backend saw copied from the device to the host during the op.

A vendor runtime that sends an operator to the CPU says so once per operator ("... is not currently supported on
the NPU backend and will fall back to run on the CPU", torch_npu's ``npu_cpu_fallback``; MPS words it the same way):
that warning is one signal. A fallback that says nothing still has to copy the op's inputs to host memory: where the
backend counts device-to-host copies (``Backend.host_transfer_bytes``), an op that copied at least as many bytes as
its tensor inputs hold is a fallback too (a result read back to size an output, as ``nonzero`` does, is far smaller).
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

FALLBACK_WARNING = re.compile(r"operator '([^']+)' is not currently (?:supported|implemented) on the \w+ backend "
                              r"and will fall back to run on the CPU", re.IGNORECASE)


@dataclass
class HostUse:
    """What one watched call did on the host."""

    warned: list[str] = field(default_factory=list)  # operators the runtime said it ran on the CPU
    copied_bytes: int = 0
    input_bytes: int = 0

    @property
    def fell_back(self) -> bool:
        return bool(self.warned) or (self.input_bytes > 0 and self.copied_bytes >= self.input_bytes)

    def why(self) -> str:
        if self.warned:
            return f"the runtime ran {', '.join(sorted(set(self.warned)))} on the CPU (its fallback warning)"
        return (f"{self.copied_bytes} bytes copied from the device to the host during the op (its inputs hold "
                f"{self.input_bytes}): computed on the host")


def watcher(transfer_bytes: Callable[[], int | None]) -> Callable[[int], contextlib.AbstractContextManager[HostUse]]:
    """A factory of watches over one backend's counter; each watch is told the op's input bytes."""
    @contextlib.contextmanager
    def watch(input_bytes: int) -> Iterator[HostUse]:
        use = HostUse(input_bytes=input_bytes if transfer_bytes() is not None else 0)
        before = transfer_bytes() or 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield use
            finally:
                use.copied_bytes = (transfer_bytes() or 0) - before
                use.warned = [m.group(1) for w in caught if (m := FALLBACK_WARNING.search(str(w.message)))]
    return watch
