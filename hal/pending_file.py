"""A file that gets its name only when complete: written unnamed (Linux ``O_TMPFILE``), linked into place at the end.

Why: a named temporary file beside the output is removed by ``finally`` on an error or Ctrl-C, but not when the
process is killed (SIGKILL, the kernel's out-of-memory killer, a native library's abort): then it stays behind as
``.NAME.tmp-PID``, a file of gigabytes nobody asked for. An unnamed file is freed by the kernel with the process.
Where the filesystem cannot make one (not Linux, or ``O_TMPFILE`` unsupported), the named temporary is used and
that is said once on stderr: a kill may then leave it behind.

A full disk (or a file-size limit) while writing is one ``HalError`` naming the output, how much was written and
the fix, and the partial file is gone.
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from types import TracebackType

from hal.errors import HalError

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota reached, file-size limit (RLIMIT_FSIZE)
_warned = False


class PendingFile:
    """``with PendingFile(path, what) as out: out.write(b"...")``, then ``out.commit()``; without ``commit`` (an
    error, an interrupt, a kill) nothing appears at ``path``. ``what`` names the output in messages (``--out``)."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = Path(path)
        self.what = what
        self.written = 0
        self.named: Path | None = None
        self.fd = self._open_unnamed()
        if self.fd is None:
            self.named = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            self.fd = os.open(self.named, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _warn_named(self.path.parent)
        self._file = os.fdopen(self.fd, "wb", buffering=1 << 20)

    def _open_unnamed(self) -> int | None:
        flag = getattr(os, "O_TMPFILE", None)
        if flag is None:
            return None
        try:
            return os.open(self.path.parent, flag | os.O_WRONLY, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                return None  # the filesystem cannot make unnamed files
            raise

    def write(self, data: bytes | memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            self._no_room(exc)
            raise
        self.written += len(data)

    def _no_room(self, exc: OSError) -> None:
        if exc.errno in NO_ROOM:
            why = {errno.EFBIG: "the file-size limit (ulimit -f) was reached",
                   errno.EDQUOT: "the disk quota is used up"}.get(exc.errno, "the disk is full")
            raise HalError(f"{self.what} {self.path}: {why} after {self.written / 2**20:,.1f} MiB written; nothing "
                           "was kept. Free space (or raise the limit) or write to another disk") from None

    def sync(self) -> None:
        """Everything written is on the disk (a full disk shows here, before any file is named)."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            self._no_room(exc)
            raise

    def commit(self) -> None:
        """Sync and give the file its name (replacing any file there)."""
        self.sync()
        if self.named is not None:
            os.replace(self.named, self.path)
            self.named = None
        else:
            link = self.path.with_name(f".{self.path.name}.link-{os.getpid()}")
            _link(self._file.fileno(), link)
            os.replace(link, self.path)
        self._file.close()

    def discard(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass  # the buffered tail could not be written: the file is dropped anyway
        if self.named is not None:
            self.named.unlink(missing_ok=True)
            self.named = None

    def __enter__(self) -> PendingFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.discard()  # after commit: the file is closed and named already, nothing to do


AT_FDCWD, AT_SYMLINK_FOLLOW = -100, 0x400


def _link(fd: int, name: Path) -> None:
    """Give the unnamed file ``fd`` the name ``name``: ``linkat`` of ``/proc/self/fd/FD`` following the link (what
    open(2) documents for O_TMPFILE; ``os.link`` calls link(2), which would link the /proc entry itself)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD, os.fsencode(name), AT_SYMLINK_FOLLOW) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(name))


def _warn_named(folder: Path) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"hal: warning: {folder} cannot hold unnamed files (O_TMPFILE); writing a named temporary there "
              "instead, which a killed process leaves behind", file=sys.stderr)


__all__ = ["NO_ROOM", "PendingFile"]
