"""Where a run writes when the user names no folder (``runs/<name>-<date-time>``, git-ignored), whether
the places a run will write can be written (checked before it starts), and writing a file whole or not at all."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

CACHE_ENV = "HAL_CACHE_DIR"  # where hal keeps what it may remake (default: $XDG_CACHE_HOME/hetero-hal)


def cache_dir() -> Path:
    """Where hal keeps what it may remake (host profiles, parity reference bands): ``HAL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hetero-hal``."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetero-hal"


def new_run_dir(name: str) -> Path:
    """``runs/<name>-<YYYYmmdd-HHMMSS>``, with a -2, -3 ... suffix if that exists already (not created)."""
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")  # /dev/shm, a real tmpfs, excepted


def _pseudo_filesystem(path: Path) -> str | None:
    """The kernel pseudo-filesystem ``path`` resolves into (/proc, /sys, /dev but /dev/shm), or None."""
    resolved = Path(os.path.realpath(path))
    for root in PSEUDO_FILESYSTEMS:
        if resolved == Path(root) or Path(root) in resolved.parents:
            if root == "/dev" and (resolved == Path("/dev/shm") or Path("/dev/shm") in resolved.parents):
                return None
            return root
    return None


def check_creatable_dir(path: Path, what: str) -> None:
    """``path`` is a writable directory, or can be made one: one ConfigError line otherwise, nothing created.

    Checked before a run starts, so a run directory under a file or in a read-only place fails at once,
    not after training, with a half-written run behind it.
    """
    from hal.errors import ConfigError

    pseudo = _pseudo_filesystem(path)
    if pseudo is not None:  # os.access says yes there for root, and the write fails later
        raise ConfigError(f"{what} {path}: is under {pseudo}, a kernel pseudo-filesystem that holds no files; "
                          "give another directory")
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{what} {path}: exists and is not a directory; give a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} {path}: not writable; give a directory you can write to")
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{what} {path}: cannot be created, {ancestor} is a file; give another directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: cannot be created, {ancestor} is not writable; give another directory")


def check_creatable_file(path: Path, what: str) -> None:
    """``path`` can be written as a file: not a directory, and its directory writable or creatable."""
    from hal.errors import ConfigError

    if path.is_dir():
        raise ConfigError(f"{what} {path}: is a directory; give a file path")
    if path.exists() and not path.is_file():  # a device, pipe or socket: the atomic rename would replace it
        raise ConfigError(f"{what} {path}: is not a regular file (a device, pipe or socket); give a file path")
    check_creatable_dir(path.parent, f"{what}'s directory")


def read_at_most(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """The bytes of the file at ``path``, or None where it holds more than ``limit``: the size is checked before
    anything is read, and the read stops one byte past the limit (a file that grew since). OSError as open raises."""
    if os.stat(path).st_size > limit:
        return None
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    return None if len(raw) > limit else raw


def read_limited(path: str | os.PathLike[str], limit: int, what: str, fix: str) -> bytes:
    """The bytes of a file a user named, at most ``limit`` of them (checked before any read): one ConfigError line,
    ``what: ...; fix``, where it is not a regular file (a pipe would block the read forever), cannot be read or
    holds more."""
    from hal.errors import ConfigError

    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"{what}: is not a regular file (a directory, pipe or device); {fix}")
    try:
        raw = read_at_most(path, limit)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot be read ({exc.strerror or exc}); {fix}") from None
    if raw is None:
        size = f"{limit >> 20} MiB" if limit >= 2**20 else f"{limit} bytes"
        raise ConfigError(f"{what}: larger than {size}, more than such a file holds; {fix}")
    return raw


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, renamed over it: a reader (or a user after a
    crash) sees the old file or the new one, never half of one. The temporary name is this process's own, so two
    writers of one path never share it; missing folders above ``path`` are made (what ``check_creatable_file``
    promised)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as fh:  # "x": created here, the umask honoured
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
