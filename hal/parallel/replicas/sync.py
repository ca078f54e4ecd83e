"""The replicas' meeting: full tensors matched by parameter name, summed across replicas, handed back as shards.

Replicas may lay the model out differently (tp2 beside dp2, two stages beside one, experts sharded or not), so
a rank of one replica has no partner rank in another. What every replica does have is each parameter in full:
``ReplicaExchange`` works on that.

1. **Inside each replica** (its own collective library): the engine has summed the gradients over its dp
   replicas; each rank assembles its parameters' full gradients over its tp (and ep) group.
2. **Across the bridge**: the model's parameters, in one order every rank computes, are cut into buckets — a
   bucket never spans two stages of any replica — and each bucket has one *speaker* per replica, a rank of the
   stage holding it there, taken in turn over that stage's ranks: N ranks a side carry about N buckets at a
   time. The speakers of a bucket sum its weighted flat buffer over their own group (one rank per replica, each
   its own island: ``collectives.bridge``), optionally as bf16 on the wire, or as fp8 with error feedback
   (``fp8_wire``). Every speaker sums all its buckets
   before any hand-back, so the pairs of speakers carry their buckets at once (the bridge striped over pairs), and
   the bridge stripes each pair's sum over its host channels (from 8 MiB: a bucket is 32 MiB).
3. **Back inside**: each speaker broadcasts the sum over its stage (a tied embedding on two stages: over the
   embedding group); every rank keeps its shard (``Mesh.shard``).

The same exchange serves the every-step gradient sync (weights: the replicas' token shares) and local SGD's
parameter deltas (``parallel.replicas.local_sgd``). Every rank of the world must call each method together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from hal.parallel.pipeline.mesh import Mesh
from hal.parallel.replicas.fp8_wire import Fp8Wire

if TYPE_CHECKING:
    from hal.collectives.communicator import Communicator
    from hal.collectives.process_groups import World

BUCKET_BYTES = 32 << 20  # the flat float32 buffer one speaker group sums at once (the bridge stripes it over channels)
WIRE_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}  # fp8: ``fp8_wire``


@dataclass(frozen=True)
class Holding:
    """What one rank holds, as every rank learns it at setup: its replica, stage, rank and full parameter shapes."""

    replica: int
    stage: int
    rank: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (name, full shape) in the stage's parameter order
    tied_copy: tuple[str, ...]  # names this stage holds as the second copy of a tied parameter


@dataclass(frozen=True)
class Bucket:
    """Parameters summed in one flat buffer by one speaker of each replica."""

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    speakers: tuple[int, ...]  # one global rank per replica
    stages: tuple[int, ...]  # the stage holding the bucket in each replica

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def pack(self, tensors: Mapping[str, torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """The bucket's tensors as one flat float32 buffer, in its order (a missing or None one: zeros)."""
        flat = torch.empty(self.numel, dtype=torch.float32, device=device)
        for name, part in self.parts(flat):
            tensor = tensors.get(name)
            if tensor is None:
                part.zero_()
            else:
                part.copy_(tensor.reshape(-1))
        return flat

    def parts(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, its 1-D slice of ``flat``) for every parameter of the bucket, in its order."""
        return zip(self.names, flat.split(list(self.numels)))


def plan_buckets(holdings: Sequence[Holding], replicas: int, stage_ranks: Callable[[int, int], Sequence[int]],
                 bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """The buckets every rank computes alike from everyone's ``Holding``: the names in replica 0's order, cut where
    the holding stage changes in any replica or the buffer passes ``bucket_bytes``; speakers in turn over the
    holding stage's ranks (``stage_ranks(replica, stage)``).

    Raises ValueError naming a parameter that the replicas do not all hold with one shape."""
    where: list[dict[str, tuple[int, tuple[int, ...]]]] = [{} for _ in range(replicas)]  # name -> (stage, shape)
    order: list[str] = []
    for h in sorted(holdings, key=lambda h: (h.replica, h.stage, h.rank)):
        for name, shape in h.shapes:
            if name in h.tied_copy:
                continue
            seen = where[h.replica].get(name)
            if seen is None:
                where[h.replica][name] = (h.stage, tuple(shape))
                if h.replica == 0:
                    order.append(name)
    for r in range(1, replicas):
        for name in order:
            theirs = where[r].get(name)
            if theirs is None:
                raise ValueError(f"replica {r} holds no parameter {name!r} that replica 0 holds: replicas must train one model")
            if theirs[1] != where[0][name][1]:
                raise ValueError(f"parameter {name!r} is {list(where[0][name][1])} in replica 0 but {list(theirs[1])} in "
                                 f"replica {r}: replicas must train one model")
        extra = sorted(set(where[r]) - set(order))
        if extra:
            raise ValueError(f"replica {r} holds {extra[0]!r}, which replica 0 does not: replicas must train one model")
    buckets: list[Bucket] = []
    turn: dict[tuple[int, ...], int] = {}
    names: list[str] = []
    numels: list[int] = []
    key: tuple[int, ...] | None = None

    def close() -> None:
        nonlocal names, numels
        if not names:
            return
        assert key is not None
        count = turn.get(key, 0)
        turn[key] = count + 1
        speakers = []
        for r, stage in enumerate(key):
            ranks = stage_ranks(r, stage)
            speakers.append(ranks[count % len(ranks)])
        buckets.append(Bucket(len(buckets), tuple(names), tuple(numels), tuple(speakers), key))
        names, numels = [], []

    for name in order:
        stages = tuple(where[r][name][0] for r in range(replicas))
        numel = 1
        for d in where[0][name][1]:
            numel *= d
        if stages != key or (names and (sum(numels) + numel) * 4 > bucket_bytes):
            close()
            key = stages
        names.append(name)
        numels.append(numel)
    close()
    return buckets


class ReplicaExchange:
    """This rank's part of the cross-replica sums (see the module doc). Built collectively over the world."""

    def __init__(self, mesh: Mesh, module: torch.nn.Module, replica: int, replicas: Sequence[Any], world: World, *,
                 compress: str = "none", bucket_bytes: int = BUCKET_BYTES, validate: bool = False) -> None:
        """``replicas``: every replica's Topology, in replica order (``mesh.topology`` is this rank's, ``replica``-th)."""
        from hal.parallel.pipeline.mesh import make_groups

        self.mesh, self.module, self.replica, self.world = mesh, module, replica, world
        self.wire = WIRE_DTYPES[compress]
        self.fp8 = Fp8Wire() if compress == "fp8" else None  # its residuals: error feedback from step to step
        self.params = dict(module.named_parameters())
        tied = bool(getattr(module, "needs_tied_grad_sync", False)) and not mesh.first
        full = mesh.gather_full(module, {n: p.detach() for n, p in self.params.items()})  # collective over tp / ep
        mine = Holding(replica, mesh.coord.stage, world.rank, tuple((n, tuple(t.shape)) for n, t in full.items()),
                       ("embed.weight",) if tied and "embed.weight" in full else ())
        everyone: list[Any] = [None] * world.size
        dist.all_gather_object(everyone, mine)  # the default group: gloo on every rank
        try:
            self.buckets = plan_buckets(everyone, len(replicas), lambda r, s: replicas[r].stages[s].ranks, bucket_bytes)
        except ValueError as exc:
            from hal.errors import ConfigError

            raise ConfigError(str(exc)) from None
        self.shapes = dict(mine.shapes)
        # one group per speaker set, the same order on every rank
        self.groups = make_groups(world, sorted({b.speakers for b in self.buckets}), validate=validate)
        # My buckets, in the one global order (which keeps every rank's collectives deadlock-free): those my stage
        # holds, and a tied embedding's, whose sum my stage's second copy takes from the first stage's broadcast.
        self.tied_copy = bool(mine.tied_copy)
        # Backward order (the last parameters first): a pipeline replica's later stages end their backward first, so
        # their buckets cross the bridge while its earlier stages are still computing theirs.
        self.mine = [b for b in reversed(self.buckets)
                     if b.stages[replica] == mesh.coord.stage or (self.tied_copy and "embed.weight" in b.names)]
        self.bytes_sent = 0  # cross-replica bytes this rank put on the wire in the last exchange

    def _handback(self, bucket: Bucket) -> Communicator:
        """The group a bucket's sum is broadcast over inside this replica: its stage, or both stages of a tied copy (the
        mesh has an embedding group exactly when this replica's tied embedding sits on two stages)."""
        if self.mesh.embedding is not None and "embed.weight" in bucket.names:
            return self.mesh.embedding
        return self.mesh.stage

    def exchange(self, full: Mapping[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
        """Σ over replicas of ``weight`` × each replica's full tensors, by name (float32 on every rank holding them).

        ``full``: this rank's full tensors, every name its stage holds (the same on all its ranks)."""
        out: dict[str, torch.Tensor] = {}
        self.bytes_sent = 0
        device = next(iter(full.values())).device if full else torch.device("cpu")
        flats: list[torch.Tensor] = []
        # 1. Across the bridge: every speaker sums its buckets first, so the speaker pairs of different buckets (the
        #    stage's ranks taken in turn) carry their buckets at the same time instead of one after another.
        for bucket in self.mine:
            group = self.groups[bucket.speakers]
            if group is not None:  # this replica's speaker for the bucket
                flat = bucket.pack(full, device).mul_(weight)
                self.bridge_sum(bucket, flat)
            else:
                flat = torch.empty(bucket.numel, dtype=torch.float32, device=device)
            flats.append(flat)
        # 2. Back inside: each bucket's sum from its speaker to the stage (in the one global order).
        for bucket, flat in zip(self.mine, flats):
            home = self._handback(bucket)
            if home.size > 1:
                home.broadcast(flat, bucket.speakers[self.replica])
            for name, part in bucket.parts(flat):
                if name in self.shapes:
                    out[name] = part.view(self.shapes[name])
        return out

    def warm_up(self) -> None:
        """Each speaker group of this rank sums one empty buffer of its largest bucket over the bridge, in the one
        global order: the bridge's staging buffers (page-locked: allocating them synchronizes the device) and its
        threads exist before a step, when the exchange may run beside the backward (``overlap``). Collective over
        every rank; nothing it sums is kept (nor counted in ``bytes_sent``, nor fed back on the fp8 wire)."""
        sizes: dict[tuple[int, ...], int] = {}
        for bucket in reversed(self.buckets):  # every rank walks the same order
            if self.groups[bucket.speakers] is not None:
                sizes[bucket.speakers] = max(sizes.get(bucket.speakers, 0), bucket.numel)
        device = next(iter(self.params.values())).device
        for speakers, numel in sizes.items():
            group = self.groups[speakers]
            assert group is not None
            self._wire_sum(group, torch.zeros(numel, dtype=torch.float32, device=device), key=-1)
            if self.fp8 is not None:
                self.fp8.residuals.pop(-1, None)

    def bridge_sum(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """This speaker's ``flat`` becomes the sum over the bucket's speakers (one a replica), on the wire as set."""
        group = self.groups[bucket.speakers]
        assert group is not None, "only a bucket's speakers sum it"
        self.bytes_sent += self._wire_sum(group, flat, key=bucket.index)

    def _wire_sum(self, group: Communicator, flat: torch.Tensor, key: int) -> int:
        """``flat`` summed over ``group`` on the wire as set (fp8: its residual kept under ``key``); returns the bytes
        this rank sent."""
        if group.size < 2:
            return 0
        if self.fp8 is not None:
            return self.fp8.all_reduce(flat, group, key)
        wire = flat if self.wire == torch.float32 else flat.to(self.wire)
        group.all_reduce(wire, "sum")
        if wire is not flat:
            flat.copy_(wire)
        return wire.numel() * wire.element_size()

    # --- the fp8 wire's residuals in a checkpoint -----------------------------------------------------------
    def residual_file(self) -> str | None:
        """The checkpoint file of this rank's fp8 residuals (None: it speaks for no bucket, or the wire is not fp8)."""
        speaks = any(self.groups[b.speakers] is not None for b in self.mine)
        return wire_file_name(self.world.rank) if self.fp8 is not None and speaks else None

    def residual_files(self) -> list[str]:
        """Every speaker's residual file, as rank 0 lists them in the checkpoint (the same on every rank)."""
        if self.fp8 is None:
            return []
        return [wire_file_name(rank) for rank in sorted({s for b in self.buckets for s in b.speakers})]

    def residuals_by_name(self) -> dict[str, torch.Tensor]:
        """What this speaker's fp8 sends rounded away, by parameter name (1-D, float32): error feedback to carry over a
        restart. Matched by name, not by bucket, so a plan with other buckets or stages takes it too."""
        if self.fp8 is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        for index, flat in self.fp8.residuals.items():
            out.update(self.buckets[index].parts(flat))
        return out

    def load_residuals(self, by_name: Mapping[str, torch.Tensor]) -> list[str]:
        """This speaker's residuals from a checkpoint's (its replica's, by name); returns the parameters it had none
        for (their buckets start without feedback, as a fresh run's do)."""
        assert self.fp8 is not None
        missing: list[str] = []
        device = next(iter(self.params.values())).device
        for bucket in self.mine:
            if self.groups[bucket.speakers] is None:
                continue
            lacking = [n for n, k in zip(bucket.names, bucket.numels) if n not in by_name or by_name[n].numel() != k]
            if lacking:
                missing += lacking
                continue
            self.fp8.residuals[bucket.index] = bucket.pack(by_name, device)
        return missing

    def sync_grads(self, weight: float) -> None:
        """Every gradient becomes Σ_r weight_r × g_r (this replica's ``weight``: its share of the step's tokens)."""
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}
        full = self.mesh.gather_full(self.module, grads)
        summed = self.exchange(full, weight)
        for name, p in self.params.items():
            shard = self.mesh.shard(summed[name], p).to(p.dtype)
            if p.grad is None:
                p.grad = shard.clone()
            else:
                p.grad.copy_(shard)

    def step_loss(self, loss: float | None, weight: float) -> float:
        """The step's loss over every replica: Σ_r weight_r × loss_r, on every rank (one float64 sum over the world;
        ``loss``: this rank's replica's step loss where it holds it, else None; one rank a replica counts it)."""
        counted = loss is not None and self.mesh.coord.dp == 0 and self.mesh.coord.tp == 0
        total = torch.tensor([weight * loss if counted else 0.0], dtype=torch.float64)  # type: ignore[operator]
        dist.all_reduce(total)  # the default group: gloo on every rank
        return float(total.item())


def wire_file_name(rank: int) -> str:
    """The checkpoint file of global rank ``rank``'s fp8 wire residuals."""
    return f"fp8-residuals-rank-{rank}.pt"


def token_weights(tokens: torch.Tensor, rows: Sequence[range], ignore_index: int = -100) -> list[float]:
    """Each replica's share of the step's counted tokens (labels other than ``ignore_index``): its gradient's weight
    in the step's mean. ``tokens``: the step's global batch (rows, S+1); ``rows``: each replica's rows."""
    counts = [float((tokens[r.start:r.stop, 1:] != ignore_index).sum()) for r in rows]
    total = sum(counts)
    return [c / total if total else 1.0 / len(counts) for c in counts]
