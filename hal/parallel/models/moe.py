"""A mixture-of-experts block: router, dropless routing, SwiGLU experts, shared experts, the losses.

The block runs on one rank, or with its experts shared out over an expert-parallel group (``ep_group``:
``dispatch`` sends each routed row to the rank holding its expert, ``combine`` brings the outputs back);
the single-rank semantics are the reference the EP version is checked against.

- **Router**: a linear layer to E logits; scores are softmax over all experts (Mixtral, Qwen2-MoE) or an
  independent sigmoid per expert (DeepSeek-V3); the top-k experts of each token are kept, their weights
  optionally renormalised to sum to 1 (Mixtral always; Qwen2-MoE's ``norm_topk_prob``).
- **Dropless routing**: every (token, choice) pair is processed — no capacity factor, nothing dropped.
  Pairs are sorted by expert once (``argsort``), so each expert sees one contiguous block. The grouped
  matmul takes the blocks' offsets on the device, so a block on one rank reads nothing on the host and its
  shapes are static (a compiled layer has no graph break and no recompile); the experts' loop and the
  all-to-all exchange read the per-expert counts on the host (as torchtitan's and Megablocks' dropless paths)
  — none at all under ep on CUDA GPUs of one host, where the exchange runs over symmetric memory
  (``hal.collectives.symmetric_exchange``; ``MoE.exchange`` says which path ran and ``exchange_reason`` why).
  What talks to the host or to other ranks runs eagerly inside a compiled layer (``torch.compiler.disable``).
- **Experts**: SwiGLU MLPs whose weights are stacked (E, ·, ·), so a grouped matmul can run all of them
  in one call. ``torch._grouped_mm`` is used where the device and dtype take it (CUDA, bf16, aligned
  strides: probed once per device and dtype); elsewhere a loop over the experts' blocks. The loop is the
  defined path, not an error: which one ran is ``MoE.path`` and a downgrade record when the grouped
  path was asked for and cannot run.
- **Shared experts** (Qwen2-MoE, DeepSeek): a dense SwiGLU every token goes through, optionally gated by
  a sigmoid of one more linear (Qwen2-MoE's ``shared_expert_gate``).
- **Losses**: the load-balancing auxiliary loss of Switch / Mixtral, E · Σ_e f_e · P_e (f_e the share of
  routed pairs that chose e, P_e the mean router probability of e), and the router z-loss of ST-MoE,
  mean(logsumexp(logits)²). Both are returned with the load (tokens per expert) so the trainer can weight
  them and log the balance.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hal import ops
from hal.collectives.symmetric_exchange import choose as choose_exchange
from hal.collectives.symmetric_exchange import exchange_for
from hal.downgrades import Downgrade, record_downgrade
from hal.parallel.config.model import MoEConfig, Scoring
from hal.parallel.models.graph_breaks import eager_when_compiled
from hal.parallel.models.layers import DEFAULT_STD, ParamMeta, ShardSpec
from hal.parallel.models.tp_comm import (
    TPComm,
    copy_to_tp_region,
    gather_to_replicated_region,
    reduce_from_tp_region,
    reduce_scatter_to_seq_region,
    tp_size,
)

ExpertPath = Literal["grouped_mm", "loop"]


@dataclass
class MoEStats:
    """What one forward routed: the losses (already unweighted) and the tokens each expert received."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    load: torch.Tensor  # (E,) int64: routed (token, choice) pairs per expert

    def imbalance(self) -> float:
        """max / mean load (1.0 = perfectly even); the log's balance figure."""
        load = self.load.float()
        return float(load.max() / load.mean().clamp_min(1e-9))


def _described(param: nn.Parameter, std: float, full_shape: tuple[int, ...] | None = None, *,
               spec: ShardSpec | None = None, expert_split: bool = False) -> nn.Parameter:
    """``param`` with the ParamMeta a model's seeded initialisation reads. ``full_shape``: the shape over every
    rank (default: the local one); ``spec``: its TP split; ``expert_split``: this rank holds a share of the
    stacked experts (expert parallelism)."""
    param.hal_meta = ParamMeta(full_shape or tuple(param.shape), spec, std=std,  # type: ignore[attr-defined]
                               expert_split=expert_split)
    return param


