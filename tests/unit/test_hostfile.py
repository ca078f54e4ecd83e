"""A FlagScale-style hostfile read as the planner's cluster (``hal plan --cluster`` / ``hal profile --cluster``): one
group a host with its catalog device; bad lines, unknown types and backend names refused in one line."""
from __future__ import annotations

from pathlib import Path

import pytest

from hal.errors import ConfigError
from hal.parallel.planner.cluster import load_cluster
from hal.parallel.planner.hostfile import is_hostfile, parse_hostfile

MIXED = """# two vendors
10.0.0.1 slots=8 type=nvidia-h100-sxm
10.0.0.2 slots=8 type=nvidia-h100-sxm   # a second H100 host
10.0.1.1 slots=8 type=huawei-ascend-910b
"""


def test_a_hostfile_becomes_a_cluster_of_one_group_a_host(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text(MIXED)
    cluster = load_cluster(None, "test", str(path))
    by_device = {t.device: t for t in cluster.types}
    assert set(by_device) == {"nvidia-h100-sxm", "huawei-ascend-910b"}
    assert by_device["nvidia-h100-sxm"].count == 16 and by_device["nvidia-h100-sxm"].backend == "cuda"
    assert by_device["huawei-ascend-910b"].count == 8 and by_device["huawei-ascend-910b"].backend == "ascend"
    assert cluster.device_count == 24


@pytest.mark.parametrize(("text", "words"), [
    ("h slots=8 type=nvidia-h100-sxn\n", "is not a catalog device (did you mean 'nvidia-h100-sxm'?)"),
    ("h slots=8 type=cuda\n", "type=cuda is a backend, not a device; give its catalog id (nvidia-h100-sxm"),
    ("h slots=0 type=nvidia-h100-sxm\n", "slots=0: give the host's device count"),
    ("h slots=8\n", "names no type="),
])
def test_bad_lines_are_one_line_naming_the_line(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_hostfile(text, "hosts")
    assert words in str(raised.value) and "\n" not in str(raised.value) and str(raised.value).startswith("hosts:1:")


def test_a_yaml_cluster_is_not_taken_for_a_hostfile() -> None:
    assert is_hostfile(MIXED)
    assert not is_hostfile("cluster:\n  groups:\n    - {backend: cuda, device: nvidia-h100-sxm, count: 8, node: 0}\n")
    assert not is_hostfile("# only a comment\n")
