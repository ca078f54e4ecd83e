"""Run an unmodified CUDA-written script on another backend (``hal run --backend X script.py``).

Modelled on Ascend's ``transfer_to_npu`` and Cambricon's ``gpu_migration``, which patch torch
once, globally and for good. This shim differs on purpose:

* **Scoped.** ``migrate(backend)`` patches on enter and restores every attribute on exit, even on
  error; a wrapper that leaks out (a module-level alias) is a pass-through once the scope ends.
* **Table-driven.** ``MAPPING`` (``mapping``) lists every patched target; the scope (``scope``)
  only interprets it with the adapters (``adapters``, ``adapters_runtime``) over the shared state
  (``session``); ``runner`` runs a script inside a scope, ``child`` enters it in spawned children.
* **Honest.** Where the target has no exact equivalent the shim warns once, at the script's line,
  saying what happens instead; what cannot run at all (CUDA graph capture) is refused in one line.
* **Never changes a dtype.** fp64 stays fp64 (no ``DoubleTensor -> FloatTensor``); CUDA autocast
  keeps CUDA's fp16 default on targets whose own default is bf16.
* **Only the script is translated.** torch's own modules keep seeing the real CUDA module (the
  ``is_cuda``/``is_available`` answers of the CUDA build), so torch never takes a CUDA-only path
  for a host tensor; libraries outside torch are translated like the script.

For a backend whose torch device type is already ``cuda`` (cuda, rocm) nothing differs: the
script's CUDA module is the backend's own, the CCL stays ``nccl`` (RCCL answers to that name) and
HIP honours ``CUDA_VISIBLE_DEVICES`` itself (renaming it would apply the mask twice). ``plan``
is then empty and ``migrate`` patches nothing.

The CUDA module is named only through strings ("cuda.synchronize") and ``getattr`` so that hal's
rule — no direct use of the CUDA module in hal/ — stays checkable by grep. While a scope is
active the patches are process-wide (module attributes), so every thread sees them.
"""
from __future__ import annotations

from hal.migration.mapping import MAPPING, CudaLocationMap, Kind, Patch, map_ccl, map_device, plan, rewrite_map_location
from hal.migration.runner import run_script
from hal.migration.scope import migrate
from hal.migration.session import MigrationUnsupported, MigrationWarning

__all__ = [
    "MAPPING",
    "CudaLocationMap",
    "Kind",
    "MigrationUnsupported",
    "MigrationWarning",
    "Patch",
    "map_ccl",
    "map_device",
    "migrate",
    "plan",
    "rewrite_map_location",
    "run_script",
]
