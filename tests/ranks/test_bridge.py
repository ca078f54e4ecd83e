"""The collectives bridge on CPU: declared islands, real processes over gloo.

Each launch starts one process per rank (spawn, file:// rendezvous in tmp_path) and runs every
check inside it: the same call on a bridged world communicator (islands declared) and on a flat
communicator over the same processes (one island, the plain gloo path), compared bitwise. Values
are integer-valued so float sums are exact whatever the addition order. Launches are few because
each costs a rank a process (forked from the tests' server, which imported torch and hal once; HAL_TEST_FORK=0:
spawned interpreters); results come back through a queue, and every process is joined or killed before the test
returns.
"""
from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

CHUNK_BYTES = 256  # tiny, so that every big tensor crosses the wire in many chunks
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
LAUNCH_TIMEOUT_S = 90


# --- the harness (runs in pytest) -------------------------------------------------------------------
def _launch(tmp_path: Path, islands: list[int], timeout_s: float = LAUNCH_TIMEOUT_S,
            channels: list[str] | None = None) -> dict[int, dict[str, Any]]:
    """Run ``_worker`` on every rank; return each rank's report. Leaves no process behind."""
    ctx = _context()
    results: Any = ctx.Queue()
    store = tmp_path / "store"
    channels = channels or [""] * len(islands)  # HAL_BRIDGE_CHANNELS per rank ("": the default)
    procs = [ctx.Process(target=_worker, args=(r, islands, str(store), results, channels[r]), daemon=True)
             for r in range(len(islands))]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < len(procs) and time.monotonic() < deadline:
            try:
                rank, report = results.get(timeout=0.5)
                reports[rank] = report
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(1.0)  # let the others report their side of the failure
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    missing = [r for r in range(len(procs)) if r not in reports]
    assert not missing, f"ranks {missing} did not report (exit codes {[p.exitcode for p in procs]}); reports: {reports}"
    errors = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    return reports


def _context() -> Any:
    """Where the ranks come from: the fork server (``tests.conftest.fork_server``), or fresh interpreters."""
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        import torch.multiprocessing as mp

        return mp.get_context("spawn")
    from ..conftest import fork_server

    return fork_server()


def _assert_clean(reports: dict[int, dict[str, Any]]) -> None:
    failures = [f"rank {r}: {f}" for r, rep in sorted(reports.items()) for f in rep["failures"]]
    assert not failures, "\n".join(failures[:40])
    assert all(rep["checks"] > 100 for rep in reports.values()), {r: rep["checks"] for r, rep in reports.items()}


def test_bridge_matches_flat_two_blocks(tmp_path: Path) -> None:
    reports = _launch(tmp_path, [0, 0, 1, 1], channels=["3"] * 4)  # large messages striped over 3 channels
    _assert_clean(reports)
    assert {rep["path"] for rep in reports.values()} == {"bridge"}
    assert {rep["flat_path"] for rep in reports.values()} == {"native gloo"}
    assert {rep["channels"] for rep in reports.values()} == {3}


def test_bridge_matches_flat_interleaved_on_a_single_stream(tmp_path: Path) -> None:
    reports = _launch(tmp_path, [0, 1, 0], channels=["1"] * 3)
    _assert_clean(reports)
    assert {rep["path"] for rep in reports.values()} == {"bridge"}
    assert {rep["channels"] for rep in reports.values()} == {1}


def test_channel_counts_that_differ_or_make_no_sense_are_refused_on_every_rank(tmp_path: Path) -> None:
    for values, words in ((["2", "3"], "differs between ranks"), (["0", "0"], "1 to 16")):
        store = tmp_path / "-".join(values)
        store.mkdir()
        reports = _launch_expecting_errors(store, [0, 1], values)
        assert all("HAL_BRIDGE_CHANNELS" in rep and words in rep for rep in reports.values()), reports


