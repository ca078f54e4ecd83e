"""The reference band: K runs of the reference backend, one per seed, summarised per step; cached on disk so one
band serves every candidate (``HAL_CACHE_DIR``/parity, keyed by the training, the seeds, the reference device, torch
and the hal code's tree hash)."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from hal.conformance.reports.provenance import revision
from hal.run_dirs import cache_dir, write_text_atomic

from . import stats
from .runs import Curve, ParityConfig, train_run

LOSS_FLOOR = 0.01  # the band is never narrower than ±1 % of the mean loss (Megatron's newer golden-value margin)
SIGMAS = 3.0


@dataclass
class Band:
    """The reference's curves and, per step, their mean and the band's half width max(1 % of |mean|, 3 σ)."""

    backend: str
    device: str
    seeds: list[int]
    curves: list[Curve]
    cached: bool = False

    def mean(self, step: int) -> float:
        return stats.mean([c.losses[step] for c in self.curves])

    def width(self, step: int) -> float:
        losses = [c.losses[step] for c in self.curves]
        return max(LOSS_FLOOR * abs(stats.mean(losses)), SIGMAS * stats.std(losses))

    def curve(self, seed: int) -> Curve | None:
        return next((c for c in self.curves if c.seed == seed), None)

    def to_dict(self) -> dict[str, Any]:
        steps = len(self.curves[0].losses)
        return {"backend": self.backend, "device": self.device, "seeds": self.seeds, "cached": self.cached,
                "mean": [self.mean(t) for t in range(steps)], "width": [self.width(t) for t in range(steps)],
                "curves": [{"seed": c.seed, "losses": c.losses, "grad_norms": c.grad_norms} for c in self.curves]}


def _code() -> dict[str, Any]:
    """The code a band was trained with: git's hash of the ``hal`` tree at HEAD and of its uncommitted changes (a band
    survives a commit that touches only docs or tests), else the installed version."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return {"hal_version": revision().get("hal_version")}
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, timeout=30).stdout  # noqa: E731
    return {"hal_tree": git("rev-parse", "HEAD:hal").decode().strip(),
            "changes": hashlib.sha256(git("diff", "HEAD", "--no-ext-diff", "--", "hal")).hexdigest()[:16]}


def _key(config: ParityConfig, seeds: Sequence[int], backend: Any) -> str:
    key = {"config": config.key(), "seeds": list(seeds), "backend": backend.name, "device": backend.device_name(0),
           "torch": torch.__version__, "code": _code()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(config: ParityConfig, seeds: Sequence[int], backend: Any) -> Path:
    return cache_dir() / "parity" / f"band-{_key(config, seeds, backend)}.json"


def reference_band(config: ParityConfig, seeds: Sequence[int], backend: Any, *, use_cache: bool = True,
                   progress: Callable[[str, int, int], None] | None = None) -> Band:
    """The band of ``seeds`` on ``backend`` (device 0): read from the cache where an identical one was made, else
    trained and cached. The key holds the ``hal`` code's tree hash and a hash of its uncommitted changes."""
    path = cache_path(config, seeds, backend)
    if use_cache and path.is_file():
        try:
            raw = json.loads(path.read_text())
            curves = [Curve(int(c["seed"]), [float(x) for x in c["losses"]], [float(x) for x in c["grad_norms"]])
                      for c in raw["curves"]]
            if [c.seed for c in curves] == list(seeds) and all(len(c.losses) == config.steps for c in curves):
                return Band(backend.name, backend.device_name(0), list(seeds), curves, cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is remade
    device = backend.device(0)
    curves = []
    for i, seed in enumerate(seeds):
        curves.append(train_run(config, seed, backend, device,
                                on_step=(lambda t, i=i: progress(f"reference seed {seeds[i]}", t, config.steps)) if progress else None))
    band = Band(backend.name, backend.device_name(0), list(seeds), curves)
    if use_cache and all(math.isfinite(x) for c in curves for x in c.losses):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"curves": [{"seed": c.seed, "losses": c.losses, "grad_norms": c.grad_norms}
                                                       for c in curves]}))
    return band
