"""The script runner behind ``hal run``: a CUDA-written script as ``__main__`` inside ``migrate``."""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import Any

from hal.backend import Backend
from hal.errors import ConfigError, HalError
from hal.migration.scope import migrate


def run_script(backend: Backend, path: str, argv: list[str], *, device_count: int | None = None) -> int:
    """Run ``path`` as ``__main__`` under ``migrate(backend)``; its exit code, like ``python path``.

    A hal error the script does not catch — a CUDA feature the target cannot run
    (``MigrationUnsupported``, naming the script's line), a collective that timed out — is one
    line, exit 1; hal errors before the script starts (e.g. the backend is unavailable) propagate
    for the CLI to print as one line (exit 2); any other uncaught exception prints its traceback
    and gives 1, as Python does.
    """
    script = os.path.abspath(path)
    saved_argv, saved_path = sys.argv, list(sys.path)
    started = False
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        with migrate(backend, device_count=device_count):
            backend.require_available()
            started = True
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except HalError as exc:
        if not started:
            raise
        print(f"hal: error: {exc}", file=sys.stderr)  # the script's failure (a CUDA feature, a collective): one line
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        sys.stdout.flush()
        sys.stderr.flush()


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


COUNT_ENV = "HAL_DEVICE_COUNT"  # the CUDA device count a rank tells its script (cpu target)


def launched_device_count(device_type: str) -> int | None:
    """On the cpu target, the CUDA devices a launched rank's script is told exist: ``HAL_DEVICE_COUNT``, else the
    node's rank count (torchrun's ``LOCAL_WORLD_SIZE``) — a DDP script under ``hal launch --nproc N`` expects a
    device a local rank, and ``cuda:LOCAL_RANK`` is then the host, as every device is. None: the backend's own."""
    if device_type != "cpu":
        return None
    given = os.environ.get(COUNT_ENV)
    if given is not None:
        if not given.isdigit() or not 1 <= int(given) <= 64:
            raise ConfigError(f"{COUNT_ENV}={given!r} is not a device count from 1 to 64; set a whole number")
        return int(given)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 1 else None
