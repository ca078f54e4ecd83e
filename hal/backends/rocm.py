"""AMD Instinct GPUs and Hygon DCUs through a ROCm/HIP build of PyTorch.

On a HIP build torch's device type is still ``cuda`` and RCCL answers to the name ``nccl``; the
visible-devices variable is HIP_VISIBLE_DEVICES. A Hygon DCU is told apart from an AMD GPU by the
device name it reports (the catalog's match patterns), not by a different code path.
"""
from __future__ import annotations

from types import ModuleType

import torch

from hal.capabilities import ProbedFacts

from ._device_module import RuntimeMissing
from .cuda import CudaBackend, _init_torch_cuda


class RocmBackend(CudaBackend):
    name = "rocm"
    device_type = "cuda"
    vendor = "AMD / Hygon"
    ccl = "nccl"  # RCCL, registered under the nccl name on HIP builds
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    reduced_precision_matmul_format = "tf32"  # XF32 on MI300-class GPUs (catalog: tf32 native)
    no_reduced_precision_matmul = "has no XF32/TF32 matmul mode"
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
