"""Huawei Ascend NPUs through torch_npu (Ascend Extension for PyTorch); HCCL for collectives.

torch_npu is imported lazily (in ``_load_module`` and, for the fused ops of ``hal.kernels.ascend``,
in their ``requires`` checks), never when this module is imported or the backend instantiated. Importing
torch_npu registers ``torch.npu`` (``torch._register_device_module("npu", torch_npu.npu)``, see
https://pytorch.org/tutorials/advanced/privateuseone.html), a torch.cuda-shaped module, so the shared
``DeviceModuleBackend`` drives it. HF32 is Ascend's reduced-precision fp32 mode for matmul/conv; the
NPU has no fp64 compute.

NOT verified on Ascend hardware: written against Huawei's public docs, cited next to each call.
The fused ops (npu_rms_norm, npu_fusion_attention, ...) live in ``hal.kernels.ascend``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

import torch

from hal.backend import CclGap
from hal.capabilities import DtypeSupport, ProbedFacts
from hal.errors import UnsupportedError

from ._device_module import DeviceModuleBackend, RuntimeElsewhere, RuntimeMissing, registered_device_module

PACKAGE = "torch_npu"
NOT_INSTALLED = "torch_npu is not installed"
HCCL_DETERMINISTIC = "HCCL_DETERMINISTIC"


def _install_hint() -> str:
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"pip install torch-npu matching torch {major_minor}; it needs Huawei's CANN toolkit"


def find_torch_npu() -> tuple[ModuleType | None, str]:
    """(torch_npu, "") or (None, why), telling "not installed" from "installed but broken"."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError) as exc:
        return None, f"torch_npu failed to import: {_first_line(exc)}"
    if spec is None:
        return None, NOT_INSTALLED
    try:
        return importlib.import_module(PACKAGE), ""
    except Exception as exc:  # CANN libraries missing, torch/torch_npu mismatch, driver errors
        return None, f"torch_npu failed to import: {_first_line(exc)}"


def find_runtime() -> tuple[ModuleType | None, str]:
    """The torch_npu this process uses: its stand-in where ``HAL_STANDIN`` asks for one (raising as
    ``standins.standin_package`` does: another vendor runtime owns this process's device, or this torch cannot host
    one), else the installed package, or (None, why)."""
    from .standins import standin_package

    package = standin_package(AscendBackend.name)
    return (package, "") if package is not None else find_torch_npu()


def _npu_profiler() -> ModuleType | None:
    """torch_npu.profiler where it imports and has the NPU activity; None otherwise."""
    try:
        module = importlib.import_module(f"{PACKAGE}.profiler")
    except Exception:  # absent or broken: the contract says unsupported, with the reason
        return None
    activity = getattr(module, "ProfilerActivity", None)
    return module if activity is not None and hasattr(activity, "NPU") and callable(getattr(module, "profile", None)) else None


