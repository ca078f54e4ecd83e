"""Writing a file whole or not at all, and the writability checks made before a run or a search starts."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hal.errors import ConfigError
from hal.run_dirs import check_creatable_file, read_at_most, write_text_atomic


def test_an_atomic_write_replaces_whole_and_makes_missing_folders(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out.json"
    write_text_atomic(target, "first\n")
    write_text_atomic(target, "second\n")
    assert target.read_text() == "second\n" and sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_a_failed_atomic_write_leaves_the_old_state_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # a directory where the file should go: the rename fails
    (target / "inside").write_text("kept\n")
    with pytest.raises(OSError):
        write_text_atomic(target, "new\n")
    assert (target / "inside").read_text() == "kept\n" and [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_files_that_cannot_be_written_are_one_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x\n")
    for path, words in ((tmp_path, "is a directory"), (blocker / "out.json", "exists and is not a directory")):
        with pytest.raises(ConfigError, match=words):
            check_creatable_file(path, "--out")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # a special file: the atomic rename would replace it with a regular one
    with pytest.raises(ConfigError, match="is not a regular file"):
        check_creatable_file(fifo, "--out")
    check_creatable_file(tmp_path / "new" / "out.json", "--out")  # creatable: no error, nothing made
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("path, root", [("/proc/hal-out.json", "/proc"), ("/sys/kernel/hal/out.json", "/sys"),
                                        ("/dev/hal-out.json", "/dev")])
def test_a_kernel_pseudo_filesystem_is_refused_even_where_access_says_writable(path: str, root: str) -> None:
    """For root, os.access calls /proc writable; the write would fail after the run."""
    with pytest.raises(ConfigError, match=f"is under {root}, a kernel pseudo-filesystem that holds no files") as info:
        check_creatable_file(Path(path), "--out")
    assert "\n" not in str(info.value)


def test_dev_shm_and_a_link_into_proc_are_told_apart(tmp_path: Path) -> None:
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        check_creatable_file(Path("/dev/shm/hal-probe.json"), "--out")  # a real tmpfs: no error, nothing made
    link = tmp_path / "into-proc"
    link.symlink_to("/proc")
    with pytest.raises(ConfigError, match="is under /proc"):
        check_creatable_file(link / "out.json", "--out")


def test_read_at_most_refuses_past_the_limit_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    assert read_at_most(path, 5) == b"12345" and read_at_most(path, 4) is None
    with open(path, "r+b") as f:  # a sparse gigabyte: refused by its size, not read
        f.truncate(1 << 30)
    assert read_at_most(path, 1 << 20) is None
