"""Mistral: Llama's decoder and tensor names; its sliding window is accepted only where it is no difference.
A model of its shape is exported as Llama (the same names; transformers loads it)."""
from __future__ import annotations

from hal.parallel.families.llama import Llama


class Mistral(Llama):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    exported = False
