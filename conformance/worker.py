"""One rank of a multi-process conformance job: ``python -m conformance.worker --job NAME ...``.

Started by ``conformance.spawn.run_job`` (one process per rank, ``file://`` rendezvous). The rank
joins the world through ``collectives.init_distributed`` on the backend under test, runs the
job's per-rank function on the spec, saves what it returns (``torch.save``: tensors, numbers,
strings, lists and dicts) and leaves with ``os._exit`` so a broken collective cannot hang
interpreter teardown. Any exception is printed (traceback last) and the rank exits 1; the parent
then stops the others.

A job is a name in ``JOBS`` or any importable ``"module:callable"`` with the signature
``fn(world: collectives.World, spec: dict) -> object``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import traceback
from typing import Any, Callable

JOBS: dict[str, str] = {
    "collectives": "hal.conformance.collective_job:run_rank",
    "pipeline": "hal.conformance.pipeline_check:run_rank",
}


def resolve(path: str, what: str = "callable") -> Callable[..., Any]:
    """``"package.module:attr"`` → the object; one clear line when it cannot be imported."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {path!r} is not 'module:callable' (e.g. tests.planted_collectives:make)")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be imported ({exc}); put its package on PYTHONPATH") from None
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is not callable")
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.worker", description="one rank of a conformance job")
    parser.add_argument("--job", required=True, help=f"one of {', '.join(sorted(JOBS))}, or module:callable")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--init", required=True, help="torch.distributed init method, e.g. file:///tmp/x/store")
    parser.add_argument("--spec", required=True, help="torch.save'd dict handed to the job function")
    parser.add_argument("--out", required=True, help="where this rank saves its result")
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    import torch

    from hal.collectives import init_distributed, shutdown

    spec = torch.load(args.spec, weights_only=True)
    world = init_distributed(
        args.backend, init_method=args.init, rank=args.rank, world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.collective_timeout),
    )
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    try:
        value = resolve(JOBS.get(args.job, args.job), "job")(world, spec)
    finally:
        shutdown()
    tmp = args.out + ".tmp"
    torch.save(value, tmp)
    os.replace(tmp, args.out)  # the parent sees a complete file or none
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # report, never hang
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
