"""Llama (2 and 3, with Llama 3's rope scaling): the decoder as it is, the base every other family changes."""
from __future__ import annotations

from hal.parallel.families.spec import Family


class Llama(Family):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
