"""Tiny Qwen3 and GPT-NeoX checkpoints (families with blocks of their own) and the per-rank bodies that check their
pipelined and tensor-parallel stages against the single-process model.

Like ``hf_cases``: every checkpoint is a random transformers model (every parameter drawn again) saved with
``save_pretrained``; ranks never import transformers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import hf_cases

VOCAB, SEQ, BATCH = 128, 16, 2
SEED = 1234
FAMILIES = ("qwen3", "gpt_neox", "gpt_neox_sequential")


def hf_config(family: str) -> Any:
    """A tiny fp32 config: Qwen3 with a head size of its own (16, hidden 32 / 4 heads = 8) and 2 kv heads; GPT-NeoX
    (Pythia's shape) with half of each head rotated and the parallel residual, or a quarter rotated, the residual
    one step after the other and GELU's tanh form (``gpt_neox_sequential``)."""
    hf = hf_cases.transformers()
    from transformers import GPTNeoXConfig, Qwen3Config  # noqa: F401  (resolve the lazy modules)

    if family == "qwen3":
        return hf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                              rms_norm_eps=1e-6, tie_word_embeddings=False)
    sequential = family == "gpt_neox_sequential"
    return hf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25 if sequential else 0.5,
                            use_parallel_residual=not sequential, hidden_act="gelu_new" if sequential else "gelu")


def save_random(family: str, directory: Path, seed: int = 0) -> Path:
    """A random transformers model of ``family`` saved in ``directory``."""
    torch.manual_seed(seed)
    model = hf_cases.transformers().AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    hf_cases.randomize(model, seed)
    model.save_pretrained(directory)
    return directory


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def labels() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))


# --- ranks -----------------------------------------------------------------------------------------------


def _reference(model: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, full gradients) of the single-process model."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.models.stage import full_model

    stage = full_model(model, SEED)
    loss = vocab_parallel_cross_entropy(stage(ids()), labels(), None)
    loss.backward()
    return loss.item(), gather_full_grads(stage)


def _errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((g - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-30)) if g.shape == ref[n].shape
            else float("inf") for n, g in got.items()}


def tp2(rank: int, world: int, models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each model over tp 2 (sp off and on): its loss and gathered gradients beside the single process's."""
    from hal.collectives import world_communicator
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.models.stage import build_stage

    comm = world_communicator()
    rows = []
    for name, keys in models.items():
        model = ModelConfig(**keys)
        ref_loss, ref_grads = _reference(model)
        for sp in (False, True):
            stage = build_stage(model, range(model.num_layers), first=True, last=True, tp_comm=comm, sp=sp, seed=SEED)
            loss = vocab_parallel_cross_entropy(stage(ids()), labels(), comm)
            loss.backward()
            grads = gather_full_grads(stage)
            rows.append({"case": f"{name} sp={sp}", "loss": loss.item(), "ref_loss": ref_loss,
                         "errors": _errors(grads, ref_grads), "names": sorted(grads) == sorted(ref_grads),
                         "qkv_rows": tuple(stage.layers["0"].attn.qkv.weight.shape)[0]})
    return rows


def pipeline2(rank: int, world: int, models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each model as two stages on two processes (one layer each): the last stage's loss, every gradient."""
    from hal.collectives import world_communicator
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.models.stage import build_stage

    comm = world_communicator()
    rows = []
    for name, keys in models.items():
        model = ModelConfig(**keys)
        ref_loss, ref_grads = _reference(model)
        stage = build_stage(model, range(rank, rank + 1), first=rank == 0, last=rank == 1, tp_comm=None, sp=False,
                            seed=SEED)
        shape, loss = (BATCH, SEQ, model.hidden_size), None
        if rank == 0:
            h = stage(ids())
            comm.send(h.detach(), dst=1)
            h.backward(comm.recv(torch.empty(shape), src=1)[0])
        else:
            h = comm.recv(torch.empty(shape), src=0)[0].requires_grad_()
            loss = vocab_parallel_cross_entropy(stage(h), labels(), None)
            loss.backward()
            comm.send(h.grad, dst=0)
        rows.append({"case": name, "loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
                     "errors": _errors(gather_full_grads(stage), ref_grads)})
    return rows
