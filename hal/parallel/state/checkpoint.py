"""Device-agnostic training checkpoints: full tensors by global name, loadable into any plan.

A checkpoint does not depend on the plan, the TP/DP split or the devices that wrote it:

    CHECKPOINT_DIR/
      latest                 the name of the newest complete checkpoint ("step-000020")
      step-000020/
        meta.json            format, step, the model / plan / train settings it was made with,
                             the data position, the optimizer's hyperparameters, its files and
                             each file's sha256 (checked before anything is loaded)
        stage-0.pt           {"params": {name: full tensor}, "optimizer": {name: {"exp_avg": full, ...}}}
        stage-1.pt           ... one file per pipeline stage of the plan that wrote it
        rng.pt               the host RNG state

Parameters are stored unsharded under their global names (``parallel.models.stage``: ``layers.3.mlp.down.weight``),
AdamW's per-element state (``exp_avg``, ``exp_avg_sq``) in the same full shapes, all on the CPU.
Inside a stage the rank's mesh gathers the shards (``Mesh.gather_full``: TP, then expert shards); dp replicas
are identical, so one rank per stage (dp 0, tp 0) writes. Loading cuts each full tensor back to this run's shard
(``Mesh.shard``, with the model's own ``ShardSpec``), so any plan with the same model resumes.

Atomicity: files go to ``.tmp-step-N/`` (each written and fsynced, then renamed), and rank 0 renames the
directory to ``step-N`` only after every writer is done, then points ``latest`` at it (temp file +
rename). A crash leaves either the old checkpoint or the new one, never a half-written one; a stale
``.tmp-*`` directory is ignored and cleared by the next save. The directory must be visible to every
writer (a shared filesystem when stages run on several nodes).

Resuming: ``hal train --resume`` checks everything in the parent before any rank starts — meta.json's
fields, every file against its checksum, and the stage files' structure, parameter names, full shapes
(the model built on the meta device) and finite values, and the RNG state — so a damaged checkpoint is
one line and exit 2, never a rank's traceback or training from corrupted weights. Files load with
``weights_only=True``: no pickled code runs.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.models.layers import param_meta
from hal.run_dirs import write_text_atomic

FORMAT = "hetero-hal-checkpoint/1"
META = "meta.json"
LATEST = "latest"
WRITING = ".tmp-"  # a step being written: renamed to step-N when complete
REPLACED = ".old-"  # the previous copy of a step being replaced, until the new one is in place
# nothing else, so a name can never leave the directory (replica-R-stage-K.pt: a local-SGD replica's inner optimizer)
FILE_NAME = re.compile(r"(replica-\d{1,2}-)?stage-\d{1,4}\.pt|rng\.pt|fp8-residuals-rank-\d{1,6}\.pt")
CHUNK = 8 * 2**20


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


# --- finding and checking a checkpoint (no torch.distributed needed) ------------------------------------


def resolve(path: str | os.PathLike[str], flag: str = "--resume") -> Path:
    """A checkpoint directory (with meta.json), or a checkpoint_dir whose ``latest`` names one."""
    p = Path(path)
    if (p / META).is_file():
        return p
    if (p / LATEST).is_file():
        name = (p / LATEST).read_text(encoding="utf-8").strip()
        if (p / name / META).is_file():
            return p / name
        raise ConfigError(f"{flag} {path}: 'latest' names {name!r}, which is not a complete checkpoint; pass a step-N directory")
    if not p.exists():
        raise ConfigError(f"{flag} {path}: no such directory; pass a checkpoint directory (step-N) or a checkpoint_dir")
    raise ConfigError(f"{flag} {path}: not a checkpoint (no {META}) and no '{LATEST}' file; pass a step-N directory or a checkpoint_dir")


def tidy(root: Path | None) -> list[str]:
    """Undo what a stop in the middle of a write left in the checkpoint folder ``root``; one line per thing done.

    A ``.tmp-step-N`` folder is a write cut short (removed: the last complete checkpoint stands). A ``.old-step-N`` is
    the previous copy of a step being replaced: put back where the new one never arrived, else removed."""
    if root is None or not root.is_dir():
        return []
    done = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.startswith(WRITING):
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry}, a checkpoint write that was cut short")
        elif entry.name.startswith(REPLACED):
            final = root / entry.name.removeprefix(REPLACED)
            if final.exists():
                shutil.rmtree(entry, ignore_errors=True)
                done.append(f"removed {entry}, the copy {final.name} replaced")
            else:
                entry.rename(final)
                done.append(f"put {final} back: its replacement was cut short")
    return done


def latest_written(root: Path | None) -> Path | None:
    """The checkpoint ``root``'s ``latest`` file names, or None where no checkpoint was completed there."""
    if root is None or not (root / LATEST).is_file():
        return None
    step = root / (root / LATEST).read_text(encoding="utf-8").strip()
    return step if (step / META).is_file() else None


