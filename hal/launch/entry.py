"""One rank of a function run: ``python -m hal.launch.entry MODULE:FUNCTION KWARGS_FILE OUT_DIR``.

Started by ``hal.launch.functions.run_function``. The rank calls ``FUNCTION(**kwargs)`` (it learns
its rank from RANK/WORLD_SIZE/LOCAL_RANK and its rendezvous from HAL_INIT_METHOD), pickles what it
returns to ``OUT_DIR/rank<R>.pkl`` (complete or absent: written aside, then renamed) and leaves with
``os._exit`` so a broken collective cannot hang interpreter teardown. An exception prints its
traceback to stderr (its last line is what the launcher's report shows) and exits 1.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback

from .names import resolve, result_path


def main(argv: list[str]) -> int:
    target, kwargs_file, out_dir = argv
    with open(kwargs_file, "rb") as fh:
        kwargs = pickle.load(fh)
    value = resolve(target, "rank function")(**kwargs)
    path = result_path(out_dir, int(os.environ["RANK"]))
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(value, fh)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    from hal.rank.name import take_name

    take_name()  # what ps and top show: hal-rank-N
    code = 1
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # report, never hang
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
