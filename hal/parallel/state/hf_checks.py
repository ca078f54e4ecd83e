"""Parent-side checks of a Hugging Face checkpoint against a model, and the model's Hugging Face tensor map.

Apart from the rank-side loader (``parallel.models.hf_weights``) because these build the model (on the meta
device) to learn its parameters' layouts, and the model's own module imports the loader.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from hal.errors import ConfigError, HalError
from hal.parallel.config.model import ModelConfig
from hal.parallel.families.registry import family_of
from hal.parallel.models.hf_names import Piece, pieces
from hal.parallel.models.hf_weights import FLOAT_DTYPES, catalog
from hal.parallel.models.layers import param_meta


def model_pieces(config: ModelConfig) -> dict[str, list[Piece]]:
    """{hal name: its Hugging Face pieces} for the whole model, from the model built on the meta device."""
    from hal.parallel.models.stage import full_model

    with torch.device("meta"):
        module = full_model(config, 0)
    out, family = {}, family_of(config)
    for name, param in module.named_parameters():
        meta = param_meta(param)
        if meta is None:
            raise ConfigError(f"parameter {name} has no ParamMeta; the model cannot map it to Hugging Face names")
        out[name] = pieces(name, meta, family)
    return out


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor this model is made of, with its shape (``lm_head.weight`` only when untied)."""
    return {p.hf_name: p.shape for parts in model_pieces(config).values() for p in parts}


def check_weights(directory: str | os.PathLike[str], model: ModelConfig, where: str) -> None:
    """The checkpoint in ``directory`` is exactly this model's tensors, readable: one ConfigError line otherwise."""
    if importlib.util.find_spec("safetensors") is None:
        raise HalError(f"{where}: loading Hugging Face weights needs the 'safetensors' package, which is not installed; "
                       "pip install 'hetero-hal[hf]'")
    found, want = catalog(directory, where), hf_shapes(model)
    missing = [n for n in want if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{where}: tensor {missing[0]}{more} is missing from {directory}; it is not a checkpoint of this model")
    extra = sorted(n for n in found if n not in want)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        tied = " (the config ties the embeddings, so there is no separate head)" if extra[0] == "lm_head.weight" else ""
        raise ConfigError(f"{where}: {found[extra[0]].file.name} holds tensor {extra[0]}{more}, which this model has no "
                          f"place for{tied}; it is not a checkpoint of this model")
    for name, shape in want.items():
        entry = found[name]
        if entry.shape != shape:
            raise ConfigError(f"{where}: tensor {name} in {entry.file.name} has shape {list(entry.shape)}, this model needs "
                              f"{list(shape)}; the checkpoint does not match its config.json")
        if entry.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{where}: tensor {name} in {entry.file.name} is {entry.dtype}, not a floating-point dtype "
                              f"({', '.join(FLOAT_DTYPES)}); quantised checkpoints are not read")


__all__ = ["check_weights", "hf_shapes", "model_pieces"]
