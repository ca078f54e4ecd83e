"""``hal export CHECKPOINT --to hf OUT_DIR``: a training checkpoint as a Hugging Face model directory.

What is written — what ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` reads:

    config.json                              its family's model_type (``parallel.families``: llama, qwen2, mixtral, qwen2_moe,
                                             qwen3, gpt_neox), the sizes, rope theta and Llama 3 scaling,
                                             tie_word_embeddings, torch_dtype
    model-00001-of-0000N.safetensors ...     the tensors under Hugging Face's names (``parallel.models.hf_names``),
                                             fused qkv / gate_up split back into q, k, v / gate, up
    model.safetensors.index.json             tensor name → shard, and the total size
    tokenizer.json (+ tokenizer_config.json, special_tokens_map.json beside it)   when one is known

A checkpoint is plan-independent (full tensors by global name), so any plan's exports the same.
Before anything is written the checkpoint is checked as ``--resume`` checks it (meta.json, every
file's checksum, names, shapes, finite values). Memory: the stage files are memory-mapped and one
shard's tensors are in memory at a time. Atomic: everything goes to a temporary directory beside
OUT_DIR, renamed into place only when complete; an existing non-empty OUT_DIR is refused unless
``force``, and then replaced only after the new one is complete. The tensors are written in the
checkpoint's dtype (fp32). ``max_position_embeddings`` is the sequence length the model was trained
with (``model.max_seq_len``).

The tokenizer: ``--tokenizer PATH`` (a tokenizer.json, or a directory holding one), else the
Hugging Face directory the run started from (``init_from`` in the checkpoint's meta) when it holds
one; nothing else records a tokenizer's path. When the run trained on a token file whose index
records its tokenizer's sha256 (``hal data prepare``), a tokenizer.json with another checksum is
refused: it would decode the model's ids into the wrong text. It must also parse (the ``tokenizers`` library
reads it) and produce no id at or above the model's ``vocab_size``; the JSON files copied beside it must be
JSON objects. Any of these is one line before anything is written.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from hal.errors import ConfigError, HalError
from hal.parallel.config.model import ModelConfig
from hal.parallel.families.registry import family_of
from hal.parallel.state.hf_checks import model_pieces
from hal.run_dirs import check_creatable_dir

FLAG = "hal export"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Source:
    """A checked checkpoint: where it is, its meta, model and full tensors by hal name (memory-mapped)."""

    path: Path
    meta: Mapping[str, Any]
    model: ModelConfig
    params: Mapping[str, torch.Tensor]


def open_checkpoint(path: str | os.PathLike[str]) -> Source:
    """Resolve ``path`` as ``--resume`` does and check it as thoroughly; one ConfigError line otherwise."""
    from hal.parallel.state.checkpoint import read_meta, read_tensors, resolve, verify_checksums, verify_tensors

    checkpoint = resolve(path, FLAG)
    meta = read_meta(checkpoint, FLAG)
    # through the config schema, as a model: section is read: a damaged value (a misspelt scoring, a NaN) is one line
    model = ModelConfig.from_mapping(meta["model"], f"{FLAG} {checkpoint}: meta.json")
    missing = [name for name in meta["files"] if not (checkpoint / name).is_file()]
    if missing:
        raise ConfigError(f"{FLAG} {checkpoint}: file(s) {', '.join(missing)} missing; the checkpoint is incomplete")
    verify_checksums(checkpoint, meta, FLAG)
    verify_tensors(checkpoint, meta, model, FLAG)
    params, _ = read_tensors(checkpoint, meta, FLAG)
    return Source(checkpoint, meta, model, params)


def hf_config(model: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for ``model`` in its family's keys (``families.registry.family_of``: Llama's, or Qwen2's when
    the q, k, v projections have a bias; an MoE model as Mixtral, or Qwen2-MoE with the bias; Qwen3's and
    GPT-NeoX's for their blocks), written by the family (``Family.export_config``)."""
    return family_of(model).export_config(model, DTYPE_NAMES[dtype], FLAG)


def hf_tensors(source: Source) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, view of the checkpoint's tensor) in the model's order; fused parameters split."""
    out = []
    for name, parts in model_pieces(source.model).items():
        full = source.params[name]
        out.extend((p.hf_name, (full if p.index is None else full[p.index]).narrow(p.dim, p.start, p.shape[p.dim]))
                   for p in parts)
    return out


def plan_shards(tensors: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors packed into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def tokenizer_files(given: str | None, source: Source) -> list[Path]:
    """The tokenizer files to copy (none when nothing names one), checked against the token file's record."""
    if given is not None:
        path = Path(given).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"{FLAG}: --tokenizer {given}: no tokenizer.json there; give a Hugging Face tokenizer.json "
                              "or the directory holding it")
    else:
        origin = source.meta.get("init_from")
        file = Path(origin) / "tokenizer.json" if isinstance(origin, str) else None
        if file is None or not file.is_file():
            return []
    _check_tokenizer(file, source.model)
    _check_against_token_file(file, source)
    beside = [file.parent / n for n in TOKENIZER_FILES[1:] if (file.parent / n).is_file()]
    for extra in beside:
        _check_json_object(extra)
    return [file] + beside


def _check_tokenizer(file: Path, model: ModelConfig) -> None:
    """It is a tokenizer.json (the ``tokenizers`` library parses it) and every id it produces is a row of the
    model's embedding."""
    from hal.parallel.data.tokenizer_file import highest_id, load_tokenizer, token_count

    tokenizer = load_tokenizer(file, f"{FLAG}: tokenizer {file}", needed_by=f"{FLAG} (checking the tokenizer it ships)")
    top = highest_id(tokenizer)
    if top >= model.vocab_size:
        raise ConfigError(f"{FLAG}: tokenizer {file} has {token_count(tokenizer)} tokens (ids up to {top}) but the "
                          f"model's vocabulary has {model.vocab_size} rows; give the tokenizer the model was trained "
                          "with (its ids must be below vocab_size)")


