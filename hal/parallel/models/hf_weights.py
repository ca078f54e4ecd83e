"""``model: {hf: DIR, weights: true}``: a Hugging Face safetensors checkpoint read into this rank's stage, slice by slice.

Why slices: a rank owns only its stage's layers and, under TP, a shard of each; reading whole
tensors would put the full model through every rank's host memory. Each rank opens the files with
safetensors' lazy ``safe_open(...).get_slice(name)[...]`` and copies, piece by piece, only the rows
(column-parallel weights, the vocab-parallel embedding and head) or columns (row-parallel weights)
it owns straight into its parameters — the fused ``attn.qkv`` from its q, k and v row shards,
``mlp.gate_up`` from its gate and up shards (``parallel.models.hf_names``). safetensors maps the file: a
slice's pages are read as they are copied and stay resident while the slice lives, so reads go in
row blocks of at most ``CHUNK_BYTES`` of file, each through a fresh ``safe_open`` whose mapping is
gone before the next block: a rank's peak host memory is its own shard plus about one block,
whatever the size of the tensors it slices (measured: tests/ranks/test_hf_weights_ranks.py).

Checked before any rank starts (``parallel.state.hf_checks.check_weights``, in ``hal train``'s parent): the files exist (one
``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names), every header is
well-formed and agrees with its file's size (a truncated or corrupt shard), and the tensors are
exactly those this model is made of — none missing, none extra, each of the right shape and a
floating-point dtype. Each problem is one ConfigError line naming the tensor or file. The values are checked as
they load, block by block (a NaN or infinity anywhere is one line naming the tensor and rows): reading them
all in the parent first would read the checkpoint twice.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hal.errors import ConfigError
from hal.parallel.families.registry import family_of
from hal.parallel.models.hf_names import Piece, pieces
from hal.parallel.models.layers import param_meta
from hal.parallel.models.tp_comm import TPComm, tp_rank, tp_size

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header
MAX_INDEX_BYTES = 64 * 2**20  # an index names every tensor once: a few MiB for the largest models
CHUNK_BYTES = 16 * 2**20  # file bytes one read touches (see the module docstring)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # what a parameter is filled from (converted to its dtype)
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")  # a plain file name: never leaves the directory


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: its file, dtype and shape (from the file's header)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


# --- reading and checking the files (no safetensors needed) ---------------------------------------------


def read_header(file: Path, where: str) -> dict[str, Entry]:
    """The tensors a .safetensors file's header declares, checked against the file's size.

    The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}}, then the data; the tensors tile the data exactly.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"{where}: {file.name} is {size} bytes and does not start with a safetensors header "
                                  "that fits in it: truncated or not a safetensors file")
            raw = fh.read(length)
        header = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: {file.name} is unreadable ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"{where}: {file.name}'s safetensors header is not valid JSON: the file is corrupt") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: {file.name}'s safetensors header is not an object: the file is corrupt")
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(file, name, info, where)
        spans.append(tuple(info["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ConfigError(f"{where}: {file.name}'s header has tensor data that overlaps or leaves gaps: the file is corrupt")
        end = stop
    if 8 + length + end != size:
        raise ConfigError(f"{where}: {file.name} is {size} bytes but its header describes {8 + length + end}: "
                          f"{'truncated' if size < 8 + length + end else 'corrupt'}; fetch the file again")
    return entries


def _entry(file: Path, name: str, info: Any, where: str) -> Entry:
    bad = f"{where}: {file.name}'s header entry for {name!r}"
    if not isinstance(info, dict) or info.get("dtype") not in ITEMSIZE:
        raise ConfigError(f"{bad} has no known dtype: the file is corrupt")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ConfigError(f"{bad} has shape {shape!r}, not a list of sizes: the file is corrupt")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ConfigError(f"{bad} has data_offsets {offsets!r}: the file is corrupt")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEMSIZE[info["dtype"]]:
        raise ConfigError(f"{bad}: {offsets[1] - offsets[0]} bytes for shape {shape} of {info['dtype']}: the file is corrupt")
    return Entry(file, info["dtype"], tuple(shape))


def catalog(directory: str | os.PathLike[str], where: str) -> dict[str, Entry]:
    """Every tensor of the checkpoint in ``directory``: one model.safetensors, or the shards its index names."""
    root = Path(directory)
    if (root / INDEX).is_file():
        return _sharded(root, where)
    if (root / SINGLE).is_file():
        return read_header(root / SINGLE, where)
    other = " (only safetensors are read: convert pytorch_model.bin with transformers' save_pretrained)" \
        if any(root.glob("pytorch_model*.bin")) else ""
    raise ConfigError(f"{where}: {root} has neither {SINGLE} nor {INDEX}{other}")


def _sharded(root: Path, where: str) -> dict[str, Entry]:
    index = root / INDEX
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise ConfigError(f"{where}: {INDEX} is {index.stat().st_size} bytes, more than an index can be; the file is corrupt")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ConfigError(f"{where}: {INDEX} has no weight_map of tensor name to file name; the file is corrupt")
    files = sorted(set(weight_map.values()))
    for name in files:
        if not _SHARD_NAME.fullmatch(name):
            raise ConfigError(f"{where}: {INDEX} names the file {name!r}, not a plain .safetensors file name beside it")
        if not (root / name).is_file():
            raise ConfigError(f"{where}: {INDEX} names {name}, which is not in {root}; the download is incomplete")
    out: dict[str, Entry] = {}
    for name in files:
        header = read_header(root / name, where)
        for tensor in header:
            if weight_map.get(tensor) != name:
                raise ConfigError(f"{where}: {name} holds tensor {tensor}, which {INDEX} does not place there; the files disagree")
        out.update(header)
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ConfigError(f"{where}: {INDEX} places {missing[0]} in {weight_map[missing[0]]}, which does not hold it; "
                          "the files disagree")
    return out


# --- loading into a stage (each rank) ----------------------------------------------------------------------


@torch.no_grad()
def load_stage(stage: torch.nn.Module, directory: str | os.PathLike[str], tp_comm: TPComm) -> None:
    """Fill every parameter of ``stage`` with this rank's slices of the checkpoint in ``directory``."""
    entries = catalog(directory, f"weights {directory}")
    rank, size = tp_rank(tp_comm), tp_size(tp_comm)
    family = family_of(stage.config)
    ep_comm = getattr(stage, "ep_comm", None)
    for name, param in stage.named_parameters():
        meta = param_meta(param)
        if meta is None:
            raise TypeError(f"parameter {name} has no ParamMeta; build it with a parallel layer")
        split = meta.spec is not None and size > 1
        ats: dict[int | None, int] = {}  # per target (an expert's slice, or the parameter): where the next piece starts
        for piece in pieces(name, meta, family):
            at = ats.get(piece.index, 0)  # in the local parameter (its TP shard when split)
            count = piece.shape[piece.dim] // size if split else piece.shape[piece.dim]
            first = rank * count if split else 0
            if piece.index is None:
                target = param
            else:  # one expert of a stacked parameter; under expert parallelism only this rank's share of them
                first_expert = tp_rank(ep_comm) * param.shape[0] if meta.expert_split else 0
                if not first_expert <= piece.index < first_expert + param.shape[0]:
                    continue
                target = param[piece.index - first_expert]
            _read_into(target.narrow(piece.dim, at if split else piece.start, count), entries[piece.hf_name], piece,
                       first, first + count)
            ats[piece.index] = at + count


def _read_into(target: torch.Tensor, entry: Entry, piece: Piece, lo: int, hi: int) -> None:
    """``target`` ← the tensor's [lo, hi) along ``piece.dim``, in row blocks of at most CHUNK_BYTES of file."""
    from safetensors import safe_open

    shape = entry.shape
    if len(shape) not in (1, 2) or piece.dim >= len(shape):
        raise ValueError(f"{piece.hf_name}: shape {shape} split along dim {piece.dim} is not a vector or matrix slice")
    rows = range(lo, hi) if piece.dim == 0 else range(shape[0])
    row_bytes = ITEMSIZE[entry.dtype] * (shape[1] if len(shape) == 2 else 1)
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for start in range(rows.start, rows.stop, step):
        stop = min(start + step, rows.stop)
        with safe_open(str(entry.file), framework="pt") as f:  # a fresh map per block: its pages go with it
            block = _block(f.get_slice(piece.hf_name), piece.dim, start, stop, lo, hi)
            if not _finite(block):  # a damaged file would train to a NaN loss, steps later
                raise ConfigError(f"weights {entry.file.parent}: tensor {piece.hf_name} in {entry.file.name} holds NaN "
                                  f"or infinite values (rows {start}..{stop - 1}); the checkpoint is damaged")
            target.narrow(0, start - rows.start, stop - start).copy_(block)
            del block


FINITE_CHECK_ELEMENTS = 1 << 18  # isfinite's temporaries stay about a MiB, not a block's size


def _finite(block: torch.Tensor) -> bool:
    """Whether every value of ``block`` is finite, checked a slice at a time (the loader's memory bound holds)."""
    flat = block.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_CHECK_ELEMENTS]).all())
               for i in range(0, flat.numel(), FINITE_CHECK_ELEMENTS))


def _block(view: Any, dim: int, start: int, stop: int, lo: int, hi: int) -> torch.Tensor:
    return view[start:stop] if dim == 0 else view[start:stop, lo:hi]


__all__ = ["CHUNK_BYTES", "Entry", "FLOAT_DTYPES", "INDEX", "SINGLE", "catalog", "load_stage", "read_header"]
