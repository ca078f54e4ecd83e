"""``python -m hal.migration SCRIPT ARGS``: one rank of ``hal launch`` (or of ``torchrun -m hal.migration``).

Runs SCRIPT as ``__main__`` under the migration to the backend named by ``HAL_BACKEND`` (which
``hal launch`` exports to every rank), quietly: no banner per rank. On a backend whose device
type is already ``cuda`` nothing is patched and the script runs as ``python SCRIPT`` would. On the cpu target a
script asking for the CUDA device count is told the node's rank count (``launched_device_count``). The rank then
leaves through ``hal.rank.exit.exit_rank`` (process groups torn down first, then ``os._exit``).
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from hal.backend_registry import get_backend
    from hal.errors import HalError
    from hal.migration.runner import launched_device_count, run_script

    if not argv:
        print("usage: python -m hal.migration SCRIPT [ARGS...]  (backend from HAL_BACKEND, default cpu)", file=sys.stderr)
        return 2
    try:
        backend = get_backend(os.environ.get("HAL_BACKEND", "cpu"))
        return run_script(backend, argv[0], argv[1:], device_count=launched_device_count(backend.device_type))
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2


def _run_then_exit(argv: list[str]) -> None:
    """``main``, then the rank leaves through ``hal.rank.exit.exit_rank``: its process groups torn down
    before the interpreter's finalization could (which aborts or hangs now and then), its exit status its own."""
    import traceback

    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # what the interpreter would print, then the same safe exit
        traceback.print_exc()
        code = 1
    from hal.rank.exit import exit_rank

    exit_rank(code)


if __name__ == "__main__":
    from hal.rank.name import take_name

    take_name()  # what ps and top show: hal-rank-N
    _run_then_exit(sys.argv[1:])
