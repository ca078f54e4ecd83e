"""Tiny Hugging Face checkpoints for the weight-loading and export tests, and the per-rank bodies that load them.

Every checkpoint is a random transformers model (every parameter drawn again, norms and biases
included, so a swapped or dropped tensor shows in the logits) saved with ``save_pretrained``.
Ranks never import transformers: the test computes the reference logits in its own process.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, BATCH = 256, 16, 2


def transformers() -> Any:
    """The transformers module (imported from the repository root, where pytest runs: transformers >= 5.25 imports
    Hugging Face's ``kernels``, which no folder of ours may shadow — tests/cli/test_import_names.py)."""
    import transformers as module
    from transformers import (  # noqa: F401  (resolve the lazy modules)
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
    )

    return module


def hf_config(family: str, layers: int = 3, dense_layers: int = 1) -> Any:
    """A tiny fp32 config of ``family``: hidden 64, 4 heads, 2 kv heads (Llama with Llama 3's rope scaling,
    Mistral with tied embeddings, Qwen2 with its qkv bias; Mixtral with 4 experts top-2; Qwen2-MoE with 4
    experts top-2, a gated shared expert, unnormalised top-k weights and ``dense_layers`` leading dense layers)."""
    hf = transformers()

    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    if family == "llama":
        return hf.LlamaConfig(**sizes, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
    if family == "mistral":
        return hf.MistralConfig(**sizes, tie_word_embeddings=True)
    if family == "qwen2":
        return hf.Qwen2Config(**sizes, use_sliding_window=False)
    if family == "mixtral":
        return hf.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if family == "qwen2_moe":
        return hf.Qwen2MoeConfig(**sizes, use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=48, shared_expert_intermediate_size=40, norm_topk_prob=False,
                                 decoder_sparse_step=1, mlp_only_layers=list(range(dense_layers)))
    raise ValueError(family)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn again: norms around 1, biases and matrices around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else (0.1 if name.endswith("bias") else 0.05) * noise)


def save_random(family: str, directory: Path, *, layers: int = 3, seed: int = 0, max_shard_size: str | None = None,
                dense_layers: int = 1) -> Path:
    """A random transformers model of ``family`` saved in ``directory`` (sharded when ``max_shard_size``)."""
    torch.manual_seed(seed)
    model = transformers().AutoModelForCausalLM.from_config(hf_config(family, layers, dense_layers), dtype=torch.float32)
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own logits of the checkpoint in ``directory``."""
    model = transformers().AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


# --- ranks -----------------------------------------------------------------------------------------------


def tp2_then_dp2(rank: int, world: int, directories: list[str]) -> dict[str, Any]:
    """Per checkpoint: stage 0 (all layers but the last) tp2 on ranks 0-1, stage 1 (the last layer, norm, head) dp2
    on ranks 2-3, each rank loading only its slices; a stage-1 replica returns the full logits of its row."""
    from hal.collectives import world_communicator
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import build_stage

    comm = world_communicator()
    tp_pair = comm.subgroup((0, 1))
    comm.subgroup((2, 3))  # every rank creates every group
    tokens = ids()
    out: dict[str, Any] = {}
    for directory in directories:
        config = ModelConfig.from_mapping({"hf": directory, "weights": True, "max_seq_len": SEQ})
        cut = config.num_layers - 1
        if rank < 2:
            stage = build_stage(config, range(0, cut), first=True, last=False, tp_comm=tp_pair, sp=False, seed=0,
                                init_from=directory)
            with torch.no_grad():
                hidden = stage(tokens)
            if rank == 0:
                for row, dst in enumerate((2, 3)):
                    comm.send(hidden[row:row + 1].contiguous(), dst=dst)
            out[directory] = {"local": {n: tuple(p.shape) for n, p in stage.named_parameters()}}
        else:
            stage = build_stage(config, range(cut, config.num_layers), first=False, last=True, tp_comm=None, sp=False,
                                seed=0, init_from=directory)
            hidden = comm.recv(torch.empty(1, SEQ, config.hidden_size), src=0)[0]
            with torch.no_grad():
                out[directory] = {"row": rank - 2, "logits": stage(hidden)}
    return out


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Linux: writing 5 to clear_refs resets this process's peak RSS (VmHWM) to its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def load_peak(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Load the whole model as a tp=world stage; this rank's peak host memory while loading, and its shard's size."""
    from hal.collectives import world_communicator
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import build_stage

    comm = world_communicator()
    config = ModelConfig.from_mapping({"hf": directory, "weights": True})
    reset = _reset_peak()
    before = _status("VmRSS")
    stage = build_stage(config, range(config.num_layers), first=True, last=True, tp_comm=comm, sp=False, seed=0,
                        init_from=directory)
    peak = _status("VmHWM") - before  # with the reset: the peak during the load; without, an upper bound
    shard = sum(p.numel() * p.element_size() for p in stage.parameters())
    probe = {n: float(p.double().sum()) for n, p in stage.named_parameters() if n in ("embed.weight", "layers.0.mlp.down.weight")}
    return {"peak": peak, "shard": shard, "reset": reset, "pid": os.getpid(), "sums": probe}
