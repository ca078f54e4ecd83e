"""Training FLOPs per token and model FLOPs utilisation (MFU), one convention for hal train and the benchmarks.

FLOPs per token = 6 × (parameters − the input embedding table) + 12 × layers × heads × head_dim ×
sequence length: forward and backward of every matmul, plus attention's score and value products
(torchtitan's and PaLM's convention; the embedding lookup is not a matmul). The parameters and attention's share
are the model's family's (``Family.layer_parameters``, ``norm_parameters``, ``attention_flops``). MFU = tokens/s × FLOPs
per token / the summed dense peak of every device of the run, for the precision the run computes in.
"""
from __future__ import annotations

from hal.parallel.config.memory import embedding_parameters, final_norm_parameters, layer_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.families.registry import get_family

# hal train's precision -> the catalog's peak_tflops key the matmuls run at. fp8-mixed is held to the
# bf16 peak: only its decoder layers' forward matmuls run in fp8, the other two thirds of the FLOPs in bf16.
PEAK_KEY = {"fp32": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8-mixed": "bf16"}


def model_parameters(model: ModelConfig, *, active: bool = False) -> int:
    """The model's parameters: embedding, layers, final norm, head (none when tied). ``active``: an MoE
    model's parameters one token runs through (its top-k experts, not all), what its FLOPs count."""
    embedding = embedding_parameters(model)
    head = 0 if model.tie_embeddings else embedding
    layers = sum(layer_parameters(model, i, active=active) for i in range(model.num_layers))
    return embedding + layers + final_norm_parameters(model) + head


def flops_per_token(model: ModelConfig, seq: int) -> float:
    """Training FLOPs per token (forward + backward), on the active parameters of an MoE model."""
    matmul_parameters = model_parameters(model, active=True) - embedding_parameters(model) * (0 if model.tie_embeddings else 1)
    return 6.0 * matmul_parameters + get_family(model.family).attention_flops(model, seq)


def mfu(tokens_per_s: float | None, model: ModelConfig, seq: int, peak_tflops_total: float | None) -> float | None:
    """Model FLOPs utilisation, or None where a rate or a device's peak is unknown."""
    if not tokens_per_s or not peak_tflops_total:
        return None
    return tokens_per_s * flops_per_token(model, seq) / (peak_tflops_total * 1e12)
