"""Qwen2: Llama's decoder with a bias on the q, k, v projections; its window is windowed only when switched on,
and then from ``max_window_layers`` up."""
from __future__ import annotations

from typing import Any, Mapping

from hal.config import limits
from hal.config.schema import Flag, NonNegativeInt, Nullable
from hal.parallel.families.llama import Llama
from hal.parallel.families.spec import DECODER_FIELDS, ModelShape


class Qwen2(Llama):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    qkv_bias = True
    config_fields = {**DECODER_FIELDS, "use_sliding_window": Nullable(Flag()),
                     "max_window_layers": Nullable(NonNegativeInt(limits.LAYERS))}

    def windowed_layers(self, hf: Mapping[str, Any], layers: int) -> list[int]:
        types = hf.get("layer_types")
        if isinstance(types, list) or hf.get("sliding_window") is None:
            return super().windowed_layers(hf, layers)
        if not hf.get("use_sliding_window", False):
            return []
        return list(range(int(hf.get("max_window_layers", 0) or 0), layers))

    def export_keys(self, model: ModelShape, where: str) -> dict[str, Any]:
        """The window declared off, so no layer is windowed."""
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": model.num_layers}