def read_meta(checkpoint: Path, flag: str = "--resume") -> dict[str, Any]:
    """meta.json, its structure checked: one ConfigError line naming the bad field, never a traceback."""
    try:
        meta = json.loads((checkpoint / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {checkpoint}: {META} is unreadable ({exc}); the checkpoint is damaged") from None
    damaged = f"{flag} {checkpoint}: {META}"
    if not isinstance(meta, dict):
        raise ConfigError(f"{damaged} holds a {type(meta).__name__}, not an object; the checkpoint is damaged")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{flag} {checkpoint}: format {meta.get('format')!r} is not {FORMAT!r}; it was not written by hal train")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{damaged}: step {step!r} is not a step count (an integer >= 0); the checkpoint is damaged")
    if not isinstance(meta.get("model"), dict):
        raise ConfigError(f"{damaged} has no model section; the checkpoint is damaged")
    files = meta.get("files")
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and FILE_NAME.fullmatch(f) for f in files):
        raise ConfigError(f"{damaged}: files {files!r} is not a list of stage-K.pt, replica-R-stage-K.pt, "
                          "fp8-residuals-rank-N.pt and rng.pt names; the checkpoint is damaged")
    if "rng.pt" not in files or not any(f.startswith("stage-") for f in files):
        raise ConfigError(f"{damaged}: files {files!r} lacks rng.pt or a stage file; the checkpoint is damaged")
    checksums = meta.get("checksums")
    if checksums is not None and (not isinstance(checksums, dict) or set(checksums) != set(files)
                                  or not all(isinstance(v, str) for v in checksums.values())):
        raise ConfigError(f"{damaged}: checksums do not name exactly its files; the checkpoint is damaged")
    return meta


def check_compatible(meta: Mapping[str, Any], checkpoint: Path, model: ModelConfig, steps: int) -> None:
    """Same model (every size and option), and steps left to train; one ConfigError line otherwise."""
    saved = meta["model"]
    mine, defaults = model.to_dict(), ModelConfig().to_dict()
    for key in mine:  # a key an older hal did not write has its default (e.g. qkv_bias: false)
        if saved.get(key, defaults[key]) != mine[key]:
            raise ConfigError(
                f"--resume {checkpoint}: the checkpoint's model.{key} is {saved.get(key)!r} but this config's is "
                f"{mine[key]!r}; resume with the model it was made with (any plan works)"
            )
    missing = [name for name in meta["files"] if not (checkpoint / name).is_file()]
    if missing:
        raise ConfigError(f"--resume {checkpoint}: file(s) {', '.join(missing)} missing; the checkpoint is incomplete")
    if meta["step"] >= steps:
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint is at step {meta['step']} and the run stops at step {steps}; "
            f"nothing to train — raise --steps above {meta['step']}"
        )
    verify_checksums(checkpoint, meta)
    verify_tensors(checkpoint, meta, model)


