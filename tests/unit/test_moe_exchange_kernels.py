"""The symmetric-memory MoE exchange kernels (hal.kernels.triton.moe_exchange), ranks simulated in one process.

Each simulated rank's buffers are ordinary tensors; a "peer" is reached by the same delta addressing the GPU
uses over CUDA symmetric memory, so the addressing, the routing arithmetic and the layout are what is tested
(the barriers and the real cross-GPU stores run in tests/test_moe_exchange_cuda.py). Without a GPU the kernels
run in Triton's interpreter:

    TRITON_INTERPRET=1 pytest tests/unit/test_moe_exchange_kernels.py
"""
from __future__ import annotations

import pytest
import torch

from ..triton_mode import interpret_unless_gpu, require_mode

DEVICE = interpret_unless_gpu()
ON_GPU = DEVICE.type == "cuda"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'hetero-hal[kernels]')")

from hal.kernels.triton import moe_exchange  # noqa: E402
from hal.parallel.models.moe import dispatch_key  # noqa: E402

pytestmark = require_mode(DEVICE, moe_exchange._route, "tests/unit/test_moe_exchange_kernels.py")


def _ranks(world: int, local: int, tokens: list[int], k: int, hidden: int, skew: bool, seed: int) -> list[dict]:
    """Each rank's routed rows, sorted by dispatch_key, with distinct values (rank, row, column)."""
    E = world * local
    gen = torch.Generator().manual_seed(seed)
    out = []
    for me, T in enumerate(tokens):
        logits = torch.randn(T, E, generator=gen)
        if skew:
            logits[:, 0] += 6.0  # expert 0 (rank 0) takes nearly every token; the last rank's experts almost none
            logits[:, E - local:] -= 30.0
        experts = torch.topk(logits, k, dim=-1).indices.reshape(-1)
        order = torch.argsort(dispatch_key(experts, world, local), stable=True)
        n = T * k
        rows = (me * 1e6 + torch.arange(n * hidden, dtype=torch.float32).reshape(n, hidden))
        index = torch.int32 if seed % 2 else torch.int64  # MoE passes int64 (bincount, argsort); int32 reads alike
        out.append({"rows": rows.to(DEVICE), "expert": experts[order].to(index).to(DEVICE),
                    "load": torch.bincount(experts, minlength=E).to(index).to(DEVICE)})
    return out


