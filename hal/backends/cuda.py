"""NVIDIA GPUs through torch.cuda on a CUDA build of PyTorch; NCCL for collectives.

Availability is decided by a probe (allocate and compute on cuda:0), not by the build flag
alone. TF32 is the reduced-precision fp32 matmul mode; fp8 is native from compute capability 8.9.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from hal.capabilities import DtypeSupport, ProbedFacts
from hal.errors import UnsupportedError

from ._device_module import DeviceModuleBackend, RuntimeMissing, _one_line

CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"
_AUTOGRAD_READY: set[int] = set()  # devices whose autograd thread this process has readied (prepare_autograd)


class CudaBackend(DeviceModuleBackend):
    name = "cuda"
    device_type = "cuda"
    vendor = "NVIDIA"
    ccl = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    reduced_precision_matmul_format = "tf32"
    no_reduced_precision_matmul = "has no TF32 (needs compute capability 8.0+)"  # the refusal's words (rocm: its own)
    graph_names = ("CUDAGraph", "graph")  # CUDA graphs (hipGraph on ROCm builds: the same torch.cuda API)
    profiler_activity = "CUDA"  # CUPTI through kineto (roctracer on ROCm builds)
    ccl_reduce_ops = frozenset({"sum", "avg", "max", "min", "product"})  # ncclAvg since NCCL 2.10
    ccl_coalesces = True  # ProcessGroupNCCL's start/end coalescing is ncclGroupStart/End (RCCL on HIP builds: the same code)
    hardware_verification = (
        "NVIDIA H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130), 2026-11-26: CUDA-marked tests and "
        "hal conformance (1 GPU) passed; NVIDIA H200 x2 and x4: hal conformance with NCCL passed"
    )

    def runtime_versions(self) -> dict[str, str]:
        versions = {"cuda": str(torch.version.cuda)} if torch.version.cuda else {}
        if torch.version.hip:
            versions["hip"] = str(torch.version.hip)
        try:
            raw = int(torch._C._cuda_getDriverVersion())  # e.g. 12080: the CUDA version the driver supports
            versions["driver_cuda"] = f"{raw // 1000}.{raw % 1000 // 10}"
        except Exception:  # noqa: BLE001 - no driver here; the other fields still say what was built
            pass
        return versions

    def device_uuid(self, index: int = 0) -> str | None:
        uuid = getattr(self._mod().get_device_properties(index), "uuid", None)
        return str(uuid) if uuid is not None else None

    def prepare_autograd(self, index: int) -> None:
        """One tiny elementwise backward on ``cuda:index``, once a process and device.

        Why: torch's autograd thread for a CUDA device makes it current only when it differs from the thread's (device
        0 never does), so where a process's first backward on device 0 begins with a matmul, cuBLAS finds no context
        on that thread and torch warns "Attempting to run cuBLAS, but there was no current CUDA context!" (seen once a
        process in `hal profile`'s launched ranks on H200s). An elementwise kernel launched there first binds the
        device's primary context, silently. Skipped while a stream captures a graph (nothing may launch then)."""
        if index in _AUTOGRAD_READY or self._mod().is_current_stream_capturing():
            return
        _AUTOGRAD_READY.add(index)
        with torch.enable_grad():
            seed = torch.zeros((), device=self.device(index), requires_grad=True)
            (seed * 2.0).backward()

    def _load_module(self) -> ModuleType:
        if torch.version.hip is not None:
            raise RuntimeMissing(f"this torch is a ROCm/HIP build (torch {torch.__version__}); use backend 'rocm'")
        if torch.version.cuda is None:
            raise RuntimeMissing(
                f"this torch build has no CUDA support (torch {torch.__version__}); install a CUDA build of PyTorch"
            )
        return _init_torch_cuda("CUDA")

    def _probe_facts(self, index: int) -> ProbedFacts:
        props = torch.cuda.get_device_properties(index)
        cc = (props.major, props.minor)
        has_fp8 = cc >= (8, 9) and hasattr(torch, "float8_e4m3fn")
        native = DtypeSupport.NATIVE
        return ProbedFacts(
            name=props.name,
            total_memory_bytes=int(props.total_memory),
            dtypes={
                "tf32": native if cc >= (8, 0) else DtypeSupport.ABSENT,
                "bf16": native if cc >= (8, 0) else DtypeSupport.EMULATED,
                "fp8_e4m3": native if has_fp8 else DtypeSupport.ABSENT,
                "fp8_e5m2": native if has_fp8 else DtypeSupport.ABSENT,
            },
            extra={"compute_capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count},
            how="probed via torch.cuda.get_device_properties",
        )

    # --- precision switches ----------------------------------------------------------------------
    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        self.require_available()
        if enabled and not self.capabilities(self.current_device()).is_native("tf32"):
            raise UnsupportedError(
                f"{self.device_name(self.current_device())} {self.no_reduced_precision_matmul}; use precision fp32"
            )
        _set_tf32(enabled)

    def reduced_precision_matmul_enabled(self) -> bool:
        return _tf32_enabled()

    def set_deterministic(self, enabled: bool) -> None:
        _set_deterministic(enabled)


def _init_torch_cuda(runtime: str) -> ModuleType:
    try:
        torch.cuda.init()
    except Exception as exc:
        raise RuntimeMissing(f"the {runtime} runtime failed to initialise: {_one_line(exc)}") from None
    return torch.cuda


def _set_tf32(enabled: bool) -> None:
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch ≥ 2.9: the allow_tf32 flags are deprecated
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def _tf32_enabled() -> bool:
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


def _set_deterministic(enabled: bool) -> None:
    if enabled:
        # cuBLAS reads this when a handle is created; set it early (hal does, before first use).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False if enabled else torch.backends.cudnn.benchmark
