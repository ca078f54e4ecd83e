"""Conformance cases as data: what a case is, what running it yields, and what it runs against.

A suite module (``hal/conformance/suites/<name>.py``) exposes ``cases(ctx) -> list[Case]``. Each case
is self-contained: ``case.run(ctx)`` computes on the target backend, compares with its reference and
returns an ``Outcome`` whose verdict names the metric that decided it. Cases never raise for a
numerical disagreement — that is a ``fail`` outcome; an exception inside ``run`` is recorded by the
runner as ``error`` (also a failure of the run).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from hal.backend import Backend
from hal.capabilities import DeviceCapabilities

Status = Literal["pass", "fail", "error", "skip", "unsupported"]
FAILING: frozenset[str] = frozenset({"fail", "error"})
# torch dtype -> the dtype key of DeviceCapabilities (``support``/``is_native``)
CAPABILITY_KEY: dict[torch.dtype, str] = {
    torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
}


@dataclass
class Outcome:
    """The verdict of one case, with the numbers behind it.

    ``metrics``: what was measured (e.g. max_abs, max_rel, rel_l2, cosine, ulp, or busbw_gbs);
    ``tolerance``: the bounds applied to those metrics (same keys, where a bound exists);
    ``failed_metric``: the metric that broke its bound (None unless ``status == "fail"``);
    ``reason``: one line a person reads in the summary table; ``data``: series for plots
    (e.g. ``{"loss": [...], "reference_loss": [...]}`` or ``{"sizes": [...], "busbw": [...]}``).
    """

    status: Status
    metrics: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    failed_metric: str | None = None
    reason: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in FAILING

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "metrics": self.metrics, "tolerance": self.tolerance,
            "failed_metric": self.failed_metric, "reason": self.reason, "data": self.data,
            "seconds": round(self.seconds, 4),
        }


# ``Context.options`` key under which the runner hands the suites the ids of the cases it will run (``-k``): cases
# that share one job (the collectives' world-N job) run only the selected part of it
SELECTED_OPTION = "selected_case_ids"


@dataclass
class Context:
    """What every case runs against: the backend under test and the machine's limits."""

    backend: Backend
    device: torch.device
    capabilities: DeviceCapabilities
    seed: int = 1234
    max_world_size: int = 1  # process slots for collectives/training (devices, or CPU processes)
    options: dict[str, Any] = field(default_factory=dict)  # suite-specific knobs (e.g. steps, sizes)
    launch: Callable[..., Any] | None = None  # starts multi-rank jobs (conformance.jobs.launch); hal.launch.run_function

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def verdict(self) -> str:
        """The verdict profile the ops and precision cases judge under (``--verdict``: hal, torch, cann)."""
        return str(self.options.get("verdict", "hal"))

    def dtype_supported(self, dtype: torch.dtype) -> bool:
        """Whether the backend declares ``dtype`` usable (native or emulated) — cases skip others."""
        from hal.capabilities import DtypeSupport

        name = CAPABILITY_KEY.get(dtype)
        if name is None:
            return True
        return self.capabilities.support(name) in (DtypeSupport.NATIVE, DtypeSupport.EMULATED)


@dataclass(frozen=True)
class Case:
    """One check. ``name`` is unique inside its suite and reads like a path: op/impl/dtype/input/direction."""

    suite: str
    name: str
    run: Callable[[Context], Outcome]
    description: str = ""
    tags: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.suite}::{self.name}"


def skip(reason: str) -> Outcome:
    return Outcome("skip", reason=reason)


def unsupported(reason: str) -> Outcome:
    return Outcome("unsupported", reason=reason)
