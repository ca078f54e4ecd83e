"""PLACEHOLDER — being written; do not rely on it."""
from __future__ import annotations

from types import ModuleType

from ._device_module import DeviceModuleBackend, RuntimeMissing


class CambriconBackend(DeviceModuleBackend):
    name = "cambricon"
    device_type = "mlu"
    vendor = "Cambricon"
    ccl = "cncl"
    visible_devices_env = "MLU_VISIBLE_DEVICES"

    def _load_module(self) -> ModuleType:
        raise RuntimeMissing("placeholder")

    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        raise NotImplementedError

    def reduced_precision_matmul_enabled(self) -> bool:
        return False

    def set_deterministic(self, enabled: bool) -> None:
        raise NotImplementedError
