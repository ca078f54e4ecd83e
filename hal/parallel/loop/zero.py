"""ZeRO stage 1 inside a stage's data-parallel group: optimizer state sharded over the dp replicas.

Every dp replica of a stage holds the same parameters and, after the gradient sum, the same
gradients, so plain data parallelism keeps dp identical copies of the optimizer state (AdamW: two
fp32 tensors per parameter, twice the weights). ``ZeroOne`` keeps only this rank's 1/dp of it:

    flat = cat(p.view(-1) for p in params) + zero padding to a multiple of dp
    rank r owns flat[r * n : (r + 1) * n], n = len(flat) / dp

    step():                   the gradients are already SUMMED over dp (the engine's all-reduce):
                              take my shard of them, update my shard, all-gather the parameters
    reduce_scatter_and_step(): the gradients are this replica's own: reduce-scatter (sum) them,
                              so each rank receives only its shard of the sum — half the traffic
                              of an all-reduce — then update and all-gather as above

The inner optimizer runs on one flat 1-D shard, so it must be ELEMENT-WISE (AdamW, Adam, SGD with
momentum: every element's update depends on that element alone); then the result equals the
unsharded optimizer's on the full parameters, element for element. Optimizers that take per-tensor
norms (LAMB, Adafactor, gradient clipping inside ``step``) are not, and must not be wrapped. All
parameters share one set of hyperparameters (one param group): the flat shard mixes parameters.

Checkpoints: ``state_dict()`` gathers the shards and returns the state in the FULL per-parameter
form the unsharded optimizer would have (``{"state": {i: {...}}, "param_groups": [...]}`` with
``i`` the index in ``params``), and ``load_state_dict`` accepts that form and keeps its own shard
— so a checkpoint does not depend on dp, on ZeRO being on, or on the device it was written on.
With dp=1 (or no communicator) there is nothing to shard and ``ZeroOne`` *is* the plain optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from hal.collectives import Communicator

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lies in the padded flat buffer, and which part of it each dp rank owns."""

    numels: tuple[int, ...]
    dp: int

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def shard(self) -> int:
        """Elements per rank: ceil(total / dp)."""
        return -(-self.total // self.dp)

    @property
    def padded(self) -> int:
        return self.shard * self.dp

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(parameter index, start, end) in that parameter's flat view, for every part rank owns, in order."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        out, at = [], 0
        for i, n in enumerate(self.numels):
            start, end = max(lo, at), min(hi, at + n)
            if start < end:
                out.append((i, start - at, end - at))
            at += n
        return out


class ZeroOne:
    """An element-wise optimizer whose state is sharded over ``dp_comm`` (ZeRO stage 1).

    ``optimizer_factory`` builds the inner optimizer from a list of tensors, e.g.
    ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``. Every rank of ``dp_comm`` must build its
    ``ZeroOne`` from the same parameters in the same order and call ``step``,
    ``reduce_scatter_and_step`` and ``state_dict`` together (they are collectives).
    """

    def __init__(self, params: Iterable[torch.Tensor], dp_comm: Communicator | None, optimizer_factory: OptimizerFactory) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeroOne got no parameters that require grad")
        self.dp_comm = dp_comm
        self.dp = 1 if dp_comm is None else dp_comm.size
        if not self.sharded:  # dp=1: exactly the plain optimizer, no flat copy
            self.optimizer = optimizer_factory(self.params)
            return
        _check_flattenable(self.params)
        assert dp_comm is not None
        self.rank = dp_comm.group_rank
        self.layout = FlatLayout(tuple(p.numel() for p in self.params), self.dp)
        first = self.params[0]
        self.shard = torch.zeros(self.layout.shard, dtype=first.dtype, device=first.device, requires_grad=True)
        self._load_shard_from_params()
        self.optimizer = optimizer_factory([self.shard])
        if len(self.optimizer.param_groups) != 1:
            raise ValueError("ZeroOne needs an optimizer with one param group (the flat shard mixes every parameter)")

    # --- introspection ------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """False with dp=1: then this is the plain optimizer."""
        return self.dp > 1

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (change ``lr`` here, as with any optimizer)."""
        return self.optimizer.param_groups

    @property
    def state_numel(self) -> int:
        """Parameter elements whose optimizer state this rank holds: ceil(total / dp) when sharded."""
        return self.layout.shard if self.sharded else sum(p.numel() for p in self.params)

    # --- the update -----------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()
        if self.sharded:
            self.shard.grad = None

    def step(self) -> None:
        """Update from gradients already SUMMED over dp (identical on every replica)."""
        if not self.sharded:
            self.optimizer.step()
            return
        if not self._have_grads():
            return
        self._update(self._my_grad_shard())

    def reduce_scatter_and_step(self) -> None:
        """Update from this replica's own gradients: reduce-scatter (sum) them over dp, then step.

        ``p.grad`` is left as it was (this replica's part only, not the sum): read the summed
        gradient from the engine's all-reduce path if you need it, e.g. for a norm.
        """
        if not self.sharded:
            self.optimizer.step()
            return
        if not self._have_grads():
            return
        assert self.dp_comm is not None
        self._update(self.dp_comm.reduce_scatter(self._flat_grads(), "sum"))

    def _update(self, grad_shard: torch.Tensor) -> None:
        self._load_shard_from_params()  # parameters may have been loaded or edited since the last step
        self.shard.grad = grad_shard
        self.optimizer.step()
        self.shard.grad = None
        self._all_gather_params()

    def _have_grads(self) -> bool:
        """True when every parameter has a gradient, False when none has (nothing to do, as in torch)."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if len(missing) == len(self.params):
            return False
        if missing:
            raise ValueError(
                f"ZeroOne: parameters {missing[:5]} have no gradient while others do; the flat shard cannot skip them "
                "as the unsharded optimizer would — make every parameter take part in the loss, or leave them out"
            )
        return True

    # --- moving between parameters and the flat shard ------------------------------------------------------
    @torch.no_grad()
    def _load_shard_from_params(self) -> None:
        self.shard.zero_()  # padding stays zero: zero gradient, zero value, zero weight decay
        at = 0
        for i, start, end in self.layout.pieces(self.rank):
            self.shard[at:at + end - start].copy_(self.params[i].reshape(-1)[start:end])
            at += end - start

    def _my_grad_shard(self) -> torch.Tensor:
        """My shard of the (already summed) gradients, without flattening the rest."""
        parts = [self.params[i].grad.reshape(-1)[start:end] for i, start, end in self.layout.pieces(self.rank)]  # type: ignore[union-attr]
        return _pad(torch.cat(parts) if parts else self.shard.new_zeros(0), self.layout.shard)

    def _flat_grads(self) -> torch.Tensor:
        """Every gradient flattened into one padded buffer (what the reduce-scatter reads)."""
        return _pad(torch.cat([p.grad.reshape(-1) for p in self.params]), self.layout.padded)  # type: ignore[union-attr]

    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        assert self.dp_comm is not None
        return self.dp_comm.all_gather(shard.detach().contiguous())

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        flat = self._gather_flat(self.shard)
        at = 0
        for p in self.params:
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self.params:
            out.append(flat[at:at + p.numel()].view_as(p).clone())
            at += p.numel()
        return out

    # --- checkpoints in the full, split-agnostic form ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's state dict over ``params`` (a collective over dp when sharded)."""
        if not self.sharded:
            return self.optimizer.state_dict()
        inner = self.optimizer.state_dict()
        mine: dict[str, Any] = inner["state"].get(0, {})
        per_param: list[dict[str, Any]] = [{} for _ in self.params]
        for key, value in mine.items():
            if _per_element(value):
                for state, full in zip(per_param, self._unflatten(self._gather_flat(value))):
                    state[key] = full
            else:
                for state in per_param:
                    state[key] = value.clone() if torch.is_tensor(value) else value
        group = {k: v for k, v in inner["param_groups"][0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {"state": {i: s for i, s in enumerate(per_param)} if mine else {}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the full form (from ``state_dict`` at any dp, or a plain optimizer's); keep my shard."""
        if not self.sharded:
            self.optimizer.load_state_dict(state_dict)
            return
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(
                f"ZeroOne.load_state_dict: expected one param group of {len(self.params)} parameters, got "
                f"{[len(g['params']) for g in groups]}; the state dict is from another model or optimizer setup"
            )
        ids = groups[0]["params"]
        saved = [state_dict["state"].get(i) for i in ids]
        group = {k: v for k, v in groups[0].items() if k != "params"}
        group["params"] = [0]
        self.optimizer.load_state_dict({"state": self._shard_state(saved), "param_groups": [group]})

    def _shard_state(self, saved: list[dict[str, Any] | None]) -> dict[int, dict[str, Any]]:
        """The inner optimizer's state for my shard, cut from per-parameter full states."""
        have = [s is not None for s in saved]
        if not any(have):
            return {}
        if not all(have):
            raise ValueError("ZeroOne.load_state_dict: some parameters have optimizer state and others none; "
                             "the sharded optimizer steps all of them together")
        lo = self.rank * self.layout.shard
        mine: dict[str, Any] = {}
        for key, value in saved[0].items():  # type: ignore[union-attr]
            if not _per_element(value):
                mine[key] = value.clone() if torch.is_tensor(value) else value
                continue
            flat = torch.cat([s[key].reshape(-1).to(self.shard.device) for s in saved])  # type: ignore[index]
            mine[key] = _pad(flat, self.layout.padded)[lo:lo + self.layout.shard].clone()
        return {0: mine}


class Zero1AdamW(ZeroOne):
    """``torch.optim.AdamW`` with ZeRO-1 state sharding over ``dp_comm``; same arguments as AdamW."""

    def __init__(self, params: Iterable[torch.Tensor], dp_comm: Communicator | None, **adamw: Any) -> None:
        super().__init__(params, dp_comm, lambda ps: torch.optim.AdamW(ps, **adamw))


class Zero1Experts:
    """ZeRO-1 on a stage with expert parallelism: two ``ZeroOne`` optimizers used as one.

    Why two: the dense parameters are the same on every dp replica and shard over the whole dp group, but an
    expert shard is the same only on the replicas holding those experts (the ``edp`` group, dp / ep ranks),
    so its state shards over that group — with ep = dp there is one holder and nothing to shard. Every rank of
    the stage calls the methods together (they are collectives over dp and edp). ``state_dict`` numbers the
    parameters in ``params``' order, the full per-parameter form ``ZeroOne`` writes, so a checkpoint is the
    same with or without it.
    """

    def __init__(self, params: Iterable[torch.Tensor], is_expert: Callable[[torch.Tensor], bool],
                 dp_comm: Communicator | None, edp_comm: Communicator | None, optimizer_factory: OptimizerFactory) -> None:
        self.params = [p for p in params if p.requires_grad]
        dense = [p for p in self.params if not is_expert(p)]
        experts = [p for p in self.params if is_expert(p)]
        if not dense or not experts:
            raise ValueError("Zero1Experts splits dense and expert parameters; this stage lacks one kind — use ZeroOne")
        self.parts = (ZeroOne(dense, dp_comm, optimizer_factory), ZeroOne(experts, edp_comm, optimizer_factory))
        slot = {id(p): (k, i) for k, part in enumerate(self.parts) for i, p in enumerate(part.params)}
        self._slots = [slot[id(p)] for p in self.params]  # params' index -> (part, index in that part)

    @property
    def sharded(self) -> bool:
        return any(part.sharded for part in self.parts)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Both parts' groups: setting ``lr`` on each changes both (the first is read for the hyperparameters)."""
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state_numel(self) -> int:
        return sum(part.state_numel for part in self.parts)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def reduce_scatter_and_step(self) -> None:
        for part in self.parts:
            part.reduce_scatter_and_step()

    def state_dict(self) -> dict[str, Any]:
        inner = [part.state_dict() for part in self.parts]
        state = {i: inner[k]["state"][j] for i, (k, j) in enumerate(self._slots) if j in inner[k]["state"]}
        group = {key: v for key, v in inner[0]["param_groups"][0].items() if key != "params"}
        group["params"] = list(range(len(self.params)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"Zero1Experts.load_state_dict: expected one param group of {len(self.params)} parameters, "
                             f"got {[len(g['params']) for g in groups]}; the state dict is from another model or setup")
        saved = [state_dict["state"].get(i) for i in groups[0]["params"]]
        settings = {key: v for key, v in groups[0].items() if key != "params"}
        for k, part in enumerate(self.parts):
            mine = [(j, saved[i]) for i, (kk, j) in enumerate(self._slots) if kk == k]
            part.load_state_dict({"state": {j: s for j, s in mine if s is not None},
                                  "param_groups": [{**settings, "params": [j for j, _ in mine]}]})


def _pad(flat: torch.Tensor, size: int) -> torch.Tensor:
    return flat if flat.numel() == size else torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _per_element(value: Any) -> bool:
    """A state entry with one value per parameter element (exp_avg), not per tensor (step)."""
    return torch.is_tensor(value) and value.dim() > 0


def _check_flattenable(params: list[torch.Tensor]) -> None:
    """One flat buffer needs one dtype and device, and per-element state must be told from scalars."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"ZeroOne flattens parameters into one buffer; they must share dtype and device, got {sorted(map(str, kinds))}")
    if any(p.dim() == 0 for p in params):
        raise ValueError("ZeroOne cannot shard 0-dim parameters (their state looks like a scalar's); give them shape (1,)")


__all__ = ["FlatLayout", "OptimizerFactory", "Zero1AdamW", "Zero1Experts", "ZeroOne"]