def file_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint whose bytes cannot be verified (hal's command line shows it as one 'hal: warning:' line)."""


def verify_checksums(checkpoint: Path, meta: Mapping[str, Any], flag: str = "--resume") -> None:
    """Every file's bytes against the checksum recorded at save time: flipped bytes are refused, not trained on."""
    checksums = meta.get("checksums")
    if checksums is None:  # written before checksums existed: said, not silently trusted
        warnings.warn(f"{flag} {checkpoint}: the checkpoint records no checksums (an older hal wrote it); its bytes "
                      "are not verified, only its structure and values", UnverifiedCheckpointWarning, stacklevel=2)
        return
    for name in meta["files"]:
        if file_checksum(checkpoint / name) != checksums[name]:
            raise ConfigError(f"{flag} {checkpoint}: {name} does not match its checksum in {META}; the checkpoint is "
                              "damaged — resume from another one")


def _expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, from the model built on the meta device (no memory, no init)."""
    from hal.parallel.models.stage import full_model

    with torch.device("meta"):
        module = full_model(model, 0)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def verify_tensors(checkpoint: Path, meta: Mapping[str, Any], model: ModelConfig, flag: str = "--resume") -> None:
    """The stage files' structure, names, shapes and values, before any rank loads them: one line each."""
    expected = _expected_shapes(model)
    seen: set[str] = set()
    for name in meta["files"]:
        blob = _load_file(checkpoint / name, flag)
        where = f"{flag} {checkpoint}: {name}"
        if name == "rng.pt":
            state = blob.get("torch_cpu") if isinstance(blob, dict) else None
            if not (torch.is_tensor(state) and state.dtype == torch.uint8 and state.dim() == 1):
                raise ConfigError(f"{where} does not hold the host RNG state; the checkpoint is damaged")
            continue
        if name.startswith("fp8-residuals-"):
            _verify_wire_file(blob, where, expected)
            continue
        inner = name.startswith("replica-")  # a local-SGD replica's own inner optimizer state: no parameters
        if not (isinstance(blob, dict) and isinstance(blob.get("optimizer"), dict)
                and (inner or isinstance(blob.get("params"), dict))):
            shape = "{'optimizer': ...}" if inner else "{'params': ..., 'optimizer': ...}"
            raise ConfigError(f"{where} is not a stage file ({shape}); the checkpoint is damaged")
        for pname, tensor in blob.get("params", {}).items():
            if pname not in expected:
                raise ConfigError(f"{where}: parameter {pname!r} is not in this model; the checkpoint is from another model")
            _verify_full_tensor(tensor, f"{where}: parameter {pname}", expected[pname], "resume from an earlier checkpoint")
            seen.add(pname)
        momentum = blob.get("outer_momentum", {})
        if not isinstance(momentum, dict):
            raise ConfigError(f"{where}: its local SGD outer momentum is not a dict of tensors; the checkpoint is damaged")
        for pname, tensor in momentum.items():
            if pname not in expected:
                raise ConfigError(f"{where}: outer momentum for {pname!r}, a parameter not in this model; the checkpoint "
                                  "is damaged or from another model")
            _verify_full_tensor(tensor, f"{where}: the outer momentum of {pname}", expected[pname], "the checkpoint is damaged")
        for pname, state in blob["optimizer"].items():
            if not isinstance(state, dict) or not all(torch.is_tensor(v) or isinstance(v, (int, float)) for v in state.values()):
                raise ConfigError(f"{where}: optimizer state of {pname!r} is malformed; the checkpoint is damaged")
            if any(not math.isfinite(v) if isinstance(v, float) else not bool(torch.isfinite(v).all())
                   for v in state.values() if isinstance(v, float) or (torch.is_tensor(v) and v.is_floating_point())):
                raise ConfigError(f"{where}: optimizer state of {pname} holds NaN or inf; resume from an earlier checkpoint")
            if pname not in expected:
                raise ConfigError(f"{where}: optimizer state of {pname!r}, a parameter not in this model; the checkpoint "
                                  "is damaged or from another model")
            for key, value in state.items():  # per-element entries (exp_avg, exp_avg_sq) have their parameter's shape
                if _per_element(value) and tuple(value.shape) != expected[pname]:
                    raise ConfigError(f"{where}: optimizer state {pname}.{key} has shape {tuple(value.shape)}, its "
                                      f"parameter {expected[pname]}; the checkpoint is damaged")
                if torch.is_tensor(value) and not (value.is_floating_point() or (value.dim() == 0 and not value.is_complex())):
                    raise ConfigError(f"{where}: optimizer state {pname}.{key} is {value.dtype}, not floating point; the "
                                      "checkpoint is damaged")
    missing = sorted(set(expected) - seen)
    if missing:
        raise ConfigError(f"{flag} {checkpoint}: parameter {missing[0]} (and {len(missing) - 1} more) is missing; "
                          "the checkpoint is damaged or from another model")


def _verify_full_tensor(tensor: Any, what: str, shape: tuple[int, ...], fix: str) -> None:
    """A full tensor of a parameter's shape, floating point and finite — or one line naming ``what`` is wrong."""
    if not torch.is_tensor(tensor) or tuple(tensor.shape) != shape:
        got = tuple(tensor.shape) if torch.is_tensor(tensor) else type(tensor).__name__
        raise ConfigError(f"{what} has shape {got}, this model needs {shape}; the checkpoint is damaged or from another model")
    if not tensor.is_floating_point():
        raise ConfigError(f"{what} is {tensor.dtype}, not floating point; the checkpoint is damaged")
    if not bool(torch.isfinite(tensor).all()):
        raise ConfigError(f"{what} holds NaN or inf; {fix}")


def _verify_wire_file(blob: Any, where: str, expected: Mapping[str, tuple[int, ...]]) -> None:
    """An fp8 wire residual file: its replica, and for parameters of this model one finite float32 value each."""
    replica = blob.get("replica") if isinstance(blob, dict) else None
    residuals = blob.get("residuals") if isinstance(blob, dict) else None
    if isinstance(replica, bool) or not isinstance(replica, int) or replica < 0 or not isinstance(residuals, dict):
        raise ConfigError(f"{where} is not an fp8 residual file ({{'replica': R, 'residuals': ...}}); the checkpoint is damaged")
    for pname, tensor in residuals.items():
        if pname not in expected:
            raise ConfigError(f"{where}: a residual for {pname!r}, a parameter not in this model; the checkpoint is "
                              "damaged or from another model")
        if not torch.is_tensor(tensor) or tensor.dtype != torch.float32 or tensor.numel() != math.prod(expected[pname]):
            raise ConfigError(f"{where}: the residual of {pname} is not {math.prod(expected[pname])} float32 values; "
                              "the checkpoint is damaged")
        if not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"{where}: the residual of {pname} holds NaN or inf; the checkpoint is damaged")


