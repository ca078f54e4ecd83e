"""The Llama-style decoder made of parallel layers, built one pipeline stage at a time.

    stage = build_stage(config, range(0, 3), first=True, last=False, tp_comm=tp, sp=True, seed=0)
    hidden = stage(ids)                 # first stage: token ids (B, S) → hidden
    logits = last_stage(hidden)         # last stage: hidden → logits (this TP rank's vocab slice)
    loss = vocab_parallel_cross_entropy(logits, labels, tp)   # the loss is the caller's (parallel.models.loss)

Parameter names are global and independent of the split: ``embed.weight``,
``layers.<i>.attn_norm.weight``, ``layers.<i>.attn.qkv.weight``, ``layers.<i>.attn.out.weight``,
``layers.<i>.mlp_norm.weight``, ``layers.<i>.mlp.gate_up.weight``, ``layers.<i>.mlp.down.weight``,
``norm.weight``, ``head.weight`` (untied only; with tied embeddings the last stage holds its own
``embed.weight`` and uses it as the head); with ``qkv_bias`` (Qwen2) also ``layers.<i>.attn.qkv.bias``.

Initialisation: every parameter's FULL tensor is drawn on the host from a CPU generator seeded by
sha256(seed, name), then this rank keeps its TP shard. The weights therefore depend only on
(seed, name) — never on the pipeline split, the TP degree or the device — so a single-process
model and any split start identical, which the equivalence tests rely on. The cost is one full
parameter in host memory at a time during construction. With ``init_from`` (a Hugging Face
checkpoint) nothing is drawn: each rank reads only its slices (``parallel.models.hf_weights``).
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from hal import ops
from hal.errors import ConfigError
from hal.parallel.config.model import ROPE_SCALING_KEYS, ModelConfig
from hal.parallel.models.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    local_shard,
    parallel_input,
    param_meta,
)
from hal.parallel.models.linear import fp8_matmuls, fp8_setting
from hal.parallel.models.moe import MoE, attach_aux_loss, compiling
from hal.parallel.models.tp_comm import TPComm, tp_rank, tp_size
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


# --- rotary embeddings --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
                scaling: tuple[float, float, float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq, head_dim) for positions 0..seq-1, in the rotate-half layout.

    ``scaling``: Llama 3's (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    wavelengths longer than original/low are divided by ``factor``, those shorter than original/high
    kept, and the band between blended smoothly (as the reference implementation does).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, *scaling)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: float) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    middle = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(middle, blended, out)


# --- the decoder ----------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query attention: fused QKV column-parallel over heads, output row-parallel.

    Each TP rank owns num_heads/tp query heads and num_kv_heads/tp kv heads, so attention itself
    needs no communication; under SP the QKV projection gathers the full sequence first.
    """

    def __init__(self, config: ModelConfig, tp_comm: TPComm, sp: bool) -> None:
        super().__init__()
        tp, hd = tp_size(tp_comm), config.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = config.num_heads // tp, config.num_kv_heads // tp, hd, config.rope_theta
        scaling = config.rope_scaling
        self.rope_scaling = None if scaling is None else tuple(float(scaling[k]) for k in ROPE_SCALING_KEYS)
        q, kv = config.num_heads * hd, config.num_kv_heads * hd
        self.qkv = ColumnParallelLinear(config.hidden_size, q + 2 * kv, tp_comm=tp_comm, sequence_parallel=sp, parts=(q, kv, kv),
                                        bias=config.qkv_bias)
        self.out = RowParallelLinear(q, config.hidden_size, tp_comm=tp_comm, sequence_parallel=sp, std=_out_std(config))
        # The rotary tables of the last (positions, dtype, device) seen eagerly: a compiled layer reads them instead of
        # tracing ``rope_tables`` (host float64 math, and an lru_cache Dynamo ignores, in every call); not saved.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)

    def _rope(self, s: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope_cos, self.rope_sin
        if cos is not None and sin is not None and cos.shape[0] == s and cos.dtype == q.dtype and cos.device == q.device:
            return cos, sin
        cos, sin = rope_tables(s, self.head_dim, self.theta, q.device, q.dtype, self.rope_scaling)
        if not compiling():  # the eager first forward keeps them (hal's compiled stages run one eagerly first)
            self.rope_cos, self.rope_sin = cos, sin
        return cos, sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, S, (h + 2 kv) * hd) with the full sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(s, q)
        q, k = ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)
        o = ops.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: fused gate|up column-parallel (each rank holds [gate_t, up_t]), down row-parallel."""

    def __init__(self, config: ModelConfig, tp_comm: TPComm, sp: bool) -> None:
        super().__init__()
        f = config.ffn_hidden_size
        self.gate_up = ColumnParallelLinear(config.hidden_size, 2 * f, tp_comm=tp_comm, sequence_parallel=sp, parts=(f, f))
        self.down = RowParallelLinear(f, config.hidden_size, tp_comm=tp_comm, sequence_parallel=sp, std=_out_std(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops.swiglu(self.gate_up(x)))


class _ReplayFlag:
    """Whether a checkpointed layer is being recomputed. A plain attribute, not a context variable: a compiled layer
    reads it as a guarded constant (Dynamo cannot trace ``ContextVar.get``), so the recompute gets its own graph
    instead of a graph break. One flag per process is enough: the recompute runs inside the backward, while no
    forward of this process runs."""

    active = False


_REPLAYING = _ReplayFlag()


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
        _REPLAYING.active = True
        split, fp8 = self.linears
        try:
            with splittable(split), fp8_matmuls(fp8):
                return self.layer(h)
        finally:
            _REPLAYING.active = False


class MoEFeedForward(MoE):
    """The MoE block as a decoder layer's feed-forward: its output only, the auxiliary loss attached to it.

    The balancing and z losses (weighted by the config) reach the router through ``attach_aux_loss`` with
    ``aux_scale`` — the share of the step's loss one forward is: 1 / (micro-batches × dp replicas) in the
    engine, as the language-model loss of a micro-batch on one replica. ``tally`` sums what each forward
    routed until the trainer reads it (``take_tally``), on the device, with no host read per forward.
    """

    def __init__(self, config: ModelConfig, tp_comm: TPComm, ep_comm: Any = None, sp: bool = False) -> None:
        super().__init__(config.hidden_size, config.moe_config(), out_std=_out_std(config), ep_group=ep_comm,
                         tp_comm=tp_comm, sequence_parallel=sp)
        self.aux_scale = 1.0
        self._tally: torch.Tensor | None = None  # (E + 3,): pairs per expert, aux sum, z sum, forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, stats = super().forward(x)
        self._count(stats)
        aux = self.loss(stats)
        if torch.is_grad_enabled() and aux.requires_grad and self.aux_scale:
            out = attach_aux_loss(out, aux, self.aux_scale)
        return out

    @torch.no_grad()
    def _count(self, stats: Any) -> None:
        """Add one forward's routing to the tally — once: not again in a checkpointed layer's recompute, and on one TP
        rank (all route the same tokens). One (E + 3,) float64 row on the device (pairs per expert, aux loss, z loss,
        forwards), so a compiled layer keeps it in its graph."""
        if _REPLAYING.active or tp_rank(self.tp_comm) != 0:
            return
        row = torch.cat([stats.load.to(torch.float64), stats.aux_loss.detach().double().reshape(1),
                         stats.z_loss.detach().double().reshape(1), stats.load.new_ones(1, dtype=torch.float64)])
        self._tally = row if self._tally is None else self._tally + row

    def take_tally(self) -> dict[str, Any] | None:
        """What the forwards since the last call routed (host values; one read), then start again."""
        if self._tally is None:
            return None
        row = self._tally.cpu().tolist()
        self._tally = None
        load, (aux, z, n) = row[:-3], row[-3:]
        count = max(n, 1.0)
        return {"load": [int(v) for v in load], "aux_loss": aux / count, "z_loss": z / count,
                "exchange": self.exchange}  # under ep: the path the last forward took (symmetric | all_to_all)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); the residual stream is seq-sharded under SP.
    The feed-forward is the MoE block in the layers the config makes MoE layers (``ModelConfig.is_moe_layer``)."""

    def __init__(self, config: ModelConfig, tp_comm: TPComm, sp: bool, index: int = 0, ep_comm: Any = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, tp_comm=tp_comm, sequence_parallel=sp)
        self.attn = Attention(config, tp_comm, sp)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, tp_comm=tp_comm, sequence_parallel=sp)
        self.mlp: nn.Module = (MoEFeedForward(config, tp_comm, ep_comm, sp) if config.is_moe_layer(index)
                               else MLP(config, tp_comm, sp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, x = self.mlp_norm.add_forward(self.attn(self.attn_norm(x)), x)  # x + attn(...), normalised
        return x + self.mlp(normed)


def _out_std(config: ModelConfig) -> float:
    """Residual-branch outputs scaled by 1/sqrt(2·layers) (GPT-2/Megatron) so depth doesn't grow the stream."""
    return 0.02 / math.sqrt(2 * config.num_layers)


class Stage(nn.Module):
    """One pipeline stage: its decoder layers, plus the embedding (first) and norm/head (last).

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
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, tp_comm, sp, i, self.ep_comm)
                                     for r in self.chunks for i in r})
        if last:
            self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps, tp_comm=tp_comm, sequence_parallel=sp)
            if not self.tied:
                self.head = ColumnParallelLinear(config.hidden_size, config.vocab_size, tp_comm=tp_comm, sequence_parallel=sp)

    @property
    def head_weight(self) -> nn.Parameter:
        """The LM head's (V/tp, H) weight: the embedding's when tied."""
        return self.embed.weight if self.tied else self.head.weight

    def moe_blocks(self) -> dict[int, MoEFeedForward]:
        """This stage's MoE feed-forward blocks by global layer index."""
        return {int(i): layer.mlp for i, layer in self.layers.items() if isinstance(layer.mlp, MoEFeedForward)}

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
    return stage.to(device=device, dtype=dtype) if device is not None or dtype is not None else stage


def full_model(config: ModelConfig, seed: int, init_from: str | os.PathLike[str] | None = None) -> Stage:
    """The whole model in one process (tp=1): the single-device reference (``init_from``: as ``build_stage``)."""
    return build_stage(config, range(config.num_layers), first=True, last=True, tp_comm=None, sp=False, seed=seed,
                       init_from=init_from)


# --- full-shape views of a sharded stage ----------------------------------------------------------------


def gather_full(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], tp: TPComm,
                ep: TPComm = None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` (each shaped like ``params[name]``, this rank's shard) in full shape: the TP shards over
    ``tp``, then (expert shards) every ``ep`` rank's experts in order. Never returns a live tensor."""
    out = {}
    for name, local in tensors.items():
        meta = param_meta(params[name])
        full = local.detach()
        if meta is not None and meta.spec is not None and tp_size(tp) > 1:
            dim = meta.spec.dim
            gathered = tp.all_gather(full.movedim(dim, 0).contiguous())  # type: ignore[union-attr]
            full = meta.spec.unshard([s.movedim(0, dim) for s in gathered.chunk(tp.size, dim=0)])  # type: ignore[union-attr]
        if meta is not None and meta.expert_split and tp_size(ep) > 1:
            full = ep.all_gather(full.contiguous())  # type: ignore[union-attr]
        out[name] = full.clone() if full.data_ptr() == local.data_ptr() else full
    return out


def _gather_full(stage: Stage, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return gather_full(dict(stage.named_parameters()), tensors, stage.tp_comm, stage.ep_comm)


def gather_full_grads(stage: Stage) -> dict[str, torch.Tensor]:
    """{name: gradient in the full parameter's shape}; collective over the stage's TP group (and its ep group
    under expert parallelism).

    Every TP rank must call it (same parameters have gradients on every TP rank), and every rank of its ep group.
    """
    return _gather_full(stage, {n: p.grad for n, p in stage.named_parameters() if p.grad is not None})


def gather_full_params(stage: Stage) -> dict[str, torch.Tensor]:
    """{name: full parameter}; collective over the stage's TP group (checkpoints, comparisons)."""
    return _gather_full(stage, {n: p for n, p in stage.named_parameters()})


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


__all__ = [
    "Attention", "DecoderLayer", "MLP", "Stage", "build_stage", "check_tp", "full_init", "full_model",
    "gather_full_grads", "gather_full_params", "init_stage", "param_seed", "rope_tables", "sync_tied_embedding_grads",
]
