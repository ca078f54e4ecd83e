"""AMD Instinct GPUs and Hygon DCUs through a ROCm/HIP build of PyTorch.

On a HIP build torch's device type is still ``cuda`` and RCCL answers to the name ``nccl``; the
visible-devices variable is HIP_VISIBLE_DEVICES. A Hygon DCU is told apart from an AMD GPU by the
device name it reports (the catalog's match patterns), not by a different code path.
"""
from __future__ import annotations

from types import ModuleType

import torch

from hal.capabilities import ProbedFacts
from hal.errors import UnsupportedError

from ._device_module import RuntimeMissing
from .cuda import CudaBackend, _init_torch_cuda, _set_tf32


class RocmBackend(CudaBackend):
    name = "rocm"
    device_type = "cuda"
    vendor = "AMD / Hygon"
    ccl = "nccl"  # RCCL, registered under the nccl name on HIP builds
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    reduced_precision_matmul_format = "tf32"  # XF32 on MI300-class GPUs (catalog: tf32 native)
    hardware_verification = None

    def _load_module(self) -> ModuleType:
        if torch.version.hip is None:
            raise RuntimeMissing(
                f"this torch build has no ROCm/HIP support (torch {torch.__version__}); "
                "install a ROCm build of PyTorch (Hygon DCU: the DTK build)"
            )
        return _init_torch_cuda("ROCm/HIP")

    def _probe_facts(self, index: int) -> ProbedFacts:
        props = torch.cuda.get_device_properties(index)
        arch = str(getattr(props, "gcnArchName", "") or "")
        return ProbedFacts(
            name=props.name,
            total_memory_bytes=int(props.total_memory),
            extra={"gcn_arch": arch, "multiprocessors": props.multi_processor_count},
            how="probed via torch.cuda.get_device_properties (HIP)",
        )

    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        self.require_available()
        if enabled and not self.capabilities(self.current_device()).is_native("tf32"):
            raise UnsupportedError(
                f"{self.device_name(self.current_device())} has no XF32/TF32 matmul mode; use precision fp32"
            )
        _set_tf32(enabled)