class Router(nn.Module):
    """Token → top-k experts and their weights."""

    def __init__(self, hidden: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        _described(self.gate.weight, DEFAULT_STD)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k expert ids (T, k), their weights (T, k) in x's dtype, probabilities (T, E) fp32, logits (T, E) fp32)."""
        logits = self.gate(x).float()
        probs = torch.softmax(logits, dim=-1) if self.config.scoring == "softmax" else torch.sigmoid(logits)
        weights, experts = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return experts, weights.to(x.dtype), probs, logits


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights: gate|up (E, 2F, H) and down (E, H, F).

    Each expert's slice is laid out as a linear layer's weight (out × in), as Hugging Face's per-expert
    ``gate_proj``/``up_proj`` (or Mixtral's w1/w3) and ``down_proj`` (w2) are: loading and export copy
    them without transposes; the matmuls take transposed views."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, *, std: float = DEFAULT_STD,
                 out_std: float = DEFAULT_STD / math.sqrt(2), shards: int = 1, tp: int = 1) -> None:
        """``shards``: the ep group's size; this rank holds num_experts / shards of them (``local``). ``tp``: the
        stage's TP size; each expert's FFN width is split over it (gate|up by columns, down by rows, as the
        dense MLP), so every rank's outputs are partial sums the block adds up over TP."""
        super().__init__()
        if ffn % tp:
            raise ValueError(f"moe: the experts' FFN width {ffn} is not divisible by the TP size {tp}")
        self.ffn = ffn // tp
        local = num_experts // shards
        self.gate_up = _described(nn.Parameter(torch.randn(local, 2 * self.ffn, hidden) * std), std,
                                  (num_experts, 2 * ffn, hidden), spec=ShardSpec(1, (ffn, ffn)) if tp > 1 else None,
                                  expert_split=shards > 1)
        self.down = _described(nn.Parameter(torch.randn(local, hidden, self.ffn) * out_std), out_std,
                               (num_experts, hidden, ffn), spec=ShardSpec(2, (ffn,)) if tp > 1 else None,
                               expert_split=shards > 1)

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor, path: ExpertPath) -> torch.Tensor:
        """``x``: (N, H) rows sorted by expert, ``counts[e]`` rows for expert e — or, for the grouped path, the
        cumulative counts already on the device (int32; rows past the last are not read); (N, H) outputs in that order.
        The loop needs the counts on the host."""
        if path == "grouped_mm":
            offsets = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            dtype = matmul_dtype(x)
            hidden = ops.swiglu(torch._grouped_mm(x.to(dtype), self.gate_up.to(dtype).transpose(-2, -1), offs=offsets))
            return torch._grouped_mm(hidden, self.down.to(dtype).transpose(-2, -1), offs=offsets)
        outs = []
        for e, block in enumerate(torch.split(x, counts)):
            if block.shape[0]:  # an expert no token chose does no work (its weights get no gradient this step)
                outs.append(ops.swiglu(block @ self.gate_up[e].to(x.dtype).t()) @ self.down[e].to(x.dtype).t())
        # No rows at all: an empty output still tied to x, so the backward reaches every collective it came through
        return torch.cat(outs) if outs else x * 0.0