def test_stripes_are_equal_one_per_channel_at_most_and_at_least_a_mebibyte() -> None:
    from hal.collectives.bridge import MIN_STRIPE_BYTES, stripe_ranges

    mib = MIN_STRIPE_BYTES // 4  # fp32 elements in one minimal stripe (4 MiB)
    assert stripe_ranges(8 * mib, 4, 4) == [(0, 2 * mib), (2 * mib, 4 * mib), (4 * mib, 6 * mib), (6 * mib, 8 * mib)]
    assert stripe_ranges(8 * mib, 4, 1) == [(0, 8 * mib)]  # one channel: the single stream
    assert stripe_ranges(mib + 5, 4, 8) == [(0, mib + 5)]  # under two minimal stripes: never split
    assert stripe_ranges(3 * mib, 4, 8) == [(0, mib), (mib, 2 * mib), (2 * mib, 3 * mib)]  # 3 minimal stripes
    assert stripe_ranges(0, 4, 8) == [(0, 0)]
    for numel in (2 * mib + 1, 7 * mib + 3, 64 * mib - 1):
        ranges = stripe_ranges(numel, 4, 3)
        assert ranges[0][0] == 0 and ranges[-1][1] == numel and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 3


def _launch_expecting_errors(tmp_path: Path, islands: list[int], channels: list[str]) -> dict[int, str]:
    """Like ``_launch`` but every rank is expected to fail; returns each rank's error text."""
    ctx = _context()
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, islands, str(tmp_path / "store"), results, channels[r]), daemon=True)
             for r in range(len(islands))]
    for p in procs:
        p.start()
    errors: dict[int, str] = {}
    try:
        for _ in procs:
            rank, report = results.get(timeout=LAUNCH_TIMEOUT_S)
            errors[rank] = report.get("error", "")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return errors


# --- the worker (runs in each rank's process) ---------------------------------------------------------
def _worker(rank: int, islands: list[int], store: str, results: Any, channels: str = "") -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {"failures": [], "checks": 0}
    try:
        from hal.collectives import init_distributed, shutdown

        os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(CHUNK_BYTES)
        if channels:
            os.environ["HAL_BRIDGE_CHANNELS"] = channels
        world = init_distributed(
            "cpu", init_method=f"file://{store}", rank=rank, world_size=len(islands), islands=islands,
            timeout=datetime.timedelta(seconds=30),
        )
        try:
            _run_checks(world, islands, report)
        finally:
            shutdown()
    except BaseException:  # noqa: BLE001 - the parent shows it
        report["error"] = traceback.format_exc()
    results.put((rank, report))


def _flat_communicator(world: Any) -> Any:
    """The single-island path over the same processes: one gloo island holding every rank."""
    import torch.distributed as dist

    from hal.collectives import Communicator, Island, Layout

    ranks = tuple(range(world.size))
    island = Island(0, "cpu", ranks, dist.group.WORLD)
    return Communicator(Layout(ranks, (island,), dist.group.WORLD, None), world)


def _run_checks(world: Any, islands: list[int], report: dict[str, Any]) -> None:
    from hal.collectives import CollectiveError, world_communicator

    flat = _flat_communicator(world)
    report["flat_path"] = flat.path
    for stage in ("auto", "always"):  # host tensors as they are / through staging buffers like a device
        os.environ["HAL_BRIDGE_STAGE"] = stage
        comm = world_communicator()
        report["path"] = comm.path
        report["channels"] = len(comm.layout.channels)
        _expect(report, f"stage={stage}: staging flag", comm._bridge.stages == (stage == "always"))
        check = _Checker(report, stage)
        for dtype in DTYPES:
            _check_reductions(comm, flat, dtype, check)
            _check_movement(comm, flat, dtype, check)
        _check_p2p(comm, flat, islands, check)
    # A chunk size that differs between ranks is refused on every rank, not left to hang.
    os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(CHUNK_BYTES * (2 if world.rank == 0 else 1))
    try:
        world_communicator()
        _expect(report, "differing chunk sizes were not refused", False)
    except CollectiveError as exc:
        _expect(report, f"chunk-size error names the variable: {exc}", "HAL_BRIDGE_CHUNK_BYTES" in str(exc))


