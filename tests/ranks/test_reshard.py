"""Boundary resharding: exhaustive pure tests of the plans, an in-process exchange over every layout
pair, and two real 4-process runs (flat gloo, and declared islands through the bridge).

Values are integer-valued floats, so every copy and every sum is exact and compared bitwise.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import pytest
import torch

from hal.errors import ConfigError
from hal.parallel.pipeline.reshard import (
    Block,
    Boundary,
    Layout,
    Transfer,
    backward_transfers,
    exchange,
    p2p_ops,
    plan_transfers,
    send_activation,
)

from ..dist_harness import run_world

LAYOUT_SPECS = [(dp, tp, sp) for dp in range(1, 5) for tp in range(1, 5) for sp in (False, True)]
PAIRS = list(itertools.product(LAYOUT_SPECS, LAYOUT_SPECS))
TAIL = (2,)


def _layouts(a: tuple[int, int, bool], b: tuple[int, int, bool]) -> tuple[Layout, Layout]:
    src = Layout.contiguous(*a, offset=0)
    return src, Layout.contiguous(*b, offset=len(src.ranks))


def _minimal(src: Layout, dst: Layout) -> tuple[int, int]:
    seq = math.lcm(src.tp if src.sp else 1, dst.tp if dst.sp else 1)
    return math.lcm(src.dp, dst.dp), seq


def _sizes(src: Layout, dst: Layout) -> list[tuple[int, int]]:
    return [(12, 12), _minimal(src, dst)]


def _coverage(transfers: Sequence[Transfer], needers: Layout, holders: Layout, batch: int, seq: int) -> dict[int, torch.Tensor]:
    """How many times each (row, position) of each needer's block arrives; checks pieces stay in bounds."""
    counts = {}
    for r in needers.ranks:
        counts[r] = torch.zeros(needers.block(r, batch, seq).shape, dtype=torch.int64)
    for t in transfers:
        assert t.src_rank in holders.ranks and t.dst_rank in needers.ranks, t
        assert t.src_block == holders.block(t.src_rank, batch, seq) and t.dst_block == needers.block(t.dst_rank, batch, seq)
        assert t.piece.volume > 0, t
        assert t.src_block.intersect(t.piece) == t.piece, f"piece outside what the sender holds: {t}"
        assert t.dst_block.intersect(t.piece) == t.piece, f"piece outside what the receiver needs: {t}"
        counts[t.dst_rank][t.local(t.dst_block)] += 1
    return counts


def _check_balance(transfers: Sequence[Transfer], holders: Layout) -> None:
    """Replicas of one dp chunk: sent volumes differ by at most one piece (greedy least-loaded)."""
    if not holders.replicated:
        return
    sent = dict.fromkeys(holders.ranks, 0)
    for t in transfers:
        sent[t.src_rank] += t.piece.volume
    biggest = max((t.piece.volume for t in transfers), default=0)
    for d in range(holders.dp):
        loads = [sent[holders.rank_at(d, t)] for t in range(holders.tp)]
        assert max(loads) - min(loads) <= biggest, (holders, loads)


# --- pure planning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("a", LAYOUT_SPECS, ids=str)
def test_forward_plan_covers_every_receiver_exactly_once(a: tuple[int, int, bool]) -> None:
    for b in LAYOUT_SPECS:
        src, dst = _layouts(a, b)
        for batch, seq in _sizes(src, dst):
            plan = plan_transfers(src, dst, batch, seq)
            assert plan == plan_transfers(src, dst, batch, seq)  # deterministic: every process agrees
            counts = _coverage(plan, dst, src, batch, seq)
            assert all(bool((c == 1).all()) for c in counts.values()), (src, dst, batch, seq)
            pairs = [(t.src_rank, t.dst_rank) for t in plan]
            assert len(pairs) == len(set(pairs))  # one box per pair of blocks
            assert sum(t.piece.volume for t in plan) == sum(dst.block(r, batch, seq).volume for r in dst.ranks)
            _check_balance(plan, src)


