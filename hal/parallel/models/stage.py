"""A pipeline stage of the model, built one stage at a time from its family's blocks.

    stage = build_stage(config, range(0, 3), first=True, last=False, tp_comm=tp, sp=True, seed=0)
    hidden = stage(ids)                 # first stage: token ids (B, S) → hidden
    logits = last_stage(hidden)         # last stage: hidden → logits (this TP rank's vocab slice)
    loss = vocab_parallel_cross_entropy(logits, labels, tp)   # the loss is the caller's (parallel.models.loss)

Parameter names are global and independent of the split: ``embed.weight``, ``layers.<i>.<the family's block
names>`` (Llama's: ``attn_norm.weight``, ``attn.qkv.weight``, ``attn.out.weight``, ``mlp_norm.weight``,
``mlp.gate_up.weight``, ``mlp.down.weight``; with ``qkv_bias`` (Qwen2) also ``attn.qkv.bias``), ``norm.weight``
(and ``norm.bias`` for a LayerNorm family), ``head.weight`` (untied only; with tied embeddings the last stage holds
its own ``embed.weight`` and uses it as the head).

Initialisation: every parameter's FULL tensor is drawn on the host from a CPU generator seeded by
sha256(seed, name), then this rank keeps its TP shard. The weights therefore depend only on
(seed, name) — never on the pipeline split, the TP degree or the device — so a single-process
model and any split start identical, which the equivalence tests rely on. The cost is one full
parameter in host memory at a time during construction. With ``init_from`` (a Hugging Face
checkpoint) nothing is drawn: each rank reads only its slices (``parallel.models.hf_weights``).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.families.registry import get_family
from hal.parallel.models.layers import ColumnParallelLinear, VocabParallelEmbedding, local_shard, parallel_input, param_meta
from hal.parallel.models.linear import fp8_matmuls, fp8_setting
from hal.parallel.models.moe_layer import REPLAYING, MoEFeedForward
from hal.parallel.models.parts import StageParts
from hal.parallel.models.tp_comm import TPComm, tp_size
from hal.parallel.models.weight_grad import split_linear, split_setting, splittable

# --- deterministic initialisation ---------------------------------------------------------------


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, parameter name): stable across processes and versions."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_init(name: str, shape: tuple[int, ...], init: str, std: float, seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of parameter ``name`` on the host."""
    if init == "ones":
        return torch.ones(shape)
    if init == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_stage(stage: nn.Module, seed: int, tp_comm: TPComm) -> None:
    """Fill every parameter with its shard of ``full_init(name, ...)`` (its experts' share under expert parallelism)."""
    ep_comm = getattr(stage, "ep_comm", None)
    for name, param in stage.named_parameters():
        meta = param_meta(param)
        if meta is None:
            raise TypeError(f"parameter {name} has no ParamMeta; build it with a parallel layer")
        full = full_init(name, meta.full_shape, meta.init, meta.std, seed)
        param.copy_(local_shard(full, meta, tp_comm, ep_comm))


# --- the stage ------------------------------------------------------------------------------------


