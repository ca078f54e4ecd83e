"""The planner's cluster: declared groups with catalog figures and their sources, probed devices, bad input as one line."""
from __future__ import annotations

import os

import pytest

from hal.errors import ConfigError
from hal.parallel.planner.cluster import check_holds, load_cluster, parse_cluster, probe_cluster, resolve

WHAT_IF = {"groups": [
    {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 8, "node": 0},
    {"backend": "ascend", "device": "huawei-ascend-910b", "count": 8, "node": 1,
     "peak_tflops": {"bf16": 313}, "memory_gb": 64, "memory_bandwidth_gbps": 1600},
]}


def test_declared_cluster_keeps_each_figure_source() -> None:
    cluster = resolve(parse_cluster(WHAT_IF))
    h100, ascend = cluster.types
    assert (h100.count, h100.per_node, ascend.node_of(3)) == (8, 8, 1)
    assert h100.peak_tflops["bf16"].value == pytest.approx(989.4) and h100.peak_tflops["bf16"].source == "catalog"
    assert ascend.peak_tflops["bf16"].source == "declared" and "fp32" not in ascend.peak_tflops  # no figure, none invented
    assert h100.link_gbps.value == pytest.approx(450) and h100.link_gbps.source == "catalog"  # NVLink 900 both ways
    bw, lat = cluster.between(h100, ascend, same_node=False)
    assert bw.value == 10.0 and bw.source == "default" and lat.value == pytest.approx(110)  # the bridge, then a node hop


@pytest.mark.parametrize("raw, message", [
    ({"groups": [{"backend": "cuda", "device": "nvidia-h100-smx", "count": 8}]}, "did you mean 'nvidia-h100-sxm'?"),
    ({"groups": [{"backend": "cpu", "device": "nvidia-h100-sxm", "count": 8}]}, "runs on backend(s) cuda, not 'cpu'"),
    ({"groups": [{"backend": "cuda", "device": "nvidia-h100-sxm", "count": 0}]}, "must be a positive integer"),
    ({"groups": [{"backend": "cuda", "device": "nvidia-h100-sxm", "count": 1, "peak_tflops": {"bf61": 1}}]}, "did you mean 'bf16'?"),
    ({"groups": [], "links": {}}, "is empty"),
    ({"groups": [{"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2}], "links": {"bridge_gpbs": 3}}, "did you mean 'bridge_gbps'?"),
])
def test_bad_cluster_is_one_line(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster(raw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_cluster_that_cannot_hold_the_model_is_one_line() -> None:
    cluster = resolve(parse_cluster({"groups": [{"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2}]}))
    check_holds(cluster, 5 * 10**9, "c.yaml")  # 80 GB at 16 B a parameter: 2 × 80 GB hold 5 G
    with pytest.raises(ConfigError, match=r"needs at least .* GiB .* add devices or shrink the model"):
        check_holds(cluster, 20 * 10**9, "c.yaml")
    unknown = resolve(parse_cluster({"groups": [{"backend": "ascend", "device": "huawei-ascend-910b", "count": 8}]}))
    with pytest.raises(ConfigError, match="declare memory_gb"):
        check_holds(unknown, 10, "c.yaml")


def test_probed_and_file_clusters(tmp_path) -> None:
    probed = probe_cluster(cpu_ranks=4)
    assert probed.probed and probed.type("cpu-generic").count == 4 and probed.type("cpu-generic").cores >= 1
    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  groups:\n    - {backend: cpu, device: cpu-generic, count: 4, cores: 2}\n")
    from_file = load_cluster(None, "run.yaml", str(path))
    assert not from_file.probed and from_file.type("cpu-generic").cores == 2
    with pytest.raises(ConfigError, match="^--cluster .*missing.yaml: config file not found"):
        load_cluster(None, "run.yaml", str(tmp_path / "missing.yaml"))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would wait for a writer forever
    with pytest.raises(ConfigError, match="^--cluster .*fifo.yaml: is not a file"):
        load_cluster(None, "run.yaml", str(fifo))
    (tmp_path / "bad.yaml").write_text("cluster: [\n")
    with pytest.raises(ConfigError, match="^--cluster .*bad.yaml: not valid YAML"):
        load_cluster(None, "run.yaml", str(tmp_path / "bad.yaml"))