# --- saving (collective over the world) -----------------------------------------------------------------------


def _optimizer_state_by_name(module: torch.nn.Module, optimizer: Any) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state keyed by global name (a collective over dp under ZeRO-1)."""
    names = _state_order(module, optimizer)
    state = optimizer.state_dict()["state"]
    return {names[int(i)]: dict(s) for i, s in state.items()}


def _state_order(module: torch.nn.Module, optimizer: Any) -> list[str]:
    """The parameter names in the order the optimizer's state_dict numbers them: its groups' order.

    ZeRO-1 (``parallel.loop.zero``) numbers them in the module's order whatever its inner groups; a plain
    optimizer with several groups (decayed / not decayed) numbers group after group.
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = getattr(optimizer, "param_groups", None)
    if getattr(optimizer, "sharded", None) is not None or not groups:
        return [n for n, _ in named]
    by_id = {id(p): n for n, p in named}
    order = [by_id[id(p)] for g in groups for p in g["params"] if id(p) in by_id]
    return order if len(order) == len(named) else [n for n, _ in named]


def _full_optimizer_state(module: torch.nn.Module, mesh: Any, by_name: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-element entries gathered to full shape over TP like their parameters; scalars (step) as they are."""
    keys = sorted({k for s in by_name.values() for k, v in s.items() if _per_element(v)})
    full: dict[str, dict[str, Any]] = {n: {k: _cpu(v) for k, v in s.items() if not _per_element(v)} for n, s in by_name.items()}
    for key in keys:  # one gather per parameter and key, the same order on every TP rank
        gathered = mesh.gather_full(module, {n: s[key] for n, s in by_name.items() if key in s})
        for name, tensor in gathered.items():
            full[name][key] = _cpu(tensor)
    return full


def _per_element(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu").clone() if torch.is_tensor(value) else value


def _save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str | os.PathLike[str], step: int, engine: Any, optimizer: Any, meta: dict[str, Any], *,
                    write: bool = True, outer_momentum: Mapping[str, torch.Tensor] | None = None,
                    inner_file: str | None = None, inner_files: Sequence[str] = (),
                    wire: tuple[str, int, Mapping[str, torch.Tensor]] | None = None, wire_files: Sequence[str] = ()) -> Path:
    """Write ``root/step-N`` from every rank's part; returns its path. Every rank of the world calls it.

    ``write`` False: this rank only takes part in the barriers (another replica, holding the same weights, writes;
    global rank 0 must write).

    ``meta`` carries what the caller knows about the run (model, plan, train, data position); this adds
    the format, step, files and the optimizer's hyperparameters. ``outer_momentum``: local SGD's outer momentum
    (this rank's shards, by parameter name), kept in full beside the weights (``read_outer_momentum``).
    ``inner_file`` (local SGD, a replica that does not ``write``): its stage's own optimizer state goes to this file
    (replicas step their inner optimizers on their own gradients); ``inner_files``: all such files (rank 0 lists them).
    ``wire`` (a speaker of the fp8 wire): (file, its replica, what its sends rounded away by parameter name), kept so a
    resumed run carries the same error feedback (``read_wire_residuals``); ``wire_files``: every speaker's file.
    """
    root = Path(root)
    coord = engine.coord
    tmp = root / f"{WRITING}{step_dirname(step)}"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    by_name = _optimizer_state_by_name(engine.module, optimizer)  # every rank: collective under ZeRO-1
    mesh = engine.mesh
    if write and coord.dp < mesh.layout.ep:  # one replica per stage gathers over its TP group (its first ep group: the experts)
        params = {n: _cpu(t) for n, t in mesh.gather_full(engine.module, dict(engine.module.named_parameters())).items()}
        state = _full_optimizer_state(engine.module, mesh, by_name)
        blob: dict[str, Any] = {"params": params, "optimizer": state}
        if outer_momentum is not None:
            blob["outer_momentum"] = {n: _cpu(t) for n, t in mesh.gather_full(engine.module, dict(outer_momentum)).items()}
        if coord.tp == 0 and coord.dp == 0:
            _save_atomic(blob, tmp / f"stage-{coord.stage}.pt")
    elif inner_file is not None and coord.dp < mesh.layout.ep:  # this replica's own inner optimizer state
        state = _full_optimizer_state(engine.module, mesh, by_name)
        if coord.tp == 0 and coord.dp == 0:
            _save_atomic({"optimizer": state}, tmp / inner_file)
    if wire is not None:
        file, replica, residuals = wire
        _save_atomic({"replica": replica, "residuals": {n: _cpu(t) for n, t in residuals.items()}}, tmp / file)
    if dist.get_rank() == 0:
        _save_atomic({"torch_cpu": torch.get_rng_state()}, tmp / "rng.pt")
    dist.barrier()
    final = root / step_dirname(step)
    if dist.get_rank() == 0:
        group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        full_meta = {
            "format": FORMAT, "step": step, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "torch": torch.__version__, **meta,
            "optimizer": {"type": "AdamW", "zero1": bool(meta.get("plan", {}).get("zero1")), "hyperparameters": _jsonable(group)},
            "files": ([f"stage-{k}.pt" for k in range(engine.mesh.topology.num_stages)] + ["rng.pt"] + list(inner_files)
                      + list(wire_files)),
        }
        full_meta["checksums"] = {name: file_checksum(tmp / name) for name in full_meta["files"]}
        write_text_atomic(tmp / META, json.dumps(full_meta, indent=2))
        _commit(tmp, final, root)
    return final


def _commit(tmp: Path, final: Path, root: Path) -> None:
    """Make ``tmp`` the checkpoint ``final`` (replacing an older one of that name) and point ``latest`` at it."""
    old = root / f"{REPLACED}{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    write_text_atomic(root / LATEST, final.name + "\n")


def _jsonable(group: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in group.items():
        if isinstance(value, (bool, int, float, str)) or value is None:
            out[key] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
            out[key] = list(value)
        elif torch.is_tensor(value) and value.numel() == 1:
            out[key] = value.item()
    return out


# --- loading into this run's split ----------------------------------------------------------------------------


def _load_file(path: Path, flag: str = "--resume") -> Any:
    """``torch.load`` of one checkpoint file (memory-mapped, tensors only); a damaged file is one line."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        why = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{flag} {path.parent}: {path.name} is unreadable ({type(exc).__name__}: {why}); the checkpoint is damaged") from None


def read_tensors(checkpoint: Path, meta: Mapping[str, Any], flag: str = "--resume") -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every stage file's params and optimizer state, merged by global name (memory-mapped, read lazily)."""
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for name in meta["files"]:
        if not name.startswith("stage-"):
            continue
        blob = _load_file(checkpoint / name, flag)
        params.update(blob["params"])
        state.update(blob["optimizer"])
    return params, state


def read_outer_momentum(checkpoint: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """Local SGD's outer momentum kept with the weights (full tensors by name), or None where the run had none."""
    out: dict[str, torch.Tensor] = {}
    for name in meta["files"]:
        if name.startswith("stage-"):
            out.update(_load_file(checkpoint / name).get("outer_momentum", {}))
    return out or None


def read_wire_residuals(checkpoint: Path, meta: Mapping[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """The fp8 wire's residuals a checkpoint keeps, by replica then parameter name (empty where the run had none)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name in meta["files"]:
        if name.startswith("fp8-residuals-"):
            blob = _load_file(checkpoint / name)
            out.setdefault(int(blob["replica"]), {}).update(blob["residuals"])
    return out


@torch.no_grad()
def _load_params(module: torch.nn.Module, mesh: Any, params: Mapping[str, torch.Tensor], checkpoint: Path) -> None:
    """Each parameter filled with this rank's shard of its full tensor: the mesh says which (``Mesh.shard``)."""
    for name, param in module.named_parameters():
        pmeta = param_meta(param)
        if name not in params:
            raise ConfigError(f"--resume {checkpoint}: parameter {name} is missing from the checkpoint; it is damaged or from another model")
        full = params[name]
        if pmeta is None or tuple(full.shape) != tuple(pmeta.full_shape):
            want = None if pmeta is None else tuple(pmeta.full_shape)
            raise ConfigError(f"--resume {checkpoint}: parameter {name} has shape {tuple(full.shape)}, this model needs {want}")
        param.copy_(mesh.shard(full, param).to(device=param.device, dtype=param.dtype))


def _load_optimizer(module: torch.nn.Module, mesh: Any, optimizer: Any, state: Mapping[str, dict[str, Any]]) -> None:
    """Cut every full per-element state to this rank's shard; the optimizer (or ZeRO-1) takes it from there."""
    params = dict((n, p) for n, p in module.named_parameters() if p.requires_grad)
    order = _state_order(module, optimizer)
    local: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(order):
        if name not in state:
            continue
        local[i] = {k: (mesh.shard(v, params[name]) if _per_element(v) else v)
                    for k, v in state[name].items()}
        local[i] = {k: v.clone() if torch.is_tensor(v) else v for k, v in local[i].items()}  # off the memory map
    if getattr(optimizer, "sharded", None) is not None:  # ZeRO-1: one group in the module's order
        group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        optimizer.load_state_dict({"state": local, "param_groups": [{**group, "params": list(range(len(order)))}]})
        return
    groups, at = [], 0
    for g in optimizer.param_groups:  # the groups as this run made them, numbered as state_dict numbers them
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(at, at + len(g["params"])))})
        at += len(g["params"])
    optimizer.load_state_dict({"state": local, "param_groups": groups})


def inner_file_name(replica: int, stage: int) -> str:
    """The file of a local-SGD replica's own inner optimizer state for one of its stages (replica 0's is the stage file)."""
    return f"replica-{replica}-stage-{stage}.pt"


def inner_replicas(meta: Mapping[str, Any]) -> list[int]:
    """The replicas whose own inner optimizer state a (local SGD) checkpoint keeps beside replica 0's stage files."""
    return sorted({int(name.split("-")[1]) for name in meta["files"] if name.startswith("replica-")})


def load_checkpoint(checkpoint: Path, engine: Any, optimizer: Any, replica: int = 0) -> dict[str, Any]:
    """Load ``checkpoint`` into this rank's stage and optimizer; returns its meta. Collective under ZeRO-1.

    ``replica``: the replica whose optimizer state this rank takes (``ReplicaSet.optimizer_source``: its own under local
    SGD, else 0); where the checkpoint keeps that replica's own inner state, the optimizer takes it instead of replica
    0's."""
    meta = read_meta(checkpoint)
    params, state = read_tensors(checkpoint, meta)
    if replica > 0:
        own: dict[str, dict[str, Any]] = {}
        for name in meta["files"]:
            if name.startswith(f"replica-{replica}-stage-"):
                own.update(_load_file(checkpoint / name)["optimizer"])
        state = own or state
    _load_params(engine.module, engine.mesh, params, checkpoint)
    _load_optimizer(engine.module, engine.mesh, optimizer, state)
    rng = _load_file(checkpoint / "rng.pt")
    torch.set_rng_state(rng["torch_cpu"])
    return meta


__all__ = ["FORMAT", "check_compatible", "file_checksum", "inner_file_name", "inner_replicas", "load_checkpoint", "read_meta", "read_outer_momentum",
           "read_tensors", "read_wire_residuals",
           "resolve", "save_checkpoint",
           "step_dirname", "verify_checksums", "verify_tensors"]