def _exchange(world: int, local: int, tokens: list[int], k: int = 2, hidden: int = 24, *, skew: bool = False,
              seed: int = 0, capacity: int | None = None, bad_slot: int | None = None, fused: bool = True) -> None:
    """Every simulated rank has four slots -- two staging (capacity rows), one durable for rows (capacity), one
    durable for rows coming back (its rows) -- and posts its own choice: even ranks receive rows in the durable
    slot, odd ones in staging 0; odd ranks take rows back in the durable slot, even ones in staging 1. The rank
    ``bad_slot`` posts a slot out of range: nothing may be stored for it anywhere. ``fused``: each rank routes and
    pushes in one launch (``route_and_push``, what dispatch runs), else ``route`` then ``push_rows``."""
    E = world * local
    ranks = _ranks(world, local, tokens, k, hidden, skew, seed)
    N = max(tokens) * k
    cap = capacity if capacity is not None else world * N
    spare = 8  # rows past each slot's capacity: a store there is a bounds bug
    nan = float("nan")
    full = [[torch.full((cap + spare, hidden), nan, device=DEVICE) for _ in range(3)]
            + [torch.full((N + spare, hidden), nan, device=DEVICE)] for _ in range(world)]
    posted = [(2 if me % 2 == 0 else 0, 3 if me % 2 else 1) for me in range(world)]
    if bad_slot is not None:
        posted[bad_slot] = (7, -1)
    fwd_full = [full[me][posted[me][0]] if posted[me][0] < 4 else None for me in range(world)]
    back_full = [full[me][posted[me][1]] if 0 <= posted[me][1] < 4 else None for me in range(world)]
    tables = [torch.zeros(world, E + 2, dtype=torch.int32, device=DEVICE) for _ in range(world)]

    def deltas(bufs: list[torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
        return moe_exchange.peer_deltas([b.data_ptr() for b in bufs], anchor.data_ptr(), DEVICE)

    slot_deltas = [torch.stack([deltas([full[r][j] for r in range(world)], full[me][0]) for j in range(4)])
                   for me in range(world)]
    for me in range(world):
        moe_exchange.post_counts(ranks[me]["load"], tables[me], deltas(tables, tables[me]), me, posted[me])
    want_table = torch.cat([torch.stack([r["load"].cpu() for r in ranks]).int(), torch.tensor(posted).int()], dim=1)
    for me in range(world):
        assert torch.equal(tables[me].cpu(), want_table), "every table holds every rank's counts and slots"
    if fused:
        routes = [moe_exchange.route_and_push(tables[me], me, local, slot_deltas[me], ranks[me]["rows"], full[me][0],
                                              ranks[me]["expert"], cap) for me in range(world)]
    else:
        routes = [moe_exchange.route(tables[me], me, local, slot_deltas[me]) for me in range(world)]
        for me in range(world):
            dest_delta = moe_exchange.split_routes(routes[me][0], E, world)["dest_delta"]
            moe_exchange.push_rows(ranks[me]["rows"], full[me][0], dest_delta, ranks[me]["expert"], routes[me][0], local, cap)
    outs = []
    for owner in range(world):
        # expected: for local expert j, for source s in rank order, s's rows of expert owner*local + j in order
        blocks, sizes = [], []
        for j in range(local):
            for s in range(world):
                got = ranks[s]["rows"][ranks[s]["expert"] == owner * local + j]
                blocks.append(got)
                sizes.append(got.shape[0])
        expected = torch.cat(blocks)
        offs, blk_end = routes[owner][1], moe_exchange.split_routes(routes[owner][0], E, world)["blk_end"]
        per_expert = [sum(sizes[j * world:(j + 1) * world]) for j in range(local)]
        assert offs.cpu().tolist() == torch.tensor(per_expert).cumsum(0).tolist()
        assert blk_end.cpu().tolist() == torch.tensor(sizes).cumsum(0).tolist()
        total = expected.shape[0]
        for j in range(4):
            if j != posted[owner][0]:
                assert torch.isnan(full[owner][j]).all(), f"rank {owner}: rows landed in slot {j}, which it did not post"
        if fwd_full[owner] is None:
            outs.append(None)
            continue
        arrived = fwd_full[owner][:cap]
        if total > cap:  # too small a buffer: what fits is right, and nothing is written past it
            assert torch.isnan(fwd_full[owner][cap:]).all()
            continue
        assert torch.equal(arrived[:total], expected), f"rank {owner}: rows in the wrong places"
        assert torch.isnan(fwd_full[owner][total:]).all()
        out = torch.full((world * N, hidden), nan, device=DEVICE)
        moe_exchange.copy_arrived(arrived, out, offs)
        assert torch.equal(out[:total], expected) and torch.isnan(out[total:]).all(), "only the arrived rows are copied"
        # an "expert" that scales each local expert's rows differently, so a row sent back to the wrong place shows
        scale = torch.repeat_interleave(torch.arange(2.0, 2.0 + local), torch.tensor(per_expert)).to(DEVICE)
        out[:total] *= scale[:, None]
        outs.append(out)
    if capacity is not None and capacity < world * N:
        return
    for me in range(world):
        full[me][posted[me][0] if posted[me][0] < 4 else 0].fill_(nan)  # the way back must not touch the rows' slots
    for owner in range(world):
        if outs[owner] is not None:  # odd owners name the slots themselves, even ones take those posted: the same
            named = moe_exchange.split_routes(routes[owner][0], E, world)["back_delta"] if owner % 2 else None
            moe_exchange.push_back(outs[owner], full[owner][0], named, routes[owner][0], E, world, N)
    for me in range(world):
        n = tokens[me] * k
        for j in range(4):
            if j != posted[me][1]:
                assert torch.isnan(full[me][j]).all(), f"rank {me}: rows came back into slot {j}, which it did not post"
        if back_full[me] is None:
            assert all(torch.isnan(full[me][j]).all() for j in range(4)), f"rank {me} posted no valid slot, got rows"
            continue
        rows, expert = ranks[me]["rows"], ranks[me]["expert"].long()
        want = rows * (2.0 + (expert % local)).to(rows.dtype)[:, None]
        sent_by_lost = (expert // local == bad_slot) if bad_slot is not None else torch.zeros_like(expert, dtype=torch.bool)
        got = back_full[me][:n]
        assert torch.equal(got[~sent_by_lost], want[~sent_by_lost]), f"rank {me}: outputs came back to the wrong rows"
        assert torch.isnan(got[sent_by_lost]).all(), "rows the lost rank held cannot come back"
        assert torch.isnan(back_full[me][n:]).all()


FUSED = pytest.mark.parametrize("fused", [True, False], ids=["route_and_push", "route_then_push"])


@FUSED
@pytest.mark.parametrize("world,local", [(2, 1), (2, 2), (4, 2), (3, 3)])
def test_rows_land_in_expert_blocks_and_come_back(world: int, local: int, fused: bool) -> None:
    _exchange(world, local, [5] * world, seed=world * 10 + local, fused=fused)


@FUSED
def test_uneven_token_counts_and_a_hidden_size_off_the_tile(fused: bool) -> None:
    _exchange(4, 2, [7, 1, 4, 9], k=2, hidden=300, fused=fused)


@FUSED
def test_skewed_routing_one_rank_gets_most_one_gets_none(fused: bool) -> None:
    _exchange(4, 1, [6] * 4, k=1, skew=True, seed=3, fused=fused)


@FUSED
def test_a_buffer_too_small_is_never_written_past(fused: bool) -> None:
    _exchange(2, 2, [6, 6], capacity=5, seed=1, fused=fused)


@FUSED
def test_a_slot_posted_out_of_range_is_never_stored_into(fused: bool) -> None:
    _exchange(4, 2, [5] * 4, bad_slot=1, seed=5, fused=fused)


def test_more_rows_than_one_program_route_the_same_in_every_program() -> None:
    """Rows spread over several programs of the fused launch: each works the route out itself."""
    _exchange(2, 2, [150, 90], k=2, hidden=16, seed=7, fused=True)


def test_peer_deltas_refuse_misaligned_buffers() -> None:
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe_exchange.peer_deltas([1000, 1004], 1000, DEVICE)
