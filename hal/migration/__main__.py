"""``python -m hal.migration SCRIPT ARGS``: one rank of ``hal launch`` (or of ``torchrun -m hal.migration``).

Runs SCRIPT as ``__main__`` under the migration to the backend named by ``HAL_BACKEND`` (which
``hal launch`` exports to every rank), quietly: no banner per rank. On a backend whose device
type is already ``cuda`` nothing is patched and the script runs as ``python SCRIPT`` would.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from hal.backend_registry import get_backend
    from hal.errors import HalError
    from hal.migration.runner import run_script

    if not argv:
        print("usage: python -m hal.migration SCRIPT [ARGS...]  (backend from HAL_BACKEND, default cpu)", file=sys.stderr)
        return 2
    try:
        backend = get_backend(os.environ.get("HAL_BACKEND", "cpu"))
        return run_script(backend, argv[0], argv[1:])
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