class SharedExpert(nn.Module):
    """A dense SwiGLU every token passes through, optionally gated per token."""

    def __init__(self, hidden: int, ffn: int, gated: bool, *, out_std: float = DEFAULT_STD / math.sqrt(2),
                 tp_comm: TPComm = None) -> None:
        """``tp_comm``: the stage's TP group; the FFN width is split over it. ``forward`` gives this TP rank's share
        of the output (the gate, one value a token, replicated, applied to the share): the MoE block sums it
        with the experts' shares over TP in one exchange."""
        super().__init__()
        tp = tp_size(tp_comm)
        if ffn % tp:
            raise ValueError(f"moe: the shared expert's FFN width {ffn} is not divisible by the TP size {tp}")
        self.tp_comm = tp_comm
        self.gate_up = nn.Linear(hidden, 2 * ffn // tp, bias=False)
        self.down = nn.Linear(ffn // tp, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False) if gated else None
        _described(self.gate_up.weight, DEFAULT_STD, (2 * ffn, hidden), spec=ShardSpec(0, (ffn, ffn)) if tp > 1 else None)
        _described(self.down.weight, out_std, (hidden, ffn), spec=ShardSpec(1, (ffn,)) if tp > 1 else None)
        if self.gate is not None:
            _described(self.gate.weight, DEFAULT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.down(ops.swiglu(self.gate_up(copy_to_tp_region(x, self.tp_comm))))
        if self.gate is None:
            return part
        # each rank's gate gradient comes from its share alone: summed over TP (the copy's backward)
        return part * copy_to_tp_region(torch.sigmoid(self.gate(x)), self.tp_comm)


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where autocast is on for ``x``'s device (as it runs any
    matmul there), else ``x``'s."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (probed once per device type and dtype).

    Only CUDA is tried: torch 2.13's cpu kernel exists but its backward fails on expanded gradients."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = False
        if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
            try:
                x = torch.randn(32, 64, device=device, dtype=dtype, requires_grad=True)
                w = torch.randn(2, 32, 64, device=device, dtype=dtype, requires_grad=True)  # (E, out, in), as Experts
                y = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
                y.backward(torch.ones_like(y))
                ok = True
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


_GROUPED_TRACES: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_traces(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped matmul also runs traced — its fake-tensor kernel, what torch.compile runs, takes
    ``dtype``: torch 2.11's eager kernel takes fp32 (a fallback) while its traced one refuses all but bf16."""
    key = (device.type, dtype)
    if key not in _GROUPED_TRACES:
        ok = grouped_mm_works(device, dtype)
        if ok:
            from torch._subclasses.fake_tensor import FakeTensorMode

            quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs the refusal at ERROR level
            level, quiet.level = quiet.level, logging.CRITICAL
            try:
                with FakeTensorMode():
                    x = torch.empty(32, 64, device=device, dtype=dtype)
                    w = torch.empty(2, 32, 64, device=device, dtype=dtype)
                    torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.empty(2, device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
            finally:
                quiet.level = level
        _GROUPED_TRACES[key] = ok
    return _GROUPED_TRACES[key]


def compiling() -> bool:
    """Whether Dynamo is tracing this call (``torch.compiler.is_compiling``; older torch: ``torch._dynamo``'s)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling
    return bool(check())


def expert_counts(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many of ``chosen``'s entries name each expert. ``torch.bincount`` sizes its output from the
    largest value, which on an accelerator is a host read and in a compiled graph a data-dependent shape; a
    scatter-add into E zeros is neither."""
    return torch.zeros(num_experts, dtype=torch.int64, device=chosen.device).scatter_add_(
        0, chosen, torch.ones_like(chosen, dtype=torch.int64))


def experts_outside_the_graph(ep: int, device_type: str, grouped: bool = True, matmul: torch.dtype | None = None) -> str:
    """Why a compiled MoE layer's experts will run eagerly between its graphs ('' where they can be in it): the ep
    exchange, or the experts' loop (off CUDA, or a matmul dtype the traced grouped matmul refuses). ``matmul``: the
    experts' matmul dtype where known (None: decided at the first forward, which says so). One rule for
    ``compile_layers`` and ``hal train``'s preflight."""
    if ep > 1:
        return "the expert-parallel exchange runs eagerly: it moves other ranks' rows and reads its splits on the host"
    if not grouped or device_type != "cuda":
        return (f"the experts run as a loop on {device_type}, which reads the block sizes on the host; "
                "torch._grouped_mm is used on CUDA only")
    if matmul is not None and matmul != torch.bfloat16:
        return (f"torch._grouped_mm's traced kernel takes bf16 only, so in {str(matmul).replace('torch.', '')} the "
                "experts run as a loop that reads the block sizes on the host")
    return ""


@eager_when_compiled
def _loop_experts(experts: Experts, rows: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """The experts as a loop over their blocks: the block sizes are read on the host, so inside a compiled layer
    this runs eagerly (one graph break, not a recompile for every new split)."""
    return experts(rows, load.tolist(), "loop")


class MoE(nn.Module):
    """The MoE feed-forward block: ``forward(x)`` → (output of x's shape, MoEStats)."""

    def __init__(self, hidden: int, config: MoEConfig, *, grouped: bool = True,
                 out_std: float = DEFAULT_STD / math.sqrt(2), ep_group: Any = None, tp_comm: TPComm = None,
                 sequence_parallel: bool = False) -> None:
        """``ep_group``: the expert-parallel group (a Communicator) this rank shares the experts with; each of its
        ranks holds num_experts / size of them, in rank order (None or size 1: every expert here). ``tp_comm``:
        the stage's TP group; the experts' (and the shared expert's) FFN width is split over it. The router is
        replicated: every TP rank routes the same tokens the same way. Each rank weights its experts' partial
        outputs by the routing weights and adds its shared-expert share, and the block's output is summed over
        TP once (T × H values, not the T × k × H of summing the experts' rows); the routing weights enter
        through a copy whose backward sums their gradient over TP, so the router's gradient is the whole one
        on every rank. ``sequence_parallel``: the input is this rank's slice of the sequence; the block gathers
        the sequence (the router and the split experts need every token) and the TP sum is a reduce-scatter
        back to the slices."""
        super().__init__()
        self.sequence_parallel = sequence_parallel and tp_size(tp_comm) > 1
        self.config = config
        self.grouped = grouped
        self.ep_group = ep_group if ep_group is not None and ep_group.size > 1 else None
        self.tp_comm = tp_comm
        shards = self.ep_group.size if self.ep_group is not None else 1
        if config.num_experts % shards:
            raise ValueError(f"moe: ep {shards} does not divide num_experts {config.num_experts}")
        self.router = Router(hidden, config)
        self.experts = Experts(hidden, config.expert_ffn_size, config.num_experts, out_std=out_std, shards=shards,
                               tp=tp_size(tp_comm))
        self.shared = (SharedExpert(hidden, config.shared_ffn_size, config.shared_gate, out_std=out_std, tp_comm=tp_comm)
                       if config.shared_ffn_size else None)
        self.path: ExpertPath | None = None  # which expert path the last forward took
        self.compiled = False  # inside a compiled layer (``compile_layers`` sets it): the experts' path must trace
        self.exchange: str | None = None  # under ep: which exchange the last forward took (symmetric or all_to_all)
        self.exchange_reason = ""
        self._exchange_choices: dict[tuple[Any, ...], tuple[str, str]] = {}
        # The ranks whose tokens together make one micro-batch (a stage's dp replicas): the balancing loss's
        # routed shares f_e are counted over all of them, so a data-parallel run computes the balancing
        # loss of the whole micro-batch, as one device would (one all-reduce of E counts per forward).
        self.balance_group: Any = None

    def _path(self, x: torch.Tensor) -> ExpertPath:
        """``grouped_mm`` where the grouped matmul runs for the matmuls' dtype (in a compiled layer: runs traced),
        else ``loop``; a downgrade said (in the eager first forward a compiled stage runs) where it was expected."""
        if not self.grouped:
            return "loop"
        dtype = matmul_dtype(x)
        if compiling():
            return "grouped_mm" if grouped_mm_traces(x.device, dtype) else "loop"
        if not grouped_mm_works(x.device, dtype):
            if x.device.type == "cuda":  # asked for and expected to run: say that it did not
                record_downgrade(Downgrade("op", f"moe experts on {x.device.type}/{str(dtype).replace('torch.', '')}",
                                           "grouped_mm", "loop", "torch._grouped_mm does not run for this device and dtype"))
            return "loop"
        if self.compiled and not grouped_mm_traces(x.device, dtype):
            record_downgrade(Downgrade("op", f"compile of MoE experts on {x.device.type}/{str(dtype).replace('torch.', '')}",
                                       "the grouped matmul in the compiled layer",
                                       "the experts' loop, eager between the layer's graphs",
                                       "torch._grouped_mm's traced kernel does not take this dtype (bf16 does)"))
        return "grouped_mm"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        if self.sequence_parallel:
            x = gather_to_replicated_region(x, self.tp_comm)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        T, E, k = tokens.shape[0], self.config.num_experts, self.config.top_k
        experts, weights, probs, logits = self.router(tokens)
        flat = experts.reshape(-1)  # (T·k,) the expert of each (token, choice) pair
        ep = self.ep_group.size if self.ep_group is not None else 1
        load = expert_counts(flat, E)
        self.path = self._path(tokens)
        # under ep (all-to-all path) the count exchange starts now: its latency hides behind the sort and the gather below
        counts = self._start_exchange(T * k, tokens, load) if self.ep_group is not None else None
        # pairs grouped by expert (in dispatch's block order under ep), token order kept inside a group
        order = torch.argsort(dispatch_key(flat, ep, E // ep), stable=True)
        rows = copy_to_tp_region(tokens[order // k], self.tp_comm)  # each pair's token, in that order
        if self.ep_group is None and self.path == "grouped_mm":  # no host read: the offsets stay on the device
            out_sorted = self.experts(rows, load.cumsum(0).to(torch.int32), self.path)
        elif self.ep_group is None:
            out_sorted = _loop_experts(self.experts, rows, load)
        else:
            out_sorted = self._expert_parallel(rows, flat[order], load, counts)
        pair_out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)  # back to (token, choice) order
        # TP-split experts give partial sums: weighted here, summed over TP once below
        out = (pair_out.view(T, k, -1) * copy_to_tp_region(weights, self.tp_comm).unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(shape)
        out = (reduce_scatter_to_seq_region(out, self.tp_comm) if self.sequence_parallel
               else reduce_from_tp_region(out, self.tp_comm))
        routed = (self._routed_over_balance_group(load) if self.balance_group is not None and self.balance_group.size > 1
                  else load)
        stats = MoEStats(load_balancing_loss(probs, flat, E, T * k, self.config.scoring, routed=routed),
                         z_loss(logits), load)
        return out, stats

    @eager_when_compiled
    def _routed_over_balance_group(self, load: torch.Tensor) -> torch.Tensor:
        """The routed pairs per expert summed over the balance group (one all-reduce; eager inside a compiled layer)."""
        routed = load.clone()
        self.balance_group.all_reduce(routed, "sum")
        return routed

    @eager_when_compiled
    def _start_exchange(self, pairs: int, tokens: torch.Tensor, load: torch.Tensor) -> CountExchange | None:
        """Under ep: pick the exchange (``exchange``) and, for the all-to-all path, start the count exchange."""
        self.exchange = self._exchange_path(pairs, tokens)
        return CountExchange(load, self.ep_group, self.config.num_experts // self.ep_group.size) if self.exchange == "all_to_all" else None

    def _exchange_path(self, rows: int, tokens: torch.Tensor) -> str:
        """``symmetric`` (CUDA symmetric memory, no host read) or ``all_to_all`` (counts read on the host, then
        the Communicator's all-to-alls): decided once per shape, the same on every rank of the group
        (``hal.collectives.symmetric_exchange.choose``). The symmetric path needs the grouped matmul (its offsets
        stay on the device); the choice and its reason are ``exchange`` and ``exchange_reason``."""
        key = (rows, tokens.shape[-1], tokens.dtype, self.path)
        if key not in self._exchange_choices:
            if self.path != "grouped_mm":
                self._exchange_choices[key] = ("all_to_all", "the experts run as a loop, which needs the counts on the host")
            else:
                self._exchange_choices[key] = choose_exchange(self.ep_group, rows, tokens.shape[-1], tokens.dtype)
        path, self.exchange_reason = self._exchange_choices[key]
        return path

    @eager_when_compiled
    def _expert_parallel(self, rows: torch.Tensor, experts_sorted: torch.Tensor, load: torch.Tensor,
                         counts: CountExchange | None) -> torch.Tensor:
        """The experts' outputs for ``rows`` (sorted by ``dispatch_key``) when the experts are spread over the ep
        group: over symmetric memory (no host read) or the all-to-alls (``counts`` started). Eager inside a
        compiled layer: the exchanges are other ranks' business and the all-to-all splits are host values."""
        if self.exchange == "symmetric":
            exchange = exchange_for(self.ep_group, rows.shape[0], rows.shape[1], rows.dtype, self.config.num_experts)
            arrived, route = exchange.dispatch(rows, experts_sorted, load)
            return exchange.combine(self.experts(arrived, route.offsets, self.path), route)
        local = self.config.num_experts // self.ep_group.size
        arrived, blocks = dispatch(rows, counts, self.ep_group, local)
        return combine(self.experts(arrived, blocks.counts, self.path), blocks)

    def loss(self, stats: MoEStats) -> torch.Tensor:
        """The auxiliary terms to add to the language-model loss, with the config's weights."""
        return self.config.aux_loss_weight * stats.aux_loss + self.config.z_loss_weight * stats.z_loss


@dataclass
class Route:
    """What ``dispatch`` did, for ``combine`` to undo: the rows of each (local expert, rank) block both ways."""

    send_blocks: list[list[int]]  # [j][r]: rows this rank sent to rank r's local expert j
    recv_blocks: list[list[int]]  # [j][s]: rows rank s sent to this rank's local expert j
    counts: list[int]  # rows per local expert, as they arrived
    comm: Any

    @property
    def send_splits(self) -> list[int]:
        """Rows sent to each rank, all its experts together."""
        return [sum(col) for col in zip(*self.send_blocks)]

    @property
    def recv_splits(self) -> list[int]:
        """Rows received from each rank, all this rank's experts together."""
        return [sum(col) for col in zip(*self.recv_blocks)]


def dispatch_key(experts: torch.Tensor, ep: int, experts_per_rank: int) -> torch.Tensor:
    """The sort key of routed pairs before ``dispatch``: local expert index first, then the rank holding it.

    Global expert e lives on rank e // local as its local expert e % local. Sorted by (e % local, rank), each
    local expert's rows for all ranks are one contiguous block whose per-rank pieces are in rank order: one
    all-to-all per local expert sends them, and what arrives is already grouped by expert (every source's rows
    for expert 0, then expert 1, ...), so no regrouping gather runs on either side. With ep = 1 this is e."""
    if ep == 1:
        return experts
    return (experts % experts_per_rank) * ep + experts // experts_per_rank


class CountExchange:
    """Every rank's per-expert counts, gathered early so the latency hides behind the caller's work (the MoE
    block sorts and gathers its rows meanwhile); ``dispatch`` reads it.

    One all-gather of the (E,) counts gives every rank the whole (ep, E) table, from which both its send and
    its receive blocks follow. On 4 x H200 (NCCL) a bare all-gather and host read took 0.11-0.13 ms where the
    all-to-all of (ep, local) blocks it replaced took 0.14-0.17 ms; a whole dispatch + combine of 4096 tokens a
    rank went from 0.90 ms to 0.57-0.71 ms (benchmarks/moe.py, same machine)."""

    def __init__(self, load: torch.Tensor, comm: Any, experts_per_rank: int) -> None:
        self.comm, self.local = comm, experts_per_rank
        self._table = comm.all_gather(load.reshape(1, -1), async_op=True)  # [s][e]: rank s's pairs for expert e

    def blocks(self) -> tuple[list[list[int]], list[list[int]]]:
        """(send_blocks [j][r], recv_blocks [j][s]): the one host read."""
        table = self._table.wait().cpu().tolist()
        ep, local, me = self.comm.size, self.local, self.comm.group_rank
        return ([[table[me][r * local + j] for r in range(ep)] for j in range(local)],
                [[table[s][me * local + j] for s in range(ep)] for j in range(local)])


def dispatch(rows: torch.Tensor, counts: CountExchange | torch.Tensor, comm: Any,
             experts_per_rank: int) -> tuple[torch.Tensor, Route]:
    """Send ``rows`` (sorted by ``dispatch_key``) to the ranks holding their experts; the rows this rank's
    experts get, grouped by expert.

    ``counts``: the started ``CountExchange`` of the per-expert counts (E = ep × experts_per_rank), or the
    counts themselves (``load``: exchanged here). Then one all-to-all of uneven splits per local expert moves
    the rows straight into their expert's block. The exchanges are an autograd function: the backward runs
    them in reverse (``Communicator.all_to_all_blocks``: one grouped launch on NCCL)."""
    if isinstance(counts, torch.Tensor):
        counts = CountExchange(counts, comm, experts_per_rank)
    send_blocks, recv_blocks = counts.blocks()
    arrived = _BlockAllToAll.apply(rows, send_blocks, recv_blocks, comm)
    return arrived, Route(send_blocks, recv_blocks, [sum(b) for b in recv_blocks], comm)


def combine(out_local: torch.Tensor, route: Route) -> torch.Tensor:
    """The experts' outputs (in ``dispatch``'s arrival order) back on the ranks and in the places their rows came from."""
    return _BlockAllToAll.apply(out_local, route.recv_blocks, route.send_blocks, route.comm)


class _BlockAllToAll(torch.autograd.Function):
    """``Communicator.all_to_all_blocks`` as an autograd function; its backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, send_blocks: list[list[int]],
                recv_blocks: list[list[int]], comm: Any) -> torch.Tensor:
        ctx.blocks, ctx.comm = (send_blocks, recv_blocks), comm  # type: ignore[attr-defined]
        return comm.all_to_all_blocks(x.contiguous(), send_blocks, recv_blocks)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_blocks, recv_blocks = ctx.blocks  # type: ignore[attr-defined]
        return ctx.comm.all_to_all_blocks(grad.contiguous(), recv_blocks, send_blocks), None, None, None  # type: ignore[attr-defined]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activations; in backward, the auxiliary loss receives ``scale`` as its gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad, torch.full_like(aux, ctx.scale), None  # type: ignore[attr-defined]


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged, with ``scale · aux`` added to whatever loss ``x`` flows into, for the gradient.

    Why: in a pipeline the language-model loss exists only on the last stage, but an MoE layer's auxiliary
    loss is made on whichever stage holds the layer. Riding on the activations' backward (as Megatron-Core
    does) gives every stage's router its aux-loss gradient in the same backward pass, under any schedule,
    with nothing sent between stages. ``scale`` carries the loss weight and the micro-batch average."""
    return _AttachAuxLoss.apply(x, aux, scale)


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int, pairs: int,
                        scoring: Scoring = "softmax", routed: torch.Tensor | None = None) -> torch.Tensor:
    """E · Σ_e f_e · P_e: f_e the share of routed pairs that went to e (no gradient), P_e the mean probability
    of e over tokens (with gradient). 1.0 when routing is even and the router agrees; up to E when one
    expert takes everything. Sigmoid scores do not sum to 1: their means are compared as shares.
    ``routed``: pairs per expert counted over more ranks than this one (then f_e is their share)."""
    if routed is not None:
        f = routed.float() / routed.sum().clamp_min(1).float()
    else:
        f = expert_counts(chosen, num_experts).float() / max(pairs, 1)
    p = probs.mean(dim=0)
    if scoring == "sigmoid":
        p = p / p.sum().clamp_min(1e-20)
    return num_experts * torch.sum(f * p)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)², which keeps the logits small."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean() if logits.shape[0] else logits.sum() * 0.0
