"""``hal bench collectives``: a real 3-rank run through the CLI, and the exact checker on its own."""
from __future__ import annotations

import json
import random

import pytest
import torch

from hal.cli import bench as bench_cmd
from hal.collectives import bench
from hal.collectives.bench import OPS, ROOT, count_wrong, fill_input, shape_for
from hal.errors import ConfigError

from ..conftest import has_cuda, run_hal


def test_cpu_three_ranks_json_every_op_correct_with_nccl_tests_arithmetic() -> None:
    result = run_hal(
        "bench", "collectives", "--backend", "cpu", "--world-size", "3", "--sizes", "8B..64K",
        "--iters", "2", "--warmup", "1", "--rounds", "1", "--json", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    header, rows = report["header"], report["rows"]
    assert header["world_size"] == 3 and header["backend"] == "cpu" and len(header["devices"]) == 3
    assert header["torch"] == torch.__version__ and "validate=False" in header["ours"]
    assert "correctness feature" in header["validation"]
    assert report["correct"] is True
    assert {r["op"] for r in rows} == set(OPS)
    for row in rows:
        assert row["ours"]["wrong"] == 0 and row["raw"]["wrong"] == 0, row
        assert row["ours"]["time_us"] > 0 and row["raw"]["time_us"] > 0
        assert row["busbw_ratio"] == pytest.approx(row["ours"]["busbw_gbps"] / row["raw"]["busbw_gbps"])
    # Progress: one line per op/dtype on stderr.
    assert sum(line.startswith("hal bench: [") for line in result.stderr.splitlines()) == len(OPS)

    def row(op: str) -> dict:
        return max((r for r in rows if r["op"] == op), key=lambda r: r["size"])

    ar = row("all_reduce")
    assert ar["size"] == 65536 and ar["count"] == 16384
    algbw = ar["size"] / (ar["ours"]["time_us"] * 1e-6) / 1e9
    assert ar["ours"]["algbw_gbps"] == pytest.approx(algbw)
    assert ar["ours"]["busbw_gbps"] == pytest.approx(algbw * 2 * 2 / 3)  # 2(n-1)/n
    ag = row("all_gather")  # size = the gathered output: 3 equal pieces of floor(16384 / 3) elements
    assert ag["count"] == 3 * (16384 // 3) and ag["size"] == 4 * ag["count"]
    assert ag["raw"]["busbw_gbps"] == pytest.approx(ag["raw"]["algbw_gbps"] * 2 / 3)  # (n-1)/n
    for op in ("broadcast", "reduce"):
        assert row(op)["ours"]["busbw_gbps"] == pytest.approx(row(op)["ours"]["algbw_gbps"])
    assert header["bus_factors"] == pytest.approx(
        {"all_reduce": 4 / 3, "all_gather": 2 / 3, "reduce_scatter": 2 / 3, "all_to_all": 2 / 3, "broadcast": 1, "reduce": 1}
    )


def _simulate(op: str, inputs: list[torch.Tensor], rank: int, rng: random.Random) -> torch.Tensor:
    """What ``op`` leaves on ``rank``, computed in the dtype's own arithmetic in a random order."""
    n = len(inputs)

    def shuffled_sum(parts: list[torch.Tensor]) -> torch.Tensor:
        order = list(parts)
        rng.shuffle(order)
        total = order[0].clone()
        for part in order[1:]:
            total += part  # in the dtype: bf16 rounding would show here if the rule were wrong
        return total

    if op in ("all_reduce", "reduce"):
        return shuffled_sum(inputs)
    if op == "reduce_scatter":
        return shuffled_sum(inputs).chunk(n)[rank].clone()
    if op == "all_gather":
        return torch.cat(inputs)
    if op == "all_to_all":
        return torch.cat([x.chunk(n)[rank] for x in inputs])
    if op == "broadcast":
        return inputs[ROOT].clone()
    raise AssertionError(op)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.float32])
@pytest.mark.parametrize("op", OPS)
def test_checker_accepts_the_true_result_and_counts_corrupted_elements(op: str, dtype: torch.dtype) -> None:
    n, rank, rng = 5, 1 if op != "reduce" else ROOT, random.Random(0)
    shape = shape_for(op, 4096, torch.empty((), dtype=dtype).element_size(), n)
    inputs = [fill_input(torch.empty(shape.numel_in, dtype=dtype), op, r, n) for r in range(n)]
    result = _simulate(op, inputs, rank, rng)
    assert count_wrong(op, result, rank=rank, world_size=n) == 0
    corrupted = result.clone()
    where = rng.sample(range(corrupted.numel()), 7)
    corrupted[where] = corrupted[where] + 1  # a deliberately wrong answer in 7 places
    assert count_wrong(op, corrupted, rank=rank, world_size=n) == 7


def test_checker_sees_an_unwritten_receive_buffer() -> None:
    """Receive buffers are zeroed before the check and 0 is never a right answer."""
    out = torch.zeros(30, dtype=torch.float32)
    assert count_wrong("all_gather", out, rank=0, world_size=3) == 30
    assert count_wrong("reduce", out, rank=1, world_size=3) == 0  # a non-root reduce result is undefined