def _check_json_object(file: Path) -> None:
    """A tokenizer_config.json or special_tokens_map.json that transformers will read: a JSON object."""
    from hal.parallel.data.tokenizer_file import MAX_TOKENIZER_BYTES
    from hal.run_dirs import read_limited

    raw = read_limited(file, MAX_TOKENIZER_BYTES, f"{FLAG}: {file}", "give the tokenizer's own file or remove it")
    try:
        ok = isinstance(json.loads(raw.decode("utf-8")), dict)
    except (ValueError, UnicodeDecodeError, RecursionError):
        ok = False
    if not ok:
        raise ConfigError(f"{FLAG}: {file} (copied beside the tokenizer) is not a JSON object; fix or remove it")


def _check_against_token_file(file: Path, source: Source) -> None:
    data = source.meta.get("data", {}).get("source") if isinstance(source.meta.get("data"), dict) else None
    if not (isinstance(data, str) and data.endswith(".bin")):
        return
    index = Path(data[: -len(".bin")] + ".idx.json")
    try:
        recorded = json.loads(index.read_text(encoding="utf-8")).get("tokenizer_sha256")
    except (OSError, ValueError, AttributeError):
        return  # a plain .bin without an index records no tokenizer
    mine = hashlib.sha256(file.read_bytes()).hexdigest()
    if isinstance(recorded, str) and recorded.split(":")[-1] != mine:
        raise ConfigError(f"{FLAG}: {file} is not the tokenizer the training data was prepared with ({index} records sha256 "
                          f"{recorded.split(':')[-1][:12]}..., this file's is {mine[:12]}...); give that tokenizer.json")


def check_out_dir(out_dir: Path, source: Source, force: bool) -> None:
    """OUT_DIR can be written: absent, empty, or (with ``force``) replaceable — never the checkpoint itself."""
    target, checkpoint = out_dir.resolve(), source.path.resolve()
    if target == checkpoint or target in checkpoint.parents:
        raise ConfigError(f"{FLAG}: OUT_DIR {out_dir} holds the checkpoint being exported; give another directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{FLAG}: OUT_DIR {out_dir} exists and is not a directory; give a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"{FLAG}: OUT_DIR {out_dir} exists and is not empty; pass --force to replace it, or give another directory")
    check_creatable_dir(out_dir.parent, f"{FLAG}: OUT_DIR's parent")


def export_hf(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, max_shard_bytes: int = 2048 * 2**20,
              tokenizer: str | None = None, force: bool = False) -> dict[str, Any]:
    """Write the checkpoint as a Hugging Face model directory; what was written (for ``--json``)."""
    if importlib.util.find_spec("safetensors") is None:
        raise HalError(f"{FLAG}: writing safetensors needs the 'safetensors' package, which is not installed; "
                       "pip install 'hetero-hal[hf]'")
    if max_shard_bytes < 1:
        raise ConfigError(f"{FLAG}: --max-shard-mib must be 1 or more")
    out = Path(out_dir)
    source = open_checkpoint(checkpoint)
    check_out_dir(out, source, force)
    tokens = tokenizer_files(tokenizer, source)
    tensors = hf_tensors(source)
    dtypes = {t.dtype for _, t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        raise ConfigError(f"{FLAG} {source.path}: the checkpoint's tensors are {sorted(map(str, dtypes))}; expected one of "
                          f"{', '.join(DTYPE_NAMES.values())}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = _write(tmp, source, tensors, max_shard_bytes, tokens, next(iter(dtypes)))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"checkpoint": str(source.path), "step": source.meta["step"], "out_dir": str(out),
            "model_type": family_of(source.model).model_type, "files": files,
            "shards": sum(f.endswith(".safetensors") for f in files), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "tokenizer": _shipped_names(tokens) or None}


def _write(tmp: Path, source: Source, tensors: list[tuple[str, torch.Tensor]], max_bytes: int, tokens: list[Path],
           dtype: torch.dtype) -> list[str]:
    from safetensors.torch import save_file

    shards = plan_shards(tensors, max_bytes)
    weight_map, files = {}, ["config.json"]
    _write_text(tmp / "config.json", json.dumps(hf_config(source.model, dtype), indent=2) + "\n")
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        # clone: the pieces of a fused tensor share its storage, which safetensors refuses; one shard at a time in memory
        save_file({n: t.clone() for n, t in shard}, tmp / name, metadata={"format": "pt"})
        _fsync(tmp / name)
        weight_map.update(dict.fromkeys((n for n, _ in shard), name))
        files.append(name)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    _write_text(tmp / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    files.append(INDEX)
    for file, name in zip(tokens, _shipped_names(tokens)):
        shutil.copyfile(file, tmp / name)
        _fsync(tmp / name)
        files.append(name)
    return files


def _shipped_names(tokens: list[Path]) -> list[str]:
    """The names the tokenizer files get: the first is always tokenizer.json (what transformers looks for, whatever
    ``--tokenizer FILE`` was called), the files found beside it keep theirs."""
    return [TOKENIZER_FILES[0], *(f.name for f in tokens[1:])] if tokens else []


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _replace(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an old ``out`` (empty, or replaced under --force) is removed only afterwards."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["export_hf", "hf_config", "hf_tensors", "open_checkpoint", "plan_shards"]
