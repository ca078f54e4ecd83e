"""The shipped device catalog: complete, sourced, and matched by the names runtimes report."""
from __future__ import annotations

import pytest

from hal.capabilities import DTYPE_KEYS, CatalogError, DtypeSupport, ProbedFacts, load_catalog, lookup, merge, parse_catalog

REQUIRED = {
    ("cuda", "NVIDIA H100 80GB HBM3"): "nvidia-h100-sxm",
    ("cuda", "NVIDIA H100 PCIe"): "nvidia-h100-pcie",
    ("cuda", "NVIDIA H200"): "nvidia-h200-sxm",
    ("cuda", "NVIDIA A100-SXM4-80GB"): "nvidia-a100-sxm4-80gb",
    ("cuda", "Tesla V100-SXM2-32GB"): "nvidia-v100-sxm2-32gb",
    ("rocm", "AMD Instinct MI300X"): "amd-mi300x",
    ("rocm", "AMD Instinct MI250X/MI250"): "amd-mi250x",
    ("rocm", "DCU K100_AI"): "hygon-dcu-k100-ai",
    ("ascend", "Ascend910B2"): "huawei-ascend-910b",
    ("cambricon", "MLU370-X8"): "cambricon-mlu370-x8",
    ("cambricon", "MLU590"): "cambricon-mlu590",
    ("cpu", "AMD EPYC 9654"): "cpu-generic",
}


@pytest.mark.parametrize("key", sorted(REQUIRED), ids=lambda k: k[1])
def test_required_models_are_matched(key) -> None:
    entry = lookup(*key)
    assert entry is not None and entry.id == REQUIRED[key]


def test_every_entry_is_complete_and_sourced() -> None:
    for entry in load_catalog():
        assert set(entry.dtypes) == set(DTYPE_KEYS) and set(entry.peak_tflops) == set(DTYPE_KEYS)
        assert len(entry.source) > 10, entry.id
        has_numbers = any(v is not None for v in entry.peak_tflops.values()) or entry.memory_gb
        if has_numbers:
            assert "http" in entry.source or any("http" in s for s in entry.sources.values()), entry.id


def test_hopper_facts() -> None:
    h100 = lookup("cuda", "NVIDIA H100 80GB HBM3")
    assert h100.memory_gb == 80 and h100.dtypes["fp8_e4m3"] is DtypeSupport.NATIVE
    assert h100.peak_tflops["bf16"] > 900
    assert lookup("ascend", "Ascend910B3").dtypes["fp64"] is DtypeSupport.ABSENT


def test_unknown_model_keeps_probed_facts_only() -> None:
    assert lookup("cuda", "NVIDIA Future GPU 9000") is None
    caps = merge("cuda", None, ProbedFacts("NVIDIA Future GPU 9000", 10**11, {"bf16": DtypeSupport.NATIVE}))
    assert caps.catalog_id is None and caps.memory_bytes == 10**11
    assert caps.is_native("bf16") and caps.support("fp8_e4m3") is DtypeSupport.UNKNOWN


def test_probe_overrides_catalog_and_says_so() -> None:
    entry = lookup("cuda", "NVIDIA H100 80GB HBM3")
    caps = merge("cuda", entry, ProbedFacts("NVIDIA H100 80GB HBM3", 85520809984, {"fp8_e4m3": DtypeSupport.ABSENT}, how="probe"))
    assert caps.memory_bytes == 85520809984 and caps.sources["memory"] == "probe"
    assert caps.support("fp8_e4m3") is DtypeSupport.ABSENT and caps.sources["dtypes.fp8_e4m3"] == "probe"
    assert caps.peak_tflops["bf16"] == entry.peak_tflops["bf16"]


def test_malformed_catalog_is_rejected() -> None:
    with pytest.raises(CatalogError, match="exactly the keys"):
        parse_catalog("schema: 1\ndevices:\n- {id: x, vendor: v, model: m, backends: [cpu], match: ['.*'], "
                      "peak_tflops: {fp32: 1}, dtypes: {fp32: native}, source: s}\n")
