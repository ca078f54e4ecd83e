"""The pipeline engine: one rank's share of a training step under any registered schedule (``parallel.schedules``).

Each rank runs its stage's module on the micro-batches its (stage, dp) coordinate owns.
Activations cross stage boundaries through ``parallel.pipeline.reshard`` (slice intersection, batched P2P,
the collectives bridge between islands); gradients return the same way. What a rank does, in which
order, is data: the plan's schedule (GPipe, 1F1B, interleaved, the zero-bubble family, DualPipeV: one file each
in ``parallel.schedules``) gives each stage a program of compute actions and P2P batches, and ``step_lazy``
executes it, whatever the schedule. 1F1B, for example, follows Megatron's
non-interleaved structure: warm-up forwards, a steady phase whose sends and receives are posted
together (``send_forward_recv_backward`` / ``send_backward_recv_forward``, so blocking P2P cannot
deadlock), and cool-down backwards. Batches that only send are left in flight while the rank
computes on (``_post``) and waited for at the end of the schedule.

Timing: every step fills ``engine.times`` (``StepTimes``): forward/backward compute, time inside boundary
send/recv (transfer plus waiting for the neighbour stage), the dp gradient sync, and the schedule's wall
time, through ``engine.timer`` (``parallel.observe.phase_timer``). On the CPU the host clock is exact. On an
accelerator set ``engine.measure_on_device = True`` (``hal train --profile``): the phases are then device
events read once at the end of the step, so the step is not slowed by a synchronization per phase.
Each compute and P2P interval carries the schedule step it ran (a reference, no extra work): the
step's timeline, ``engine.step_spans()`` (``parallel.observe.timeline``), is read from those on demand.

What the engine is handed: (stage, mesh, schedule, loss) -- the rank's module, its communicators and topology
(``parallel.pipeline.mesh``), the plan's ``Schedule`` and the loss function; ``parallel.pipeline.build`` makes
all four from a model, a plan and a mesh.

Loss convention (``parallel.pipeline.reshard`` explains why): the last stage returns logits and the engine
applies ``loss_fn`` (``parallel.models.loss``); a micro-batch's loss is its token sum over the token count of
the whole micro-batch, divided by the number of micro-batches; weight gradients are
then SUMMED over a stage's dp replicas (bucketed all-reduce), so every split computes the gradient of
the same global loss.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Literal

import torch

from hal.backend import Backend
from hal.collectives import Communicator
from hal.parallel.models.layers import expert_shard
from hal.parallel.models.linear import fp8_matmuls
from hal.parallel.models.loss import LossFn
from hal.parallel.models.stage import Stage, sync_tied_embedding_grads
from hal.parallel.models.weight_grad import WeightGradStore, collecting, splittable
from hal.parallel.observe.phase_timer import PhaseTimer
from hal.parallel.pipeline.compile_stage import eager_first_forward
from hal.parallel.pipeline.mesh import Mesh
from hal.parallel.pipeline.pairs import PairRunner
from hal.parallel.pipeline.reshard import Boundary, Layout, p2p_ops
from hal.parallel.schedules import Action, Kind, Overlap, P2PBatch, Schedule
from hal.parallel.schedules.pairs import stage_pairs
from hal.parallel.schedules.placement import neighbours

BUCKET_BYTES = 16 * 2**20
# Who sums a rank's gradients over its dp group: the engine after the backward, the optimizer inside its step
# (ZeRO-1's reduce-scatter), or the replicas' exchange during the backward (``replicas.replica_set.dp_grad_sum``).
DpGradSum = Literal["engine", "optimizer", "backward"]


@dataclass
class _InFlight:
    """A micro-batch whose forward ran here (through one model chunk) and whose backward is pending."""

    inputs: torch.Tensor | None  # received activation (requires grad), None for the model's first chunk
    output: torch.Tensor  # the chunk's output (or the scaled loss after the model's last chunk)
    is_loss: bool = False  # the output is the loss: its backward starts the gradient


Key = tuple[int, int]  # (chunk, micro-batch): what per-micro-batch state is filed under


@dataclass
class _Posted:
    """A batch posted without waiting (interleaved programs): its receives are claimed by the computes that need them."""

    handle: Any
    receives: list[tuple[Any, Any]]  # (receive action, its PostedOps)
    results: dict[tuple[Kind, int, int], torch.Tensor] | None = None


@dataclass
class StepTimes:
    """Seconds spent per category in one step on this rank (compute vs waiting on P2P).

    ``schedule`` is the wall time of the forward/backward schedule (everything but ``grad_sync``);
    ``schedule - compute - p2p`` is what this rank spent neither computing nor in send/recv.
    ``optimizer`` and ``step`` are filled by a caller that times them through the same timer.
    """

    compute: float = 0.0
    p2p: float = 0.0
    grad_sync: float = 0.0
    schedule: float = 0.0
    optimizer: float = 0.0
    step: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_totals(cls, totals: dict[str, float], counts: dict[str, int]) -> StepTimes:
        known = {name: totals[name] for name in ("compute", "p2p", "grad_sync", "schedule", "optimizer", "step") if name in totals}
        return cls(**known, counts=dict(counts))


class PipelineEngine:
    """This rank's stage module and the schedule that drives it."""

    def __init__(
        self, stage: Stage, mesh: Mesh, schedule: Schedule, loss_fn: LossFn, *, micro_batches: int,
        micro_batch_size: int, seq_len: int, backend: Backend, device: torch.device, dtype: torch.dtype = torch.float32,
        autocast: Callable[[], ContextManager[Any]] | None = None, fp8_dtype: torch.dtype | None = None,
    ) -> None:
        """``stage``: this rank's module, built over ``mesh``'s groups (``build_engine`` makes one from a plan).
        ``mesh``: this rank's communicators and topology (``parallel.pipeline.mesh``). ``schedule``: the plan's.
        ``loss_fn(logits, labels)``: one micro-batch's loss on the last stage, a term of the global mean (the
        engine divides it by ``micro_batches``). ``backend``: this rank's backend object (timing synchronizes it).
        ``dtype``: the weights' and boundary activations' dtype. ``autocast``: a factory of the forward region's
        autocast context (``PrecisionPlan.autocast``); backward runs outside it. ``fp8_dtype``: an fp8-mixed
        stage's format: its decoder layers' forward matmuls run in it (``parallel.models.linear``)."""
        self.module, self.mesh, self.schedule, self.loss_fn = stage, mesh, schedule, loss_fn
        self.micro_batches, self.micro_batch_size, self.seq = micro_batches, micro_batch_size, seq_len
        topology = mesh.topology
        self.coord = mesh.coord
        self.rank = mesh.stage.rank  # global rank (transfer plans use global ranks)
        self.layout = mesh.layout  # this stage's grid, layers and options
        self.first, self.last = mesh.first, mesh.last  # the model's first chunk (embedding), its last (head, loss)
        self.backend, self.device, self.dtype = backend, device, dtype
        self.autocast = autocast or contextlib.nullcontext
        self.fp8_dtype = fp8_dtype
        self.chunks = topology.virtual_stages  # model chunks this stage runs (interleaved schedules: > 1)
        # Each chunk's first forward runs eagerly (compile_stage): it fills the op caches and keeps its layers' rotary
        # tables, which a compiled layer then reads instead of tracing them (every chunk holds layers of its own).
        self._eager_chunks = set(range(self.chunks)) if self.layout.compile else set()
        # MoE layers: one forward is 1 / (M × dp) of the step's loss (as a replica's micro-batch LM loss), and
        # the balancing loss counts routed tokens over the dp replicas that split each micro-batch.
        self._moe_share = 1.0 / (micro_batches * self.layout.dp)
        self._moe_group = mesh.balance_group
        self.module.configure_moe(self._moe_share, self._moe_group)
        if self.module.needs_tied_grad_sync and mesh.embedding is None:
            raise ValueError("tied embeddings over several stages need the embedding group: build_mesh(..., tied_embeddings=True)")
        layouts = [Layout.contiguous(m.dp, m.tp, m.sp, m.offset) for m in topology.stages]
        mbs = micro_batch_size
        k, S, V = self.coord.stage, topology.num_stages, self.chunks
        # Per chunk: the boundary its input arrives over and the one its output leaves over, from the
        # virtual stages before and after it (``schedules.placement``). None: the model's end, or the
        # neighbour chunk is on this stage (the V's turn), whose tensors are handed over in memory.
        self.recv_boundaries: list[Boundary | None] = []
        self.send_boundaries: list[Boundary | None] = []
        self.local_prev: list[int | None] = []  # the chunk of this stage feeding chunk v, if one does
        for v in range(V):
            before, after = neighbours(k, v, S, V, topology.placement)
            self.local_prev.append(before[1] if before is not None and before[0] == k else None)
            self.recv_boundaries.append(None if before is None or before[0] == k else
                                        Boundary(layouts[before[0]], layouts[k], mbs, self.seq))
            self.send_boundaries.append(None if after is None or after[0] == k else
                                        Boundary(layouts[k], layouts[after[0]], mbs, self.seq))
        self.rows = slice(self.coord.dp * mbs // self.layout.dp, (self.coord.dp + 1) * mbs // self.layout.dp)
        # This rank's actions for every step: the plan fixes the stage, the stage count, M and V.
        self.program = self.schedule.program(S, micro_batches, k, V)
        # DualPipeV's pairs: at once on a worker thread where the stage allows it (``parallel.pipeline.pairs``)
        # "at once", or "in turn: " and why (the rule hal train and hal plan say: ``schedules.pairs``); None: no pairs
        self.pair_overlap = stage_pairs(self.schedule, S, micro_batches, self.layout, stage.config)
        self._pairs = PairRunner(backend, device) if self.pair_overlap == "at once" else None
        self._pairs_at_once = True  # False: a benchmark's baseline runs them in turn (``run_pairs_at_once``)
        self.timer = PhaseTimer(backend)  # host clock; device events once measure_on_device is set
        self._times: StepTimes | None = None  # the last step's breakdown, read from the timer on demand
        self._step_origin: Any = None  # the timer's mark at the last step's schedule start (step_spans)
        self._sends_in_flight: list[Any] = []  # Handles of pure-send batches not yet waited on
        self._weight_grads: dict[Key, WeightGradStore] = {}  # split backwards: W halves still to run
        self._deferred: dict[tuple[Kind, int, int], _Posted] = {}  # receives posted, not yet claimed (interleaved)
        self._output_like: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # per chunk: what its forward sends on
        self.loss_scale = 1.0  # the pipeline's dynamic loss scale (parallel.loop.loss_scale), applied by the last stage
        # Who sums the gradients over dp, one answer set once by the rank's setup (``replicas.replica_set.dp_grad_sum``):
        # "engine" (here, after the backward), "optimizer" (ZeRO-1's reduce-scatter: half the traffic of the
        # all-reduce; p.grad then holds this replica's part only) or "backward" (the replicas' exchange, during it).
        self.dp_grads: DpGradSum = "engine"

    def run_pairs_at_once(self, on: bool) -> None:
        """From the next step, DualPipeV's pairs at once (where ``pair_overlap`` says the stage can) or one after
        the other: the same engine and weights both ways, for a benchmark's baseline."""
        self._pairs_at_once = on

    @property
    def pairs_run(self) -> int:
        """DualPipeV pairs this engine ran at once so far (0 where they run one after the other)."""
        return 0 if self._pairs is None else self._pairs.ran

    # --- timing -------------------------------------------------------------------------------------
    @property
    def measure_on_device(self) -> bool:
        """Whether phases are device events (an accelerator under ``--profile``); the host clock otherwise."""
        return self.timer.mode == "events"

    @measure_on_device.setter
    def measure_on_device(self, on: bool) -> None:
        self.timer.mode = "events" if on and self.device.type != "cpu" else "host"

    @property
    def times(self) -> StepTimes:
        """The last step's breakdown (with device events, the first read waits for the step to finish)."""
        if self._times is None:
            self._times = StepTimes.from_totals(self.timer.totals(), self.timer.counts)
        return self._times

    def _timed(self, category: str, label: Any = None) -> ContextManager[None]:
        """Count the enclosed region under ``category`` (see ``times``); ``label``: the schedule step it runs."""
        self._times = None
        return self.timer.phase(category, label)

    def step_spans(self, origin: Any = None) -> list[Any]:
        """The last step's labelled intervals (``PhaseTimer.spans``): the schedule, each compute action and
        P2P post or wait, the gradient sync; in seconds after ``origin`` (a timer mark; default: the
        schedule's start). With device events this is the step's one wait (as ``times`` is)."""
        origin = self._step_origin if origin is None else origin
        return [] if origin is None else self.timer.spans(origin)

    # --- data --------------------------------------------------------------------------------------
    def _inputs(self, tokens: torch.Tensor, m: int) -> torch.Tensor:
        return tokens[m, self.rows, :-1].to(self.device)

    def _labels(self, tokens: torch.Tensor, m: int) -> torch.Tensor:
        return tokens[m, self.rows, 1:].to(self.device)

    def _tokens_on_device(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens on this rank's device, in one asynchronous copy (a first or last stage only).

        Why: a pageable host tensor copied per micro-batch makes the host wait until the device
        drained everything queued before it (twice per micro-batch on a stage holding both ends),
        so the launch of the next kernels is no longer hidden behind the running ones. One pinned,
        non-blocking copy per step keeps the queue full.
        """
        if tokens.device == self.device or not (self.first or self.last):
            return tokens
        if self.device.type != "cpu" and tokens.device.type == "cpu":
            tokens = self.backend.pinned(tokens)  # a non-blocking copy from pageable memory would still block
        return tokens.to(self.device, non_blocking=True)

    # --- point to point -------------------------------------------------------------------------------
    def _post(self, comm: Communicator | None, *posted: Any, label: Any = None) -> list[Any]:
        """Post ``posted`` in one batch; wait for it only when it receives something.

        A batch of pure sends is left in flight (``_sends_in_flight``) so this rank goes on computing
        while the neighbour receives — the overlap torch.distributed.pipelining's schedules also do.
        Its buffers stay referenced by the handle until ``_drain_sends`` waits at the end of the
        schedule. A batch with a receive is waited on at once: the next compute needs its data (on
        NCCL that wait orders the compute stream after the transfer; the host does not block).
        """
        ops = [op for p in posted if p is not None for op in p.ops]
        if not ops:
            return [None if p is None else p.finish() for p in posted]
        assert comm is not None
        with self._timed("p2p", label):
            if all(op.kind == "send" for op in ops):
                self._sends_in_flight.append(comm.batch_p2p(ops, async_op=True))
                return [None for _ in posted]
            comm.batch_p2p(ops)
            return [None if p is None else p.finish() for p in posted]

    def _drain_sends(self) -> None:
        """Wait for every send still in flight (the end of a schedule: nothing may outlive the step)."""
        if not self._sends_in_flight:
            return
        with self._timed("p2p", "wait for sends"):
            for handle in self._sends_in_flight:
                handle.wait()
            self._sends_in_flight.clear()

    def _recv_fwd_ops(self, chunk: int = 0) -> Any:
        b = self.recv_boundaries[chunk]
        return None if b is None else p2p_ops(b.forward, self.rank, tail=(self.module.config.hidden_size,),
                                               dtype=self.dtype, device=self.device)

    def _send_fwd_ops(self, out: torch.Tensor, chunk: int = 0) -> Any:
        b = self.send_boundaries[chunk]
        return None if b is None else p2p_ops(b.forward, self.rank, out)

    def _recv_bwd_ops(self, like: torch.Tensor, chunk: int = 0) -> Any:
        b = self.send_boundaries[chunk]
        if b is None:
            return None
        return p2p_ops(b.backward, self.rank, tail=tuple(like.shape[2:]), dtype=like.dtype,
                       device=self.device, accumulate=b.accumulate_grads)

    def _send_bwd_ops(self, grad: torch.Tensor | None, chunk: int = 0) -> Any:
        b = self.recv_boundaries[chunk]
        return None if b is None or grad is None else p2p_ops(b.backward, self.rank, grad)

    # --- one micro-batch ---------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, key: Key, received: torch.Tensor | None, label: Any = None) -> _InFlight:
        with self._timed("compute", label):
            return self._forward_untimed(tokens, key, received)

    def _forward_untimed(self, tokens: torch.Tensor, key: Key, received: torch.Tensor | None) -> _InFlight:
        warmup = eager_first_forward() if key[0] in self._eager_chunks else contextlib.nullcontext()
        self._eager_chunks.discard(key[0])
        with self.autocast(), warmup, self._linear_settings():
            item = self._forward_stage(tokens, key, received)
        return self._forwarded(key, item)

    @contextlib.contextmanager
    def _linear_settings(self) -> Iterator[None]:
        """What this stage's linears are while it forwards: splittable (zero-bubble family), fp8 (fp8-mixed).
        Module-wide settings, not a thread's: a recompute in the backward runs on autograd's thread."""
        with splittable(self.schedule.splits_backward), fp8_matmuls(self.fp8_dtype):
            yield

    def _forwarded(self, key: Key, item: _InFlight) -> _InFlight:
        """A forward's result as the boundary carries it, its shape noted for the time_links probe."""
        if not item.is_loss and item.output.dtype != self.dtype:
            # The boundary carries ``dtype`` (the receiver allocates it); autocast may have produced less.
            item = _InFlight(item.inputs, item.output.to(self.dtype))
        if not item.is_loss:
            self._output_like[key[0]] = (tuple(item.output.shape), item.output.dtype)
        return item

    def _forward_stage(self, tokens: torch.Tensor, key: Key, received: torch.Tensor | None) -> _InFlight:
        chunk, m = key
        # One chunk: call the module itself (its forward hooks fire, as for any nn.Module).
        run = self.module if self.chunks == 1 else functools.partial(self.module.forward_chunk, chunk=chunk)
        if self.first and chunk == 0:
            x: torch.Tensor | None = None
            out = run(self._inputs(tokens, m))
        else:
            assert received is not None
            x = received.requires_grad_(True)
            out = run(x)
        if self.last and chunk == self.chunks - 1:
            return _InFlight(x, self.loss_fn(out, self._labels(tokens, m)) / self.micro_batches, True)
        return _InFlight(x, out)

    def _backward(self, item: _InFlight, grad: torch.Tensor | None, label: Any = None) -> torch.Tensor | None:
        with self._timed("compute", label):
            return self._backward_untimed(item, grad)

    def _backward_input(self, key: Key, item: _InFlight, grad: torch.Tensor | None, label: Any = None) -> torch.Tensor | None:
        """The input-gradient half of a split backward: the linear layers' weight gradients wait in a store."""
        store = self._weight_grads.setdefault(key, WeightGradStore())
        with self._timed("compute", label), collecting(store):
            return self._backward_untimed(item, grad)

    def _backward_weight(self, key: Key, label: Any = None) -> None:
        """The weight-gradient half: the products the input half left in that micro-batch's store."""
        with self._timed("compute", label):
            self._weight_grads.pop(key).run()

    def _backward_untimed(self, item: _InFlight, grad: torch.Tensor | None) -> torch.Tensor | None:
        if item.is_loss:
            # fp16 anywhere in the pipeline: the loss is scaled here, once, and every gradient with it
            (item.output * self.loss_scale if self.loss_scale != 1.0 else item.output).backward()
        else:
            assert grad is not None
            item.output.backward(grad)
        return None if item.inputs is None else item.inputs.grad

    # --- the schedule ---------------------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor) -> float | None:
        """Forward and backward every micro-batch of ``tokens`` (M, micro_batch_size, S+1); sync gradients.

        Returns the step's loss on last-stage ranks (the mean over all tokens), None elsewhere.
        """
        loss = self.step_lazy(tokens)
        return None if loss is None else float(loss.item())

    def step_lazy(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """``step`` without reading the loss back: a 1-element float64 tensor on the device (last stage).

        Reading a device value makes the host wait for the whole step, so the next step's first
        kernels are queued only after the device ran dry; throughput loops read losses later.
        """
        self.timer.reset()
        self._times = None
        self._step_origin = start = self.timer.mark()
        # the auxiliary MoE losses' gradients carry the step's loss scale, as the language-model loss's do
        self.module.configure_moe(self._moe_share * self.loss_scale, self._moe_group)
        losses = self._execute(tokens)
        self.timer.add("schedule", start, self.timer.mark(), "schedule")
        with self._timed("grad_sync", "grad sync"):
            self._fill_idle_experts()
            if self.dp_grads == "engine":
                self._sync_dp_grads()
            if self.module.needs_tied_grad_sync:
                sync_tied_embedding_grads(self.module, self.mesh.embedding)
        return self._step_loss(losses)

    def set_micro_batches(self, micro_batches: int) -> None:
        """Run ``micro_batches`` a step from now on (a replica's share re-balanced mid-run): the program and the MoE
        losses' share follow. The caller checked that the schedule accepts the count (``Schedule.problem``)."""
        S, k, V = self.mesh.topology.num_stages, self.coord.stage, self.chunks
        self.micro_batches = micro_batches
        self._moe_share = 1.0 / (micro_batches * self.layout.dp)
        self.program = self.schedule.program(S, micro_batches, k, V)

    def set_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` from the next step on: the plan's schedule with its order played from measured times
        (``parallel.order: measured``). Every rank of the pipeline switches at the same step, or their programs
        would not pair."""
        S, k, V = self.mesh.topology.num_stages, self.coord.stage, self.chunks
        self.program = schedule.program(S, self.micro_batches, k, V)
        self.schedule = schedule

    def action_times(self) -> dict[tuple[Kind, int], float]:
        """The last step's mean seconds per (compute kind, chunk) on this rank, from its labelled compute spans
        (device time where ``measure_on_device`` was set for the step; host time otherwise)."""
        durations: dict[tuple[Kind, int], list[float]] = {}
        for span in self.step_spans():
            if span.phase == "compute" and isinstance(span.label, Action) and span.label.kind.is_compute:
                durations.setdefault((span.label.kind, span.label.chunk), []).append(span.end - span.start)
        return {key: sum(values) / len(values) for key, values in durations.items()}

    def time_links(self, repeats: int = 3) -> float | None:
        """Seconds one micro-batch's activation takes over the boundary to the next stage: chunk 0's forward send
        and the gradient back, timed as a round trip and halved, the median of ``repeats`` after one warm-up;
        None on a stage with no next boundary. Collective over the pipeline: every rank calls it after a step
        (which sized the activations). A stage takes its boundary with the previous stage first, then the next,
        so the exchanges chain from the first stage and never wait in a circle."""
        rounds = repeats + 1
        k, S = self.coord.stage, self.mesh.topology.num_stages
        # chunk 0 crosses boundary k -> k+1 under both placements; a loop's last chunk 0 goes round the wrap link instead
        if k > 0 and self.recv_boundaries[0] is not None:  # the far end of the previous stage's timing
            for _ in range(rounds):
                (given,) = self._post(self.mesh.prev_boundary, self._recv_fwd_ops(0))
                self._post(self.mesh.prev_boundary, self._send_bwd_ops(None if given is None else torch.zeros_like(given), 0))
            self._drain_sends()
        if k == S - 1 or self.send_boundaries[0] is None:
            return None
        if 0 not in self._output_like:
            raise RuntimeError("time_links runs after a step: no forward has sized this stage's activations yet")
        shape, dtype = self._output_like[0]
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        seconds = []
        for _ in range(rounds):
            self.backend.synchronize()
            began = time.perf_counter()
            self._post(self.mesh.next_boundary, self._send_fwd_ops(out, 0))
            self._post(self.mesh.next_boundary, self._recv_bwd_ops(out, 0))
            self._drain_sends()
            self.backend.synchronize()
            seconds.append((time.perf_counter() - began) / 2)
        return statistics.median(seconds[1:])

    def evaluate(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The loss of ``tokens`` (M, micro_batch_size, S+1) without gradients: every forward, no backward.

        Same loss as ``step_lazy`` gives for these tokens and weights (last stage: a 1-element float64
        tensor, summed over dp replicas; None elsewhere); nothing is accumulated into ``.grad``.
        """
        S, M, k = self.mesh.topology.num_stages, self.micro_batches, self.coord.stage
        forward_only = self.schedule.forward_only()
        program = forward_only.program(S, M, k, self.chunks)
        with torch.no_grad():
            return self._step_loss(self._execute(tokens, program))

    def _execute(self, tokens: torch.Tensor, program: list[Any] | None = None) -> list[torch.Tensor]:
        """Run this stage's program (``self.program``) in order; the last stage's scaled losses, by micro-batch.

        Compute actions run the stage; a ``P2PBatch`` is posted as one batch over its link
        (``_post``: pure sends stay in flight, a batch that receives is waited on; an interleaved
        program's batches are all posted without waiting, ``_post_deferred``). State lives per
        (chunk, micro-batch) only between the action that makes it and the one that consumes it.
        """
        pending: dict[Key, _InFlight] = {}  # forwarded, backward still to come
        received: dict[Key, torch.Tensor] = {}  # RECV_F results, waiting for their forward
        grads: dict[Key, torch.Tensor] = {}  # RECV_B results, waiting for their backward
        input_grads: dict[Key, torch.Tensor | None] = {}  # backward results, waiting for SEND_B
        losses: list[torch.Tensor] = []
        tokens = self._tokens_on_device(tokens)
        for step in self.program if program is None else program:
            if isinstance(step, P2PBatch):
                self._communicate(step, pending, received, grads, input_grads)
                continue
            if isinstance(step, Overlap) and self._pairs is not None and self._pairs_at_once and not self._eager_chunks:
                self._run_pair(step, tokens, pending, received, grads, input_grads, losses)
                continue
            for action in step.actions if isinstance(step, Overlap) else (step,):
                self._run_action(action, tokens, pending, received, grads, input_grads, losses)
        self._drain_sends()
        if self._weight_grads:  # a schedule that leaves W halves behind would lose those gradients
            raise RuntimeError(f"schedule {self.schedule.name!r} left weight gradients of micro-batches "
                               f"{sorted(self._weight_grads)} unrun on stage {self.coord.stage}")
        if self._deferred:
            raise RuntimeError(f"schedule {self.schedule.name!r} received {sorted(self._deferred)} on stage "
                               f"{self.coord.stage} and never used it")
        return losses

    def _run_action(self, step: Action, tokens: torch.Tensor, pending: dict[Key, _InFlight],
                    received: dict[Key, torch.Tensor], grads: dict[Key, torch.Tensor],
                    input_grads: dict[Key, torch.Tensor | None], losses: list[torch.Tensor]) -> None:
        """One compute action: its input claimed, its result filed for whoever takes it next."""
        key = (step.chunk, step.micro_batch)
        if step.kind is Kind.FORWARD:
            item = self._forward(tokens, key, self._forward_input(step, pending, received), step)
            self._file_forward(key, item, pending, losses)
        elif step.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            item = pending.pop(key)
            grad = self._claim(Kind.RECV_BACKWARD, key, grads)
            done = (self._backward(item, grad, step) if step.kind is Kind.BACKWARD
                    else self._backward_input(key, item, grad, step))
            self._file_backward(step, done, grads, input_grads)
        elif step.kind is Kind.BACKWARD_WEIGHT:
            self._backward_weight(key, step)
        else:
            raise ValueError(f"the engine runs forward and backward actions; {step} is not one")

    def _run_pair(self, pair: Overlap, tokens: torch.Tensor, pending: dict[Key, _InFlight],
                  received: dict[Key, torch.Tensor], grads: dict[Key, torch.Tensor],
                  input_grads: dict[Key, torch.Tensor | None], losses: list[torch.Tensor]) -> None:
        """A forward and a backward at once: the forward on the pair thread, the backward here (``pairs``).

        Inputs are claimed and results filed on this thread, so the step's bookkeeping is never shared; the
        linears' settings are entered here around both (module-wide: the forward reads them, and so does a
        recompute in the backward); autocast, a thread's own, is entered by the forward's thread."""
        assert self._pairs is not None
        f, b = pair.forward, pair.backward
        fkey, bkey = (f.chunk, f.micro_batch), (b.chunk, b.micro_batch)
        given = self._forward_input(f, pending, received)
        item = pending.pop(bkey)
        grad = self._claim(Kind.RECV_BACKWARD, bkey, grads)
        store = self._weight_grads.setdefault(bkey, WeightGradStore()) if b.kind is Kind.BACKWARD_INPUT else None

        def forward() -> _InFlight:
            with self.autocast():
                return self._forward_stage(tokens, fkey, given)

        def backward() -> torch.Tensor | None:
            with collecting(store) if store is not None else contextlib.nullcontext():
                return self._backward_untimed(item, grad)

        with self._timed("compute", pair), self._linear_settings():
            made, done = self._pairs.run(forward, backward)
        self._file_forward(fkey, self._forwarded(fkey, made), pending, losses)
        self._file_backward(b, done, grads, input_grads)

    def _forward_input(self, step: Action, pending: dict[Key, _InFlight], received: dict[Key, torch.Tensor],
                       ) -> torch.Tensor | None:
        """What a forward takes: received from the previous stage, or at the V's turn the other chunk's output."""
        feeder = self.local_prev[step.chunk]
        if feeder is None:
            return self._claim(Kind.RECV_FORWARD, (step.chunk, step.micro_batch), received)
        return pending[(feeder, step.micro_batch)].output.detach()  # the V's turn: in memory

    @staticmethod
    def _file_forward(key: Key, item: _InFlight, pending: dict[Key, _InFlight], losses: list[torch.Tensor]) -> None:
        if item.is_loss:
            losses.append(item.output.detach())
        pending[key] = item

    def _file_backward(self, step: Action, done: torch.Tensor | None, grads: dict[Key, torch.Tensor],
                       input_grads: dict[Key, torch.Tensor | None]) -> None:
        key = (step.chunk, step.micro_batch)
        if self.local_prev[step.chunk] is None:
            input_grads[key] = done
        else:  # the feeding chunk is here: its backward takes this gradient as if received
            grads[(self.local_prev[step.chunk], step.micro_batch)] = done

    def _claim(self, kind: Kind, key: Key, filed: dict[Key, torch.Tensor]) -> torch.Tensor | None:
        """A compute's received input: filed already, or (deferred batch) waited for now."""
        posted = self._deferred.pop((kind, *key), None)
        if posted is not None:
            if posted.results is None:
                with self._timed("p2p", Action(kind, key[1], key[0])):  # a wait for this receive
                    posted.handle.wait()
                posted.results = {(a.kind, a.chunk, a.micro_batch): ops.finish() for a, ops in posted.receives}
            return posted.results.pop((kind, *key))
        return filed.pop(key, None)

    def _communicate(self, batch: P2PBatch, pending: dict[Key, _InFlight], received: dict[Key, torch.Tensor],
                     grads: dict[Key, torch.Tensor], input_grads: dict[Key, torch.Tensor | None]) -> None:
        """Post one P2P batch and file what it received under its (chunk, micro-batch)."""
        posted = []
        for a in batch.actions:
            key = (a.chunk, a.micro_batch)
            if a.kind is Kind.RECV_FORWARD:
                posted.append(self._recv_fwd_ops(a.chunk))
            elif a.kind is Kind.SEND_FORWARD:
                posted.append(self._send_fwd_ops(pending[key].output, a.chunk))
            elif a.kind is Kind.RECV_BACKWARD:
                posted.append(self._recv_bwd_ops(pending[key].output, a.chunk))
            else:
                posted.append(self._send_bwd_ops(input_grads.pop(key), a.chunk))
        if batch.peer_stage is not None:
            self._post_deferred(self.mesh.link(batch.peer_stage), batch, posted)
            return
        comm = self.mesh.next_boundary if batch.to_next_stage else self.mesh.prev_boundary
        for a, value in zip(batch.actions, self._post(comm, *posted, label=batch)):
            if a.kind is Kind.RECV_FORWARD:
                received[(a.chunk, a.micro_batch)] = value
            elif a.kind is Kind.RECV_BACKWARD:
                grads[(a.chunk, a.micro_batch)] = value

    def _post_deferred(self, comm: Communicator, batch: P2PBatch, posted: list[Any]) -> None:
        """Post a batch without waiting; its receives wait in ``_deferred`` for the compute that needs them."""
        ops = [op for p in posted if p is not None for op in p.ops]
        if not ops:
            return
        with self._timed("p2p", batch):
            handle = comm.batch_p2p(ops, async_op=True)
        receives = [(a, p) for a, p in zip(batch.actions, posted)
                    if a.kind in (Kind.RECV_FORWARD, Kind.RECV_BACKWARD) and p is not None]
        if not receives:
            self._sends_in_flight.append(handle)
            return
        entry = _Posted(handle, receives)
        for a, _ in receives:
            self._deferred[(a.kind, a.chunk, a.micro_batch)] = entry

    # --- after the schedule -----------------------------------------------------------------------------------
    def _sync_dp_grads(self) -> None:
        """SUM each gradient over the replicas the mesh names for it (``Mesh.grad_group``), in buckets of flattened
        gradients, one group after another in the order the groups first appear."""
        by_group: dict[int, tuple[Communicator, list[torch.nn.Parameter]]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                group = self.mesh.grad_group(p)
                by_group.setdefault(id(group), (group, []))[1].append(p)
        for group, params in by_group.values():
            self._sum_grads(group, params)

    def _fill_idle_experts(self) -> None:
        """A zero gradient for every expert shard no token reached here this step, as one device would have: its
        replicas' sums (and ZeRO-1's reduce-scatter) then take part whatever the routing."""
        for p in self.module.parameters():
            if p.grad is None and p.requires_grad and expert_shard(p):
                p.grad = torch.zeros_like(p)

    @staticmethod
    def _sum_grads(dp: Communicator, params: list[torch.nn.Parameter]) -> None:
        if dp.size == 1:
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params + [None]:  # type: ignore[list-item]
            if p is not None:
                bucket.append(p.grad)
                size += p.grad.numel() * p.grad.element_size()
            if bucket and (p is None or size >= BUCKET_BYTES):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dp.all_reduce(flat, "sum")
                at = 0
                for g in bucket:
                    g.copy_(flat[at:at + g.numel()].view_as(g))
                    at += g.numel()
                bucket, size = [], 0

    def _step_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | None:
        if not self.last:
            return None
        total = torch.stack(losses).sum().reshape(1).to(torch.float64)
        if self.mesh.loss_group.size > 1:
            self.mesh.loss_group.all_reduce(total, "sum")  # each replica's loss covers its rows only
        return total
