"""This host's calibrated profile for a config, made on request (``hal plan --calibrate``) and cached for later runs.

Why: without a profile ``hal plan`` can only guess each stage's time from its layer count, and on the main example
that guess put the idle share on the wrong stage (stage 0 69 % idle predicted, about 28 % measured). A quick profile
of the devices present takes seconds; kept under the cache directory, keyed by the model, precision, sequence length
and this host (name, cores, machine, torch), every later ``hal plan`` of such a config prices with measured times.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Callable

from hal.parallel.config.run import RunConfig
from hal.parallel.planner.device_profile import model_key
from hal.run_dirs import CACHE_ENV, cache_dir  # noqa: F401 - CACHE_ENV is read from here by tests


def profile_path(run: RunConfig) -> Path:
    """Where this host's profile for ``run``'s model, precision and sequence length is kept."""
    import torch

    seq = run.train.seq_len or run.model.max_seq_len
    key = {"model": model_key(run.model.to_dict()), "precision": run.hal.precision, "seq": seq,
           "cluster": run.hal.cluster, "host": platform.node(), "cores": os.cpu_count(), "machine": platform.machine(),
           "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{digest}.json"


def cached(run: RunConfig) -> Path | None:
    """This host's profile for ``run`` where one was made (``calibrate``), else None."""
    path = profile_path(run)
    return path if path.is_file() else None


def calibrate(run: RunConfig, progress: Callable[[str], None] | None = None) -> Path:
    """Profile the devices present for ``run`` (quick: a few points, one repeat, no link measurement; the rest of the
    cluster estimated) and keep it at ``profile_path``; its path."""
    from hal.launch import run_function
    from hal.parallel.planner.cluster import load_cluster
    from hal.parallel.planner.make_profile import fit_to_host, make_profile

    seq = run.train.seq_len or run.model.max_seq_len
    cluster = fit_to_host(load_cluster(run.hal.cluster, run.origin, None), run.model, seq, quick=True, progress=progress)
    compiled = [p.compile_backend for _, p in run.plans() if any(p.stage_compiles(k) for k in range(p.num_stages))]
    profile = make_profile(cluster, run.model, run.hal.precision, seq, quick=True, links=False, progress=progress,
                           fallback=run.hal.fallback, launch=run_function, compile_backend=compiled[0] if compiled else None)
    path = profile_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(str(path))
    return path


def made_on(path: Path) -> str:
    """When the cached profile was made (its file's time, UTC, to the minute)."""
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M UTC")


__all__ = ["CACHE_ENV", "cache_dir", "cached", "calibrate", "made_on", "profile_path"]
