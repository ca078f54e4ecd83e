"""The exchange's barriers (``moe_exchange.Barrier``: flags the launches set in their peers and wait on), with the
ranks really at once: one process a rank, its buffers in shared memory mapped before the fork (so every "peer"
is reached by the same delta addressing), kernels in Triton's interpreter. The ranks start a fraction of a
second apart, so a launch that did not wait for its peers would read a table or a slot they have not written
yet -- each rank checks what it holds the moment its own launch returns.

(tests/test_moe_exchange_kernels.py covers the routing with the ranks one after another; the memory ordering
on real devices is for tests/test_moe_dispatch.py on GPUs.)
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from .triton_mode import interpret_unless_gpu, require_mode

DEVICE = interpret_unless_gpu()
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'hetero-hal[kernels]')")

from hal.kernels.triton import moe_exchange  # noqa: E402
from hal.parallel.moe import dispatch_key  # noqa: E402

pytestmark = [*require_mode(DEVICE, moe_exchange._route, "tests/test_moe_exchange_barrier.py"), pytest.mark.multiprocess,
              pytest.mark.skipif(DEVICE.type != "cpu", reason="simulated ranks: the interpreter's processes"),
              pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork (shared mappings)")]

WORLD, LOCAL, HIDDEN, STAGGER_S = 3, 2, 8, 0.3


def _setup() -> dict[str, Any]:
    """Every rank's inputs and buffers, in shared memory (mapped at the same addresses in every forked rank)."""
    E = WORLD * LOCAL
    gen = torch.Generator().manual_seed(11)
    ranks = []
    for me in range(WORLD):
        experts = torch.randint(0, E, (5 + 3 * me,), generator=gen)
        order = torch.argsort(dispatch_key(experts, WORLD, LOCAL), stable=True)
        rows = me * 1000 + torch.arange(experts.numel() * HIDDEN, dtype=torch.float32).reshape(-1, HIDDEN)
        ranks.append({"rows": rows, "expert": experts[order], "load": torch.bincount(experts, minlength=E)})
    n_max = max(r["rows"].shape[0] for r in ranks)
    cap = WORLD * n_max

    def shared(*shape: int, dtype: torch.dtype = torch.float32, fill: float = float("nan")) -> torch.Tensor:
        return torch.full(shape, fill, dtype=dtype).share_memory_()

    return {"ranks": ranks, "cap": cap, "n_max": n_max,
            "slots": [shared(cap, HIDDEN) for _ in range(WORLD)],  # rows arrive here
            "back": [shared(n_max, HIDDEN) for _ in range(WORLD)],  # and come back here
            "tables": [shared(WORLD, E + 2, dtype=torch.int32, fill=-1) for _ in range(WORLD)],
            "flags": [shared(WORLD, dtype=torch.int64, fill=0) for _ in range(WORLD)],
            "done": [shared(1, dtype=torch.int32, fill=0) for _ in range(WORLD)]}


def _expected_arrival(s: dict[str, Any], owner: int) -> torch.Tensor:
    """What lands on ``owner``: for each local expert, each source's rows of it in rank order."""
    return torch.cat([r["rows"][r["expert"] == owner * LOCAL + j] for j in range(LOCAL) for r in s["ranks"]])


def _rank(me: int, s: dict[str, Any], results: Any) -> None:
    """One rank: post counts, push rows, push them back, each launch ending in its barrier; after each, check at
    once that every peer's part is already here."""
    torch.set_num_threads(1)
    problems = []
    try:
        time.sleep(STAGGER_S * me)  # rank 0 runs first: without a wait it would see nothing of the others
        cpu = torch.device("cpu")

        def deltas(bufs: list[torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
            return moe_exchange.peer_deltas([b.data_ptr() for b in bufs], anchor.data_ptr(), cpu)

        barrier = moe_exchange.Barrier(s["flags"][me], deltas(s["flags"], s["flags"][me]), s["done"][me], me)
        r = s["ranks"][me]
        # rows into slot 0 (the arrival slots), rows back into slot 1 (the back slots); anchor: this rank's arrival slot
        slot_deltas = torch.stack([deltas(s["slots"], s["slots"][me]), deltas(s["back"], s["slots"][me])])
        moe_exchange.post_counts(r["load"], s["tables"][me], deltas(s["tables"], s["tables"][me]), (0, 1), barrier, 1)
        loads = torch.stack([p["load"] for p in s["ranks"]]).int()
        if not torch.equal(s["tables"][me][:, :-2], loads):
            problems.append(f"rank {me}: after its count barrier its table lacks a peer's counts: {s['tables'][me].tolist()}")
        routes, offs = moe_exchange.route_and_push(s["tables"][me], me, LOCAL, slot_deltas, r["rows"], s["slots"][me],
                                                   r["expert"], s["cap"], barrier, 2)
        want = _expected_arrival(s, me)
        if not torch.equal(s["slots"][me][: want.shape[0]], want):
            problems.append(f"rank {me}: after its rows barrier some peer's rows have not arrived")
        out = s["slots"][me] * 2  # the "experts"
        moe_exchange.push_back(out, s["slots"][me], None, routes, WORLD * LOCAL, WORLD, s["n_max"], barrier, 3)
        n = r["rows"].shape[0]
        if not torch.equal(s["back"][me][:n], r["rows"] * 2):
            problems.append(f"rank {me}: after its way-back barrier some rows have not come back")
        if s["flags"][me].tolist() != [3] * WORLD:
            problems.append(f"rank {me}: flags {s['flags'][me].tolist()} after three barriers")
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test with it
        problems.append(f"rank {me}: {type(exc).__name__}: {exc}")
    results.put((me, problems))


def test_every_launch_waits_for_its_peers_and_sees_what_they_stored() -> None:
    s = _setup()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(me, s, results), daemon=True) for me in range(WORLD)]
    for p in procs:
        p.start()
    got: dict[int, list[str]] = {}
    deadline = time.monotonic() + 120
    try:
        while len(got) < WORLD and time.monotonic() < deadline:
            try:
                me, problems = results.get(timeout=1)
                got[me] = problems
            except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
                pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert len(got) == WORLD, f"ranks {sorted(set(range(WORLD)) - set(got))} never finished (a barrier that never opens)"
    assert [line for me in sorted(got) for line in got[me]] == []