@pytest.mark.parametrize("a", LAYOUT_SPECS, ids=str)
def test_backward_plans_return_every_gradient_under_both_rules(a: tuple[int, int, bool]) -> None:
    for b in LAYOUT_SPECS:
        src, dst = _layouts(a, b)
        for batch, seq in _sizes(src, dst):
            one = backward_transfers(src, dst, batch, seq, "identical")
            counts = _coverage(one, src, dst, batch, seq)  # every src rank gets its WHOLE block, once
            assert all(bool((c == 1).all()) for c in counts.values()), (src, dst)
            _check_balance(one, dst)
            summed = backward_transfers(src, dst, batch, seq, "partial")
            copies = dst.tp if dst.replicated else 1  # each dst replica contributes its partial sum
            counts = _coverage(summed, src, dst, batch, seq)
            assert all(bool((c == copies).all()) for c in counts.values()), (src, dst)
            if not dst.replicated:
                assert summed == one


def test_replicated_source_shares_the_sending() -> None:
    src, dst = Layout.contiguous(1, 2, False, 0), Layout.contiguous(2, 1, False, 2)  # tp2 → dp2
    plan = plan_transfers(src, dst, 4, 8)
    assert [(t.src_rank, t.dst_rank, t.batch, t.seq) for t in plan] == [(0, 2, (0, 2), (0, 8)), (1, 3, (2, 4), (0, 8))]
    src, dst = Layout.contiguous(1, 4, False, 0), Layout.contiguous(1, 4, False, 4)  # tp4 → tp4, both replicated
    assert sorted(t.src_rank for t in plan_transfers(src, dst, 2, 4)) == [0, 1, 2, 3]
    dst = Layout.contiguous(4, 1, False, 4)  # tp4 → dp4: each replica sends one quarter
    assert sorted((t.src_rank, t.batch) for t in plan_transfers(src, dst, 8, 4)) == [(0, (0, 2)), (1, (2, 4)), (2, (4, 6)), (3, (6, 8))]


def test_sp_to_dp_pieces_are_intersections() -> None:
    src, dst = Layout.contiguous(1, 2, True, 0), Layout.contiguous(2, 1, False, 2)  # tp2(sp) → dp2
    plan = plan_transfers(src, dst, 4, 6)
    assert [(t.src_rank, t.dst_rank, t.batch, t.seq) for t in plan] == [
        (0, 2, (0, 2), (0, 3)), (1, 2, (0, 2), (3, 6)), (0, 3, (2, 4), (0, 3)), (1, 3, (2, 4), (3, 6))]
    back = backward_transfers(src, dst, 4, 6)
    assert sorted((t.src_rank, t.dst_rank, t.batch, t.seq) for t in back) == sorted(
        (t.dst_rank, t.src_rank, t.batch, t.seq) for t in plan)