def test_sum_of_small_ints_stays_exact_in_bfloat16_at_the_limit() -> None:
    """The rule: inputs in 1..k, k = min(3, L // n); at n = 128, k = 2 and sums reach L = 256 exactly."""
    assert bench.exact_int_limit(torch.bfloat16) == 256 and bench.exact_int_limit(torch.float16) == 2048
    assert bench.reduce_levels(torch.bfloat16, 128) == 2 and bench.reduce_levels(torch.bfloat16, 257) == 0
    n = 128
    inputs = [fill_input(torch.empty(64, dtype=torch.bfloat16), "all_reduce", r, n) for r in range(n)]
    assert count_wrong("all_reduce", _simulate("all_reduce", inputs, 0, random.Random(1)), rank=0, world_size=n) == 0


def test_sizes_parse_like_nccl_tests() -> None:
    assert bench.parse_sizes("8B..64K") == [8 << i for i in range(14)]
    assert bench.parse_sizes("1GiB") == [1 << 30]
    assert bench.parse_sizes("1M..3M") == [1 << 20, 2 << 20]
    assert bench.parse_size("64KB") == bench.parse_size("64k") == 65536
    for bad in ("", "8X", "0B", "-1K", "1.5M", "1M..8B"):
        with pytest.raises(ConfigError):
            bench.parse_sizes(bad)


def test_plan_refuses_a_dtype_that_cannot_stay_exact() -> None:
    with pytest.raises(ConfigError, match="cannot be checked exactly"):
        bench.make_plan(backend="cpu", world_size=300, sizes="8B", dtypes="bfloat16", ops="all_reduce", iters=1, warmup=0)
    # Data movement needs no sums: the same request without a reduction is fine.
    plan = bench.make_plan(backend="cpu", world_size=300, sizes="8B", dtypes="bfloat16", ops="broadcast", iters=1, warmup=0)
    assert plan.world_size == 300


def test_any_wrong_element_makes_the_exit_status_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"ours": {"wrong": 0}, "raw": {"wrong": 0}, "op": "all_reduce", "dtype": "float32", "size": 8}
    bad = {**good, "raw": {"wrong": 2}}
    for rows, status in (([good], 0), ([good, bad], 1)):
        monkeypatch.setattr(bench_cmd, "run_bench", lambda plan, rows=rows: {"header": {}, "rows": rows})
        assert bench_cmd.bench_main(backend="cpu", world_size=2, sizes="8B", dtypes=None, ops=None, iters=1, warmup=0, as_json=False) == status
    assert "1 of 2 results have wrong elements" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--sizes", "8X..1M"], "'8X' is not a size"),
        (["--sizes", "100000000000000000000B"], "is above 16 GiB, the largest buffer"),  # not an overflow in torch.empty
        (["--sizes", "8B..1000TiB"], "'1000TiB' is above 16 GiB"),
        (["--iters", "1000000000000"], "give 1 to 1,000,000 timed iterations"),
        (["--world-size", "0"], "--world-size 0"),
        (["--dtype", "float32,float8"], "float8 is not allowed"),
        (["--dtype", "float32,,"], "--dtype: 'float32,,' has an empty name"),
        (["--ops", ","], "--ops: ',' has an empty name"),
        (["--sizes", ""], "--sizes: '' is not a size"),  # not the default range
        (["--sizes", "3B"], "--sizes: 3 B is not a whole number of float32 elements (4 B each)"),  # not run as 4 B
        (["--sizes", "6B..1K", "--dtype", "bfloat16,float64"], "6 B is not a whole number of float64 elements"),
        (["--ops", "all_reduce,allreduce"], "allreduce is not allowed"),
        (["--backend", "nope"], "'nope' is not allowed"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], words: str) -> None:
    result = run_hal("bench", "collectives", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("hal: error:") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.skipif(has_cuda(), reason="this machine has a GPU")
def test_unavailable_backend_is_refused() -> None:
    result = run_hal("bench", "collectives", "--backend", "cuda")
    assert result.returncode == 2 and "backend 'cuda' is not available" in result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU")
def test_cuda_bench_one_rank_per_gpu() -> None:
    from hal import get_backend

    count = get_backend("cuda").device_count()
    too_many = run_hal("bench", "collectives", "--backend", "cuda", "--world-size", str(count + 1))
    assert too_many.returncode == 2 and f"has {count} device(s)" in too_many.stderr
    n = min(2, count)
    result = run_hal(
        "bench", "collectives", "--backend", "cuda", "--world-size", str(n), "--sizes", "8B..1M",
        "--dtype", "float32,bfloat16", "--iters", "3", "--warmup", "1", "--json", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["correct"] and report["header"]["process_group_backend"] == "cpu:gloo,cuda:nccl"
    assert [d.split(": ")[1].split()[0] for d in report["header"]["devices"]] == [f"cuda:{i}" for i in range(n)]
