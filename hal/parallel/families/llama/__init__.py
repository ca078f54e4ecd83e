"""Llama (2 and 3, with Llama 3's rope scaling): the decoder as it is, the base every other family changes.
Its blocks (``blocks``: GQA attention with rotary embeddings, SwiGLU or MoE feed-forward, RMSNorm, one residual step
after the other) build Llama, Mistral, Qwen2, Mixtral and Qwen2-MoE."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hal.parallel.families.spec import Family, ModelShape, Parts

if TYPE_CHECKING:
    from torch import nn


class Llama(Family):
    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def decoder_layer(self, model: ModelShape, parts: Parts, index: int) -> nn.Module:
        from hal.parallel.families.llama.blocks import DecoderLayer

        return DecoderLayer(model, parts, index)