class _Replayed:
    """A checkpointed layer: its first call is the forward, any later one torch.utils.checkpoint's recompute
    in the backward — marked (``_REPLAYING``) so what a forward counts (the MoE tally) is counted once, and run
    with the linears the forward had (splittable under a zero-bubble schedule, fp8): the backward runs outside
    the engine's forward settings, and a recompute that built other linears would save other tensors (torch's
    checkpoint refuses that) or defer no weight gradient."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.calls = layer, 0
        self.linears: tuple[bool, torch.dtype | None] = (False, None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            self.linears = (split_setting(), fp8_setting())
            return self.layer(h)
        REPLAYING.active = True
        split, fp8 = self.linears
        try:
            with splittable(split), fp8_matmuls(fp8):
                return self.layer(h)
        finally:
            REPLAYING.active = False


class Stage(nn.Module):
    """One pipeline stage: its decoder layers, plus the embedding (first) and norm/head (last). The layers and the
    final norm are the model's family's blocks (``Family.decoder_layer``, ``final_norm``, built from ``StageParts``).

    ``forward(x)``: x is token ids (B, S) on the first stage, else the hidden state (B, S, H) —
    (B, S/tp, H), this rank's contiguous seq chunk, under SP. Returns the hidden state in the same
    layout, or on the last stage the logits (B, S, V/tp) of this TP rank's vocab slice over the full
    sequence. The loss is not the stage's: the engine (or any caller) applies a loss function to the
    logits (``parallel.models.loss``), so torch's ``PipelineStage`` can run this module as it is.
    With ``fused_head`` the last stage stops before the head: it returns the normalised hidden state
    (B, S, H) as the head sees it, and the loss function applies the head (``parallel.models.fused_head``).

    Interleaved plans give a stage several model chunks (``layer_range`` a tuple of ranges): the
    engine runs one at a time with ``forward_chunk(x, v)``; the embedding belongs to chunk 0 of the
    first stage, the norm and head to the last chunk of the last stage.
    """

    def __init__(self, config: ModelConfig, layer_range: range | tuple[range, ...], *, first: bool, last: bool,
                 tp_comm: TPComm, sp: bool, checkpoint: bool = False, fused_head: bool = False, ep_comm: Any = None) -> None:
        super().__init__()
        self.ep_comm = ep_comm if ep_comm is not None and ep_comm.size > 1 else None  # experts shared out (MoE)
        self.chunks: tuple[range, ...] = (layer_range,) if isinstance(layer_range, range) else tuple(layer_range)
        self.layer_range = self.chunks[0] if len(self.chunks) == 1 else None
        self.config, self.first, self.last = config, first, last
        self.tp_comm, self.sp = tp_comm, sp
        self.fused_head = fused_head and last
        self.checkpoint = checkpoint  # activation checkpointing per decoder layer (see ``_run_layer``)
        self.tied = config.tie_embeddings
        if first or (last and self.tied):
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_comm=tp_comm, sequence_parallel=sp)
        family, parts = get_family(config.family), StageParts(config, tp_comm, sp, self.ep_comm)
        self.layers = nn.ModuleDict({str(i): family.decoder_layer(config, parts, i) for r in self.chunks for i in r})
        if last:
            self.norm = family.final_norm(config, parts)
            if not self.tied:
                self.head = ColumnParallelLinear(config.hidden_size, config.vocab_size, tp_comm=tp_comm, sequence_parallel=sp)

    @property
    def head_weight(self) -> nn.Parameter:
        """The LM head's (V/tp, H) weight: the embedding's when tied."""
        return self.embed.weight if self.tied else self.head.weight

    def moe_blocks(self) -> dict[int, MoEFeedForward]:
        """This stage's MoE feed-forward blocks by global layer index."""
        return {int(i): layer.mlp for i, layer in self.layers.items() if isinstance(getattr(layer, "mlp", None), MoEFeedForward)}

    def configure_moe(self, aux_scale: float, balance_group: Any = None) -> None:
        """Every MoE block's share of the step's loss and the ranks its balancing loss counts over."""
        for block in self.moe_blocks().values():
            block.aux_scale = aux_scale
            block.balance_group = balance_group

    def take_moe_tally(self) -> dict[int, dict[str, Any]]:
        """Each MoE layer's routing since the last call (``MoEFeedForward.take_tally``)."""
        return {i: t for i, block in self.moe_blocks().items() if (t := block.take_tally()) is not None}

    @property
    def needs_tied_grad_sync(self) -> bool:
        """True when this stage holds one of two copies of a tied embedding (see ``sync_tied_embedding_grads``)."""
        return self.tied and self.first != self.last

    def _run_layer(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One decoder layer, under activation checkpointing when ``self.checkpoint`` and autograd is on.

        Checkpointing keeps only each layer's input for backward and re-runs the layer's forward
        when backward reaches it: activation memory drops from every intermediate of every layer
        to one (B, S, H) input per layer (plus one layer's intermediates during its recompute),
        for about one extra forward of the layers. With deterministic kernels (CPU: tested) the loss
        and gradients are bitwise those of the plain stage: the recompute sees the same inputs.

        - Non-reentrant (``use_reentrant=False``): it works when the input does not require grad,
          supports keyword arguments and nested hooks, and is what torch recommends.
        - ``preserve_rng_state=False``: no op in the decoder draws random numbers (no dropout), so
          stashing and restoring the RNG per layer and micro-batch would be pure cost — and would
          need a device RNG API that not every vendor backend has. Add dropout, flip this.
        - TP collectives inside a layer run again during the recompute, on every TP rank in the
          same order (backward visits the same graph everywhere), so they stay matched — but they
          cost communication: per layer and micro-batch, tp without sp repeats the attention
          output's all-reduce; sp repeats the two sequence all-gathers and the attention output's
          reduce-scatter. The layer's last collective (the MLP output's all-reduce / reduce-scatter)
          feeds no saved tensor, so torch's early stop skips it.
        """
        if self.checkpoint and torch.is_grad_enabled():
            return _checkpoint(_Replayed(layer), h, use_reentrant=False, preserve_rng_state=False)
        return layer(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.chunks) != 1:
            raise ValueError(f"this stage holds {len(self.chunks)} model chunks; run them one at a time with forward_chunk")
        return self.forward_chunk(x, 0)

    def forward_chunk(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """Model chunk ``chunk`` of this stage: its layers, with the embedding / head where it holds them."""
        h = self.embed(x) if self.first and chunk == 0 else x
        for i in self.chunks[chunk]:
            h = self._run_layer(self.layers[str(i)], h)
        if not (self.last and chunk == len(self.chunks) - 1):
            return h
        h = parallel_input(self.norm(h), self.tp_comm, self.sp)
        return h if self.fused_head else split_linear(h, self.head_weight)


def check_tp(config: ModelConfig, tp: int) -> None:
    """Every TP-split size must divide evenly (the plan checks this too; this guards direct use)."""
    for what, value in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("hidden_size", config.hidden_size), ("ffn_hidden_size", config.ffn_hidden_size),
                        ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ConfigError(f"model.{what} {value} is not divisible by tp {tp}; choose a tp that divides it")


def build_stage(config: ModelConfig, layer_range: range | tuple[range, ...], *, first: bool, last: bool, tp_comm: TPComm, sp: bool,
                seed: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                checkpoint: bool = False, fused_head: bool = False, init_from: str | os.PathLike[str] | None = None,
                ep_comm: Any = None) -> Stage:
    """The stage holding ``layer_range`` (global layer indices), initialised from ``seed``.
    ``ep_comm``: the expert-parallel group its MoE layers share their experts over (None: every expert here).

    ``tp_comm``: the stage's TP group (None or size 1: plain layers, no collectives). ``sp``:
    Megatron sequence parallelism (a no-op at tp=1). ``checkpoint``: activation checkpointing of
    every decoder layer (``Stage._run_layer`` says what it saves and what it costs). ``fused_head``:
    the last stage returns the head's input, not logits (``Stage``). ``init_from``: a Hugging Face
    checkpoint directory whose safetensors replace the seeded init — each parameter filled with this
    rank's slices only (``parallel.models.hf_weights``), no full tensor drawn. Weights are made in fp32 on the
    host, then moved to ``device``/``dtype``.
    """
    for part in (layer_range,) if isinstance(layer_range, range) else layer_range:
        if not (0 <= part.start <= part.stop <= config.num_layers) or part.step != 1:
            raise ConfigError(f"layer range {part} is not a contiguous part of the model's {config.num_layers} layers")
    check_tp(config, tp_size(tp_comm))
    stage = Stage(config, layer_range, first=first, last=last, tp_comm=tp_comm, sp=sp, checkpoint=checkpoint,
                  fused_head=fused_head, ep_comm=ep_comm)
    if init_from is None:
        init_stage(stage, seed, tp_comm)
    else:
        from hal.parallel.models.hf_weights import load_stage

        load_stage(stage, init_from, tp_comm)
    return moved(stage, device, dtype) if device is not None or dtype is not None else stage


def moved(module: torch.nn.Module, device: torch.device | str | None, dtype: torch.dtype | None) -> torch.nn.Module:
    """``module.to(device, dtype)`` with each parameter's ``hal_meta`` (its shard spec, an expert's marker) kept.

    Why: where the moved tensors are a tensor subclass (a device written in Python: the vendor stand-ins) or
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` is on, ``Module.to`` swaps each parameter's
    whole object state with the new tensor's — its ``__dict__`` too — and the meta was gone: expert shards then
    took part in the dense gradient sum as if every rank held the same experts (the stand-ins found it)."""
    metas = {name: meta for name, p in module.named_parameters() if (meta := getattr(p, "hal_meta", None)) is not None}
    module = module.to(device=device, dtype=dtype)
    for name, p in module.named_parameters():
        if name in metas and getattr(p, "hal_meta", None) is None:
            p.hal_meta = metas[name]  # type: ignore[attr-defined]
    return module


def full_model(config: ModelConfig, seed: int, init_from: str | os.PathLike[str] | None = None) -> Stage:
    """The whole model in one process (tp=1): the single-device reference (``init_from``: as ``build_stage``)."""
    return build_stage(config, range(config.num_layers), first=True, last=True, tp_comm=None, sp=False, seed=seed,
                       init_from=init_from)


# --- tied embeddings across pipeline stages --------------------------------------------------------


def sync_tied_embedding_grads(stage: Stage, comm: TPComm) -> None:
    """Sum the tied embedding's gradient between the first stage (lookup) and the last (head).

    With tied embeddings on different stages each holds a copy of ``embed.weight`` (same init)
    and sees only its own use's gradient; the true gradient is the sum. Call this after backward
    and after each stage's data-parallel gradient reduction, before the optimizer step, on every
    rank of ``comm``; both copies then get the same update and stay equal. ``comm`` spans ranks of
    the first and the last stage:

    - Megatron's embedding group (the cheap path): two ranks, one per stage, holding the same
      vocab rows — e.g. first-stage TP rank t and last-stage TP rank t when both stages have the
      same TP degree. One all-reduce of the (V/tp, H) shard.
    - Any other mix (different TP degrees, DP replicas on either side): every rank of both stages
      that must end with the summed gradient. Each side's ranks must cover the whole vocabulary;
      a rank contributes its rows divided by how many ranks of its side hold them (DP replicas
      hold equal, already-reduced gradients), into one all-reduce of a full (V, H) buffer.

    A stage that is both first and last holds one shared parameter, and ``None`` or a size-1 comm
    means no partner: nothing to do. The rows each member holds are exchanged first (three
    integers per rank) so a wrong group is a clear error, not a silently wrong gradient.
    """
    if not stage.needs_tied_grad_sync or comm is None or comm.size == 1:
        return
    weight = stage.embed.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    start, end = stage.embed.vocab_start, stage.embed.vocab_end
    mine = torch.tensor([[start, end, int(stage.first)]], dtype=torch.int64, device=weight.device)
    members = [tuple(row) for row in comm.all_gather(mine).tolist()]
    sides = {flag: [(s, e) for s, e, f in members if f == flag] for flag in (1, 0)}
    if not sides[1] or not sides[0]:
        raise ValueError(f"the tied-embedding group {list(comm.ranks)} must hold ranks of both the first and the last stage")
    if len(members) == 2 and sides[1] == sides[0]:
        comm.all_reduce(weight.grad)
        return
    vocab = stage.config.vocab_size
    holders = torch.zeros(vocab, dtype=weight.grad.dtype, device=weight.device)
    for s, e in sides[int(stage.first)]:
        holders[s:e] += 1
    for flag, ranges in sides.items():
        covered = torch.zeros(vocab, dtype=torch.bool)
        for s, e in ranges:
            covered[s:e] = True
        if not bool(covered.all()):
            side = "first" if flag else "last"
            raise ValueError(f"the tied-embedding group {list(comm.ranks)}: its {side}-stage ranks do not cover the whole vocabulary; "
                             "pass every TP rank of both stages, or two ranks holding the same shard")
    full = weight.grad.new_zeros((vocab, weight.shape[1]))
    full[start:end] = weight.grad / holders[start:end].unsqueeze(-1)
    comm.all_reduce(full)
    weight.grad.copy_(full[start:end])


__all__ = ["Stage", "build_stage", "check_tp", "full_init", "full_model", "init_stage", "param_seed",
           "sync_tied_embedding_grads"]