def _first_line(exc: BaseException) -> str:
    """'<Type>: <first line of the message>', kept to one short line."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class AscendBackend(DeviceModuleBackend):
    name = "ascend"
    device_type = "npu"
    vendor = "Huawei"
    ccl = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ccl_gaps = (
        # HcclAllReduce / HcclReduce / HcclReduceScatter on Atlas A2 (910B): int8, int16, int32, int64,
        # float16, float32, bfp16 — no float64; "prod" not for int16 or bfp16. CANN 8.0 HCCL API reference,
        # https://www.hiascend.com/document/detail/zh/canncommercial/80RC2/apiref/hcclapiref/hcclcpp_07_0015.html
        *(CclGap("float64", op, "host", "HCCL reductions have no float64 (CANN HCCL API reference)")
          for op in ("all_reduce", "reduce", "reduce_scatter")),
        CclGap("bfloat16", "product", "host", "HCCL prod has no bfp16 on Atlas A2 (CANN HCCL API reference)"),
        # HCCL's collective list (AllReduce, Broadcast, AllGather, ReduceScatter, Reduce, AlltoAll(V), Send/Recv,
        # Scatter on newer CANN) has no Gather: through the host, as the stand-in HCCL made us find
        CclGap(None, "gather", "host", "HCCL has no Gather (CANN HCCL API reference, collective list)"),
        CclGap("int16", "product", "host", "HCCL prod has no int16 (CANN HCCL API reference)"),
    )
    reduced_precision_matmul_format = "hf32"
    hardware_verification = None  # never run on an Ascend NPU yet
    # NPUGraph (aclgraph) capture/replay, torch.cuda.graph's signature: torch_npu.npu.NPUGraph, torch_npu.npu.graph,
    # https://gitcode.com/Ascend/pytorch/blob/master/docs/zh/developer_notes/npugraph.md (torch_npu/npu/graphs.py)
    graph_names = ("NPUGraph", "graph")
    profiler_activity = "NPU"  # of torch_npu.profiler.ProfilerActivity, not torch.profiler's (see ``profiler``)

    def profiler(self, **kwargs: Any) -> Any:
        """Ascend PyTorch Profiler: ``torch_npu.profiler.profile`` with its CPU and NPU activities (torch.profiler
        does not record NPU kernels), https://www.hiascend.com/document (Ascend PyTorch Profiler, torch_npu.profiler)."""
        self.require_available()
        profiler = _npu_profiler()
        if profiler is None:
            raise UnsupportedError(self._why_not("profiler"))
        return profiler.profile(activities=[profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.NPU], **kwargs)

    def grad_scaler(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, enabled: bool = True) -> Any:
        """torch_npu's own scaler where the runtime has one (``torch_npu.npu.amp.GradScaler``: its reciprocal in
        float32, https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu-amp.md), else the
        contract's float32-reciprocal one (the stand-in has no scaler of its own)."""
        vendor = getattr(getattr(self._mod(), "amp", None), "GradScaler", None)
        if vendor is None:
            return super().grad_scaler(init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        return vendor(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                      growth_interval=growth_interval, enabled=enabled)

    def _contract_answers(self) -> dict[str, tuple[bool, str, str]]:
        answers = super()._contract_answers()
        loaded = self._module is not None
        answers["profiler"] = (loaded and _npu_profiler() is not None,
                               "torch_npu.profiler.profile with ProfilerActivity.CPU + NPU",
                               "torch_npu.profiler (with ProfilerActivity.NPU) is missing from this torch_npu")
        return answers

    def runtime_versions(self) -> dict[str, str]:
        """torch_npu's version, and CANN's and the driver's where it reports them (``torch_npu.npu.utils.get_cann_version``, CANN 8.1.RC1 on)."""
        package = sys.modules.get("torch_npu")
        versions = {"torch_npu": str(getattr(package, "__version__", "unknown"))} if package is not None else {}
        get = getattr(getattr(getattr(package, "npu", None), "utils", None), "get_cann_version", None)
        for key, module in (("cann", "CANN"), ("driver", "DRIVER")):
            try:
                found = get(module=module) if callable(get) else ""
            except Exception:  # noqa: BLE001 - an older CANN answers nothing; the report then lacks the field
                found = ""
            if found:
                versions[key] = str(found)
        if self.standin:
            versions["standin"] = str(self.standin)
        return versions

    def _load_module(self) -> ModuleType:
        from .standins import OwnedElsewhere

        try:  # HAL_STANDIN=ascend: the torch_npu stand-in, said everywhere
            package, why = find_runtime()
        except OwnedElsewhere as exc:  # one vendor runtime a process: another vendor's owns this one
            raise RuntimeElsewhere(str(exc)) from None
        except UnsupportedError as exc:  # this torch cannot write a device in Python: unavailable, and why
            raise RuntimeMissing(str(exc)) from None
        if package is None:
            raise RuntimeMissing(f"{why} ({_install_hint()})" if why == NOT_INSTALLED else why)
        return registered_device_module(package, "npu")  # torch_npu registers torch.npu on import

    def _probe_facts(self, index: int) -> ProbedFacts:
        """Name and memory from torch.npu; fp64 is absent on every NPU, whatever the catalog says."""
        base = super()._probe_facts(index)
        return ProbedFacts(
            name=base.name,
            total_memory_bytes=base.total_memory_bytes,
            # torch_npu has no float64 compute on the NPU (it downcasts or fails), e.g.
            # https://github.com/huggingface/diffusers/pull/10123 ("npu not support float64").
            dtypes={"fp64": DtypeSupport.ABSENT},
            extra={"reduced_precision_matmul": "hf32"},
            how="probed via torch.npu (fp64: no float64 compute on Ascend NPUs under torch_npu)",
        )

    # --- precision switches ----------------------------------------------------------------------
    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        """HF32 for fp32 matmuls and convolutions (Ascend's analogue of TF32)."""
        npu = self._mod()
        # torch_npu.npu.matmul.allow_hf32 (bool, default False), like torch.backends.cuda.matmul.allow_tf32:
        # https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu-matmul-allow_hf32.md
        npu.matmul.allow_hf32 = bool(enabled)
        # torch_npu.npu.conv.allow_hf32 (bool, default True), like torch.backends.cudnn.allow_tf32:
        # https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu-conv-allow_hf32.md
        npu.conv.allow_hf32 = bool(enabled)

    def reduced_precision_matmul_enabled(self) -> bool:
        if not self.is_available() or self._module is None:
            return False
        return bool(self._module.matmul.allow_hf32)

    def set_deterministic(self, enabled: bool) -> None:
        """Deterministic kernels and HCCL reductions.

        HCCL reads ``HCCL_DETERMINISTIC`` when communicators are created: call this before
        initialising the process group. No other switch is used: ``torch_npu.npu.set_deterministic_level``
        needs CANN 8.5+ and replaces, rather than adds to, ``torch.use_deterministic_algorithms``.
        """
        # Ascend's deterministic-compute page documents torch.use_deterministic_algorithms(True) as the
        # NPU switch (only the first effective setting per thread takes hold):
        # https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/determin_API_list.md
        torch.use_deterministic_algorithms(enabled)
        # CANN env var HCCL_DETERMINISTIC=true|false|strict: deterministic AllReduce/ReduceScatter/Reduce:
        # https://www.hiascend.com/document/detail/zh/canncommercial/850/maintenref/envvar/envref_07_0099.html
        current = os.environ.get(HCCL_DETERMINISTIC, "").strip().lower()
        if enabled and current not in ("true", "strict"):
            os.environ[HCCL_DETERMINISTIC] = "true"
        elif not enabled and current in ("true", "strict"):
            os.environ[HCCL_DETERMINISTIC] = "false"