@pytest.mark.parametrize("make, words", [
    (lambda: plan_transfers(Layout(1, 2, True, (0, 1)), Layout(2, 1, False, (1, 2)), 4, 4), "ranks overlap"),
    (lambda: plan_transfers(Layout.contiguous(3, 1, False, 0), Layout.contiguous(2, 1, False, 3), 4, 4), "not divisible by its dp 3"),
    (lambda: plan_transfers(Layout.contiguous(1, 1, False, 0), Layout.contiguous(1, 4, True, 1), 4, 6), "not divisible by its tp 4"),
    (lambda: Layout(2, 2, False, (0, 1, 2)), "needs 4 distinct ranks"),
    (lambda: backward_transfers(Layout.contiguous(1, 1, False, 0), Layout.contiguous(1, 2, False, 1), 2, 2, "mean"), "grad_rule"),  # type: ignore[arg-type]
])
def test_bad_boundaries_give_one_clear_error(make: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        make()


# --- execution, simulated in one process ------------------------------------------------------------
def _simulate(transfers: Sequence[Transfer], ranks: Sequence[int], locals_: dict[int, torch.Tensor],
              accumulate: bool = False) -> dict[int, torch.Tensor | None]:
    """Run p2p_ops on every rank and deliver each message to its matching receive, as batch_p2p would."""
    posted = {r: p2p_ops(transfers, r, locals_.get(r), tail=TAIL, dtype=torch.float32, accumulate=accumulate) for r in ranks}
    wire: dict[tuple[int, int], torch.Tensor] = {}
    for r, p in posted.items():
        for op in p.ops:
            if op.kind == "send":
                assert (r, op.peer) not in wire, "more than one message for one peer"
                wire[(r, op.peer)] = op.tensor
    for r, p in posted.items():
        for op in p.ops:
            if op.kind == "recv":
                sent = wire.pop((op.peer, r))
                assert sent.shape == op.tensor.shape and sent.dim() == 1 and sent.is_contiguous()  # as validation demands
                op.tensor.copy_(sent)
    assert not wire, f"sent but never received: {list(wire)}"
    return {r: p.finish() for r, p in posted.items()}


def _global(batch: int, seq: int, offset: float = 0.0) -> torch.Tensor:
    return torch.arange(batch * seq * TAIL[0], dtype=torch.float32).view(batch, seq, *TAIL) + offset


def _at(x: torch.Tensor, block: Block) -> torch.Tensor:
    return x[block.batch[0]:block.batch[1], block.seq[0]:block.seq[1]]


def _partials(grad: torch.Tensor, dst: Layout, rank: int) -> torch.Tensor:
    """What a replicated dst rank holds under "partial": integer parts that sum to ``grad``."""
    t = dst.coord(rank)[1]
    ones = torch.ones_like(grad)
    return grad - ones * sum(range(2, dst.tp + 1)) if t == 0 else ones * (t + 1)


@pytest.mark.parametrize("a", LAYOUT_SPECS, ids=str)
def test_exchange_assembles_exact_slices_and_gradients(a: tuple[int, int, bool]) -> None:
    for b in LAYOUT_SPECS:
        src, dst = _layouts(a, b)
        batch, seq = _minimal(src, dst)
        x, g = _global(batch, seq), _global(batch, seq, 1000.0)
        got = _simulate(plan_transfers(src, dst, batch, seq), src.ranks + dst.ranks,
                        {r: _at(x, src.block(r, batch, seq)) for r in src.ranks})
        for r in dst.ranks:
            assert torch.equal(got[r], _at(x, dst.block(r, batch, seq))), (src, dst, r)
        assert all(got[r] is None for r in src.ranks)
        for rule in ("identical", "partial"):
            boundary = Boundary(src, dst, batch, seq, rule)
            held = {r: _at(g, dst.block(r, batch, seq)) for r in dst.ranks}
            if boundary.accumulate_grads:
                held = {r: _partials(v, dst, r) for r, v in held.items()}
            back = _simulate(boundary.backward, src.ranks + dst.ranks, held, boundary.accumulate_grads)
            for r in src.ranks:
                assert torch.equal(back[r], _at(g, src.block(r, batch, seq))), (src, dst, rule, r)


def test_several_pieces_for_one_peer_travel_as_one_message_in_plan_order() -> None:
    """The planner never makes two pieces per pair, but the packer must handle them (hand-made list)."""
    have = Block((0, 4), (0, 4))
    want = Block((0, 4), (0, 4))
    pieces = [Transfer(0, 1, (0, 2), (2, 4), have, want), Transfer(0, 1, (2, 4), (0, 4), have, want),
              Transfer(0, 1, (0, 2), (0, 2), have, want)]
    x = _global(4, 4)
    got = _simulate(pieces, [0, 1], {0: x})
    assert torch.equal(got[1], x)
    sends = p2p_ops(pieces, 0, x).ops
    assert len(sends) == 1 and sends[0].tensor.numel() == x.numel()
    with pytest.raises(ConfigError, match="cover 4 of its 16"):
        p2p_ops(pieces[:1], 1, tail=TAIL, dtype=torch.float32)


# --- real processes -----------------------------------------------------------------------------------
B, S, H = 6, 6, 4
SCENARIOS: dict[str, tuple[tuple[int, int, bool, int], tuple[int, int, bool, int], str]] = {
    # name: (src dp, tp, sp, offset), (dst dp, tp, sp, offset), grad rule
    "tp2 sp -> dp2": ((1, 2, True, 0), (2, 1, False, 2), "identical"),
    "dp2 -> tp2 sp": ((2, 1, False, 0), (1, 2, True, 2), "identical"),
    "tp2 -> tp2 (replicated both)": ((1, 2, False, 0), (1, 2, False, 2), "identical"),
    "dp2 -> tp2 partial grads": ((2, 1, False, 0), (1, 2, False, 2), "partial"),
    "dp1 -> tp3 sp": ((1, 1, False, 0), (1, 3, True, 1), "identical"),
    "tp3 on 1-3 -> dp1 on 0": ((1, 3, False, 1), (1, 1, False, 0), "identical"),
}


def _flat_communicator() -> Any:
    """The single-island (plain gloo) path over the same processes, beside the bridged world one."""
    import torch.distributed as dist

    from hal.collectives import Communicator, Island, current_world
    from hal.collectives import Layout as RankLayout

    world = current_world()
    ranks = tuple(range(world.size))
    return Communicator(RankLayout(ranks, (Island(0, "cpu", ranks, dist.group.WORLD),), dist.group.WORLD, None), world)


def reshard_world(rank: int, world: int) -> dict[str, Any]:
    """Every scenario on the bridged and on the flat communicator: slices and gradients exact."""
    from hal.collectives import world_communicator

    x = torch.arange(B * S * H, dtype=torch.float32).view(B, S, H)
    g = x * 3 - 7  # the gradient of the global loss w.r.t. the boundary activation
    failures: list[str] = []
    paths = []
    for comm in (world_communicator(), _flat_communicator()):
        paths.append(comm.path)
        for name, (a, b, rule) in SCENARIOS.items():
            name = f"{comm.path}: {name}"
            src, dst = Layout.contiguous(*a[:3], offset=a[3]), Layout.contiguous(*b[:3], offset=b[3])
            boundary = Boundary(src, dst, B, S, rule)  # type: ignore[arg-type]
            if rank in src.ranks:
                local = _at(x, src.block(rank, B, S)).clone().requires_grad_()
                token = boundary.send(comm, local)
                token.backward()  # receives the gradient of local and backpropagates (here: into local.grad)
                want = _at(g, src.block(rank, B, S))
                if local.grad is None or not torch.equal(local.grad, want):
                    failures.append(f"{name}: rank {rank} gradient {local.grad} expected {want}")
            elif rank in dst.ranks:
                got = boundary.recv(comm, tail=(H,), dtype=torch.float32)
                block = dst.block(rank, B, S)
                if not torch.equal(got, _at(x, block)):
                    failures.append(f"{name}: rank {rank} received {got} expected {_at(x, block)}")
                held = _at(g, block)
                if boundary.accumulate_grads:
                    held = _partials(held, dst, rank)
                (got * held).sum().backward()  # d(loss)/d(got) = held, sent back by the Function
    # The plain functions, receive posted asynchronously (what an engine overlapping compute would do).
    comm = _flat_communicator()
    src, dst = Layout.contiguous(1, 2, True, 0), Layout.contiguous(2, 1, False, 2)
    plan = plan_transfers(src, dst, B, S)
    if rank in src.ranks:
        send_activation(comm, plan, _at(x, src.block(rank, B, S)), rank)
    else:
        handle = exchange(comm, plan, rank, tail=(H,), dtype=torch.float32, async_op=True)
        if not torch.equal(handle.wait(), _at(x, dst.block(rank, B, S))):
            failures.append(f"async exchange: rank {rank} assembled the wrong block")
    return {"failures": failures, "paths": paths}


def test_real_processes_reshard_forward_and_backward() -> None:
    """One launch (4 ranks, islands 0,0,1,1): every scenario through the bridge, then on plain gloo."""
    results = run_world("tests.ranks.test_reshard", "reshard_world", 4, deadline_s=90, islands=[0, 0, 1, 1], collective_timeout_s=20)
    assert sorted(results) == [0, 1, 2, 3], results
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
        assert not outcome[1]["failures"], outcome[1]["failures"]
        assert outcome[1]["paths"] == ["bridge", "native gloo"]
