"""Cambricon MLUs through torch_mlu (Cambricon MLU Extension for PyTorch); CNCL for collectives.

torch_mlu is imported lazily, inside ``_load_module`` only. Importing it registers ``torch.mlu``
(``torch._register_device_module('mlu', torch_mlu.mlu)``), which mirrors torch.cuda, plus
``torch.backends.mlu`` and ``torch.backends.cnnl`` (the TF32/determinism switches), see
https://github.com/Cambricon/torch_mlu/blob/master/torch_mlu/__init__.py. TF32 exists in hardware
only from the MLU500 series (device major >= 5, e.g. MLU590), not on MLU370.

NOT verified on Cambricon hardware: written against torch_mlu's public source, cited next to each call.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch

from hal.backend import CclGap
from hal.capabilities import DtypeSupport, ProbedFacts
from hal.errors import UnsupportedError

from ._device_module import DeviceModuleBackend, RuntimeElsewhere, RuntimeMissing, registered_device_module

PACKAGE = "torch_mlu"
NOT_INSTALLED = "torch_mlu is not installed"
FIRST_TF32_MAJOR = 5  # MLU500 series


def _install_hint() -> str:
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (
        f"install the torch_mlu wheel Cambricon ships for torch {major_minor}, not on PyPI, see "
        "https://github.com/Cambricon/torch_mlu; it needs Cambricon's CNToolkit/CNNL/CNCL under NEUWARE_HOME"
    )


def _first_line(exc: BaseException) -> str:
    """'<Type>: <first line of the message>', kept to one short line."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _import_torch_mlu() -> ModuleType:
    """torch_mlu, or RuntimeMissing telling "not installed" from "installed but broken"."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError) as exc:
        raise RuntimeMissing(f"torch_mlu failed to import: {_first_line(exc)}") from None
    if spec is None:
        raise RuntimeMissing(f"{NOT_INSTALLED} ({_install_hint()})")
    try:
        return importlib.import_module(PACKAGE)
    except Exception as exc:  # Neuware libraries missing, torch/torch_mlu mismatch, driver errors
        raise RuntimeMissing(f"torch_mlu failed to import: {_first_line(exc)}") from None


def _mlu_backend_flags() -> tuple[Any, Any]:
    """(torch.backends.mlu, torch.backends.cnnl) as torch_mlu installs them on import."""
    mlu, cnnl = getattr(torch.backends, "mlu", None), getattr(torch.backends, "cnnl", None)
    if mlu is None or cnnl is None:
        raise UnsupportedError(
            "torch_mlu did not install torch.backends.mlu / torch.backends.cnnl; "
            f"reinstall the torch_mlu build made for torch {torch.__version__}"
        )
    return mlu, cnnl


class CambriconBackend(DeviceModuleBackend):
    name = "cambricon"
    device_type = "mlu"
    vendor = "Cambricon"
    ccl = "cncl"
    # Cambricon publishes no CNCL dtype table we could find; float64 reductions go through the host
    # until someone checks them on an MLU (conservative, lossless, and recorded when it happens).
    ccl_gaps = tuple(
        CclGap("float64", op, "host", "CNCL float64 reductions unconfirmed (no public CNCL dtype table)")
        for op in ("all_reduce", "reduce", "reduce_scatter")
    )
    visible_devices_env = "MLU_VISIBLE_DEVICES"  # torch_mlu also reads CN_VISIBLE_DEVICES first
    reduced_precision_matmul_format = "tf32"  # MLU500+ only; capabilities() says per device
    hardware_verification = None  # never run on an MLU yet
    # MLU graphs, torch.cuda.graph's shape: torch.mlu.MLUGraph / torch.mlu.graph (torch_mlu's cuda-to-mlu map pairs
    # torch.cuda.CUDAGraph with torch.mlu.MLUGraph); torch_mlu adds ProfilerActivity.MLU to torch.profiler.
    graph_names = ("MLUGraph", "graph")
    profiler_activity = "MLU"

    def runtime_versions(self) -> dict[str, str]:
        """torch_mlu's version."""
        package = sys.modules.get("torch_mlu")
        versions = {"torch_mlu": str(getattr(package, "__version__", "unknown"))} if package is not None else {}
        if self.standin:
            versions["standin"] = str(self.standin)
        return versions

    def _load_module(self) -> ModuleType:
        from .standins import OwnedElsewhere, standin_package

        try:  # HAL_STANDIN=cambricon: the torch_mlu stand-in, said everywhere
            package = standin_package(self.name) or _import_torch_mlu()
        except OwnedElsewhere as exc:  # one vendor runtime a process: another vendor's owns this one
            raise RuntimeElsewhere(str(exc)) from None
        except UnsupportedError as exc:  # this torch cannot write a device in Python: unavailable, and why
            raise RuntimeMissing(str(exc)) from None
        return registered_device_module(package, "mlu")

    def _probe_facts(self, index: int) -> ProbedFacts:
        """Name, memory and generation from torch.mlu.get_device_properties (name/major/minor/total_memory).

        torch_mlu's own rules: ``is_bf16_supported()`` is ``major >= 5``
        (https://github.com/Cambricon/torch_mlu/blob/master/torch_mlu/mlu/__init__.py) and its tests
        treat hardware TF32 as "enabled only on >= MLU500" (``tf32_is_not_fp32``: major >= 5).
        """
        base = super()._probe_facts(index)
        try:
            props = self._mod().get_device_properties(index)
            major, minor = int(props.major), int(props.minor)
        except Exception:  # no generation number: leave dtypes to the catalog
            return base
        newer = major >= FIRST_TF32_MAJOR
        return ProbedFacts(
            name=base.name,
            total_memory_bytes=base.total_memory_bytes,
            dtypes={
                "tf32": DtypeSupport.NATIVE if newer else DtypeSupport.ABSENT,
                "bf16": DtypeSupport.NATIVE if newer else DtypeSupport.ABSENT,
            },
            extra={"device_major": major, "device_minor": minor},
            how=f"probed via torch.mlu.get_device_properties (major {major}; torch_mlu: TF32/bf16 need major >= 5)",
        )

    # --- precision switches ----------------------------------------------------------------------
    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        """TF32 for fp32 matmuls and convolutions; MLU500-series devices only."""
        self.require_available()
        if enabled and not self.capabilities(self.current_device()).is_native("tf32"):
            raise UnsupportedError(
                f"{self.device_name(self.current_device())} has no TF32 matmul mode (torch_mlu uses hardware "
                "TF32 only on MLU500-series devices, device major >= 5); use precision fp32"
            )
        mlu, cnnl = _mlu_backend_flags()
        # torch.backends.mlu.matmul.allow_tf32 (CnnlMatmulTF32Controller, default False), "same function as
        # torch.backends.cuda.matmul.allow_tf32":
        # https://github.com/Cambricon/torch_mlu/blob/master/torch_mlu/backends/mlu/__init__.py
        mlu.matmul.allow_tf32 = bool(enabled)
        # torch.backends.cnnl.allow_tf32 (default True), "same function as torch.backends.cudnn.allow_tf32,
        # currently only affect conv": https://github.com/Cambricon/torch_mlu/blob/master/torch_mlu/backends/cnnl/__init__.py
        cnnl.allow_tf32 = bool(enabled)

    def reduced_precision_matmul_enabled(self) -> bool:
        if not self.is_available():
            return False
        return bool(_mlu_backend_flags()[0].matmul.allow_tf32)

    def set_deterministic(self, enabled: bool) -> None:
        """``torch.use_deterministic_algorithms`` plus CNNL's deterministic flag (no autotuning when on)."""
        torch.use_deterministic_algorithms(enabled)
        if not self.is_available():  # without torch_mlu there are no CNNL kernels to constrain
            return
        _, cnnl = _mlu_backend_flags()
        # torch.backends.cnnl.deterministic / .benchmark (ContextProp, like torch.backends.cudnn's):
        # https://github.com/Cambricon/torch_mlu/blob/master/torch_mlu/backends/cnnl/__init__.py
        cnnl.deterministic = bool(enabled)
        if enabled:
            cnnl.benchmark = False