class _Checker:
    def __init__(self, report: dict[str, Any], stage: str) -> None:
        self.report = report
        self.stage = stage

    def same(self, what: str, got: Any, want: Any) -> None:
        if isinstance(want, list) or want is None:
            ok = (got is None) == (want is None) and (want is None or len(got) == len(want) and all(_bitwise(g, w) for g, w in zip(got, want)))
        else:
            ok = _bitwise(got, want)
        _expect(self.report, f"stage={self.stage} {what}: got {_short(got)}, want {_short(want)}", ok)


def _expect(report: dict[str, Any], what: str, ok: bool) -> None:
    report["checks"] += 1
    if not ok:
        report["failures"].append(what)


def _bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape or got.device != want.device:
        return False
    return torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{tuple(value.shape)} {value.reshape(-1)[:6].tolist()}"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value[:3]) + "]"
    return repr(value)


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, low: int, high: int, salt: int = 0) -> torch.Tensor:
    """Integer-valued data, different on every rank, the same every time it is asked for."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def _both(comm: Any, flat: Any, fn: Callable[[Any, torch.Tensor], Any], make: Callable[[], torch.Tensor]) -> tuple[Any, Any]:
    return fn(comm, make()), fn(flat, make())


def _ops_for(dtype: torch.dtype) -> list[str]:
    return ["sum", "max", "min", "product"] + (["avg"] if dtype.is_floating_point else [])


def _range_for(op: str) -> tuple[int, int]:
    return (1, 4) if op == "product" else (-8, 12)  # products of ≤4 values stay exact in bf16


def _check_reductions(comm: Any, flat: Any, dtype: torch.dtype, check: _Checker) -> None:
    rank, size = comm.rank, comm.size
    name = str(dtype).replace("torch.", "")
    for op in _ops_for(dtype):
        low, high = _range_for(op)
        for shape in ((6, 5), (700,)):  # 700 elements = many 256-byte chunks between the leaders
            make = lambda: _data(rank, shape, dtype, low, high, salt=len(shape))  # noqa: E731
            tensor = make()
            got = comm.all_reduce(tensor, op)
            check.same(f"all_reduce {op} {name} {shape}", got, flat.all_reduce(make(), op))
            _expect(check.report, f"all_reduce {op} {name} returns its input", got is tensor)
        strided = lambda: _data(rank, (5, 4), dtype, low, high, salt=7).t()  # noqa: E731
        check.same(f"all_reduce {op} {name} non-contiguous", *_both(comm, flat, lambda c, t: c.all_reduce(t, op), strided))
        rs = lambda: _data(rank, (size * 3, 2), dtype, low, high, salt=3)  # noqa: E731
        check.same(f"reduce_scatter {op} {name}", *_both(comm, flat, lambda c, t: c.reduce_scatter(t, op), rs))
    for op in ("sum", "max") + (("avg",) if dtype.is_floating_point else ()):
        dst = size - 1
        got, want = _both(comm, flat, lambda c, t: c.reduce(t, dst, op), lambda: _data(rank, (4, 3), dtype, -8, 12, salt=5))
        if rank == dst:
            check.same(f"reduce {op} {name} to {dst}", got, want)


def _check_movement(comm: Any, flat: Any, dtype: torch.dtype, check: _Checker) -> None:
    rank, size = comm.rank, comm.size
    name = str(dtype).replace("torch.", "")
    rows = [2, 0, 3, 1][rank]  # uneven, one rank with nothing
    uneven = lambda: _data(rank, (rows, 3), dtype, -50, 50, salt=11)  # noqa: E731
    check.same(f"all_gather uneven {name}", *_both(comm, flat, lambda c, t: c.all_gather(t), uneven))
    check.same(f"all_gather_list uneven {name}", *_both(comm, flat, lambda c, t: c.all_gather_list(t), uneven))
    equal = lambda: _data(rank, (40, 3), dtype, -50, 50, salt=12)  # noqa: E731
    check.same(f"all_gather even {name}", *_both(comm, flat, lambda c, t: c.all_gather(t), equal))
    a2a = lambda: _data(rank, (size * 2, 3), dtype, -50, 50, salt=13)  # noqa: E731
    check.same(f"all_to_all even {name}", *_both(comm, flat, lambda c, t: c.all_to_all(t), a2a))
    splits = [(rank + j) % 3 for j in range(size)]
    a2a_u = lambda: _data(rank, (sum(splits), 2), dtype, -50, 50, salt=14)  # noqa: E731
    check.same(f"all_to_all uneven {name}", *_both(comm, flat, lambda c, t: c.all_to_all(t, input_splits=splits), a2a_u))
    src = size - 1
    check.same(f"broadcast from {src} {name}",
               *_both(comm, flat, lambda c, t: c.broadcast(t, src), lambda: _data(rank, (3, 5), dtype, -50, 50, salt=15)))
    dst = size - 1
    check.same(f"gather to {dst} {name}", *_both(comm, flat, lambda c, t: c.gather(t, dst), lambda: _data(rank, (2, 3), dtype, -50, 50, salt=16)))
    chunks = [_data(i, (4,), dtype, -50, 50, salt=17) for i in range(size)] if rank == 1 else None
    got = comm.scatter(torch.zeros(4, dtype=dtype), chunks, src=1)
    check.same(f"scatter from 1 {name}", got, flat.scatter(torch.zeros(4, dtype=dtype), chunks, src=1))
    check.same(f"scatter from 1 {name} = my chunk", got, _data(rank, (4,), dtype, -50, 50, salt=17))


def _check_p2p(comm: Any, flat: Any, islands: list[int], check: _Checker) -> None:
    """Ring send/recv (crossing islands and not) and a cross-island pair swapping two big tensors."""
    from hal.collectives import P2P

    rank, size = comm.rank, comm.size
    big = 1000  # elements: 4000 bytes of fp32 = 16 chunks of 256 bytes
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        mine = _data(rank, (big,), dtype, -100, 100, salt=21)
        ops = [P2P("send", mine, nxt), P2P("recv", torch.zeros(big, dtype=dtype), prv)]
        got = comm.batch_p2p(ops)
        check.same(f"ring recv {name} from {prv} (island {islands[prv]} -> {islands[rank]})", got[0], _data(prv, (big,), dtype, -100, 100, salt=21))
        flat_got = flat.batch_p2p([P2P("send", mine, nxt), P2P("recv", torch.zeros(big, dtype=dtype), prv)])
        check.same(f"ring recv {name} equals the flat path", got[0], flat_got[0])
    # Rank 0 and the first rank of another island swap two tensors of different sizes (one
    # non-contiguous on the receiving side); the rest stay out of it.
    peer = next(r for r in range(size) if islands[r] != islands[0])
    if rank in (0, peer):
        other = peer if rank == 0 else 0
        a, b = _data(rank, (37, 11), torch.float32, -9, 9, salt=31), _data(rank, (5,), torch.int64, -9, 9, salt=32)
        into_a = torch.zeros(11, 37).t()  # non-contiguous receive buffer
        got = comm.batch_p2p([
            P2P("send", a, other), P2P("send", b, other), P2P("recv", into_a, other), P2P("recv", torch.zeros(5, dtype=torch.int64), other),
        ])
        check.same("pair swap: first tensor", got[0], _data(other, (37, 11), torch.float32, -9, 9, salt=31))
        check.same("pair swap: second tensor", got[1], _data(other, (5,), torch.int64, -9, 9, salt=32))
        _expect(check.report, "pair swap: received into the caller's tensor", got[0] is into_a)
        if rank == 0:
            comm.send(_data(rank, (3000,), torch.float32, -9, 9, salt=33), other)
        else:
            got_big = comm.recv(torch.empty(3000), 0)[0]
            check.same("send/recv 12 KB across islands", got_big, _data(0, (3000,), torch.float32, -9, 9, salt=33))
    comm.barrier()
    _check_striped(islands, check)


def _check_striped(islands: list[int], check: _Checker) -> None:
    """Messages of several MiB, split over the host channels (each stripe chunked on its own channel, in
    its own thread), both ways at once between rank 0 and the first rank of another island."""
    from hal.collectives import P2P, world_communicator

    os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(256 * 1024)
    comm = world_communicator(validate=False)
    os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(CHUNK_BYTES)
    rank, size = comm.rank, comm.size
    peer = next(r for r in range(size) if islands[r] != islands[0])
    if rank in (0, peer):
        other = peer if rank == 0 else 0
        shapes = {0: ((3 * 2**20 + 7,), torch.float32), peer: ((3000, 2801), torch.bfloat16)}  # 12 MiB + 28 B; 16 MiB
        mine, theirs = shapes[rank], shapes[other]
        into = torch.zeros(theirs[0][::-1], dtype=theirs[1]).t() if len(theirs[0]) == 2 else torch.zeros(theirs[0], dtype=theirs[1])
        got = comm.batch_p2p([P2P("send", _data(rank, *mine, -50, 50, salt=41), other), P2P("recv", into, other)])
        check.same(f"striped swap over {len(comm.layout.channels)} channel(s), {theirs[0]} {theirs[1]}", got[0],
                   _data(other, *theirs, -50, 50, salt=41))
    comm.barrier()
    # One rank an island (the replicas' speakers): the leaders' sum of 12 MiB is striped over the channels too.
    os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(256 * 1024)
    pair = comm.subgroup([0, peer], validate=False)
    os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(CHUNK_BYTES)
    if rank in (0, peer):
        shape = (3 * 2**20 + 5,)
        summed = pair.all_reduce(_data(rank, shape, torch.float32, -50, 50, salt=43), "sum")
        want = _data(0, shape, torch.float32, -50, 50, salt=43) + _data(peer, shape, torch.float32, -50, 50, salt=43)
        check.same(f"striped sum of one rank an island over {len(pair.layout.channels)} channel(s)", summed, want)
        # ... and an all-gather, as messages striped over the channels (uneven rows: 9 MiB + 8 B beside 6 MiB)
        rows = {0: 3 * 2**20 // 4 + 2, peer: 2**20 // 2}
        gathered = pair.all_gather(_data(rank, (rows[rank], 3), torch.float32, -50, 50, salt=47),
                                   sizes=[rows[0], rows[peer]])
        want = torch.cat([_data(r, (rows[r], 3), torch.float32, -50, 50, salt=47) for r in (0, peer)])
        check.same(f"striped all_gather of one rank an island over {len(pair.layout.channels)} channel(s)", gathered,
                   want)
    comm.barrier()


def test_the_bridge_benchmark_times_each_channel_count_against_the_single_stream() -> None:
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    from ..plain_client import run_plain, shared

    argv = [str(root / "benchmarks" / "bridge.py"), "--cpu-only", "--sizes-mib", "2", "--iters", "1", "--warmup", "0",
            "--channels", "1,2", "--chunk-mib", "0.25", "--json", "--timeout", "120"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=180, cwd=root, env=env)
    else:  # forked from the plain server (torch imported once): its ranks' zygote is then its own fork
        run = run_plain(shared(), argv, env, root, 180)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)
    row = summary["rows"][0]
    assert summary["channels"] == [1, 2] and set(row["bridge_gbps"]) == {"1", "2"}  # JSON keys are strings
    assert all(v > 0 for v in row["bridge_gbps"].values()) and row["striped_over_single"] > 0
    assert "p2p" in summary["correctness"]


def test_an_asynchronous_bridged_receive_returns_before_its_peer_sends(tmp_path: Path) -> None:
    """Bridged point-to-point calls run on the communicator's own thread (collectives.serial_worker): an asynchronous
    post returns at once, so a pipeline stage computes on while its transfer waits (issue: transfers off the
    critical path); calls keep their posting order."""
    from ..dist_harness import ok_values, run_world

    values = ok_values(run_world("tests.collective_cases", "async_bridged_p2p", 2, deadline_s=90, islands=[0, 1],
                                 gate=str(tmp_path / "gate")), 2)
    assert values[0] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]


def test_serial_worker_keeps_order_and_hands_back_errors() -> None:
    from hal.collectives.serial_worker import SerialWorker

    worker = SerialWorker("test")
    seen: list[int] = []
    futures = [worker.submit(lambda i=i: seen.append(i) or i) for i in range(20)]
    failing = worker.submit(lambda: 1 / 0)
    assert [f.result(timeout=10) for f in futures] == list(range(20)) and seen == list(range(20))
    try:
        failing.result(timeout=10)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the job's error was not handed back")
    worker.close()
