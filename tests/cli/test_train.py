"""``hal train`` end to end: real rank processes started through the CLI, as a user runs it.

Each run starts one Python process per rank (~2 s each here), so the runs are few and short: the
main job for 2 steps, and one 3-step run whose checkpoint several tests resume.
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import REPO, run_hal

MAIN_JOB = "examples/hetero_cpu.yaml"
PLAN_D = {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 4,  # same 8 rows per step as plan (a)
          "stages": [{"backend": "cpu", "devices": 4, "layers": 4, "tp": 2, "dp": 2}]}
ONE_DEVICE = {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,  # the same 8 rows a step on one rank
              "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}
TIMEOUT = 240


def _config(directory: Path, name: str, *, parallel: dict[str, Any] | None = None, **train: Any) -> Path:
    """The main job's config with some train keys (or the whole parallel section) replaced."""
    raw = yaml.safe_load((REPO / MAIN_JOB).read_text(encoding="utf-8"))
    raw["train"].pop("checkpoint_every", None)
    raw["train"].update(train)
    if parallel is not None:
        raw["parallel"] = parallel
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _train(*args: str) -> dict[str, Any]:
    result = run_hal("train", *args, "--json", timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _log(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def _on_a_terminal(*args: str, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    """``hal ARGS`` as a person at a terminal runs it: stderr on a pseudo-terminal (output processing off, so the
    bytes read are the bytes written), stdout a pipe. The exit status, what the terminal got, and stdout."""
    import pty
    import select
    import subprocess
    import sys
    import termios
    import time

    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # no "\n" -> "\r\n": every "\r" read is one hal wrote
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("HAL_BACKEND", "HAL_PRECISION", "HAL_FALLBACK"):
        env.pop(key, None)
    with open(os.devnull, "rb") as nothing:
        proc = subprocess.Popen([sys.executable, "-m", "hal", *args], stdin=nothing, stdout=subprocess.PIPE, stderr=slave,
                                env=env, cwd=REPO)
    os.close(slave)
    terminal, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every process holding the terminal has gone
                break
            if not chunk:
                break
            terminal += chunk
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, terminal.decode("utf-8", errors="replace"), out.decode("utf-8")


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (every rank's names its run directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and "pytest" not in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _assert_close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rel * abs(w), (got, want)


# --- the main job --------------------------------------------------------------------------------------


def test_main_job_trains_logs_breakdown_and_shows_progress(tmp_path: Path) -> None:
    """The README's command at a terminal (stderr on a pseudo-terminal): progress redrawn in place by hal train,
    stdout still nothing but --json's document."""
    run_dir = tmp_path / "run"
    status, terminal, stdout = _on_a_terminal("train", MAIN_JOB, "--steps", "2", "--run-dir", str(run_dir), "--json")
    assert status == 0, terminal
    summary = json.loads(stdout)
    # progress: each step's line drawn after a carriage return and cleared to the end, no newline between the
    # steps, and one newline after the last (so what comes next starts on a line of its own)
    first, second = terminal.index("\rstep 1/2 loss "), terminal.index("\rstep 2/2 loss ")
    assert first < second and "\n" not in terminal[first:second] and terminal[first:second].endswith("\x1b[K"), terminal
    assert terminal[second:].count("\n") >= 1 and terminal[second:].index("\x1b[K\n") > 0, terminal
    assert summary["world_size"] == 4 and [s["tp"] for s in summary["stages"]] == [2, 1]
    assert [s["dp"] for s in summary["stages"]] == [1, 2] and [s["layers"] for s in summary["stages"]] == [[0], [1, 2, 3]]
    # every stage reports its peak memory (cpu ranks: their peak RSS), at least the weights it holds, and its share
    # of the step spent computing; MFU is null on the cpu, and the summary says why
    assert all(s["peak_memory_bytes"] > 1 << 20 and 0 < s["compute_share"] <= 1 for s in summary["stages"])
    assert summary["mfu"] is None and summary["mfu_note"] == "no fp32 peak FLOP/s known for cpu"
    records = _log(run_dir / "train.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(math.log(256), rel=0.05)  # byte-level tokens, untrained model
    assert [r["loss"] for r in records] == summary["losses"]
    for record in records:
        assert record["tokens"] == 8 * 64 and record["tokens_per_s"] > 0 and record["step_s"] > 0
        assert [s["stage"] for s in record["stages"]] == [0, 1]
        assert [s["ranks"] for s in record["stages"]] == [[0, 1], [2, 3]]
        for stage in record["stages"]:
            for key in ("compute_s", "p2p_s", "bubble_s", "grad_sync_s", "optimizer_s"):
                assert stage[key] >= 0, (key, stage)
            assert stage["compute_s"] > 0 and stage["p2p_s"] > 0  # every stage computes and crosses the boundary
            assert stage["bubble_s"] <= record["schedule_s"]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-000002" and summary["checkpoint"].endswith(latest)
    meta = json.loads((run_dir / "checkpoints" / latest / "meta.json").read_text())
    assert meta["step"] == 2 and meta["plan"]["stages"][0]["tp"] == 2 and meta["model"]["vocab_size"] == 256
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


# --- checkpoints and resume ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def half_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plan (a) for 3 of 6 steps (checkpoint at the end), and the same 6 steps uninterrupted."""
    root = tmp_path_factory.mktemp("resume")
    config = _config(root, "plan_a", steps=6)
    full = _train(str(config), "--run-dir", str(root / "full"))
    half = _train(str(config), "--steps", "3", "--run-dir", str(root / "half"))
    return {"root": root, "config": config, "full": full, "half": half, "checkpoints": root / "half" / "checkpoints"}


def test_resume_same_plan_equals_uninterrupted(half_run: dict[str, Any]) -> None:
    full, half = half_run["full"]["losses"], half_run["half"]["losses"]
    assert half == full[:3]
    run_dir = half_run["root"] / "resumed_a"
    resumed = _train(str(half_run["config"]), "--resume", str(half_run["checkpoints"]), "--run-dir", str(run_dir))
    assert resumed["resumed_from_step"] == 3 and resumed["first_step"] == 4 and resumed["last_step"] == 6
    _assert_close(resumed["losses"], full[3:], 1e-6)
    assert [r["step"] for r in _log(run_dir / "train.jsonl")] == [4, 5, 6]


def test_resume_into_another_plan_equals_uninterrupted(half_run: dict[str, Any]) -> None:
    """Trained with plan (a): tp2 -> dp2 over 2 stages; resumed with plan (d): one stage, tp2 x dp2."""
    config_d = _config(half_run["root"], "plan_d", steps=6, parallel=PLAN_D)
    step_dir = half_run["checkpoints"] / "step-000003"
    resumed = _train(str(config_d), "--resume", str(step_dir), "--run-dir", str(half_run["root"] / "resumed_d"))
    _assert_close(resumed["losses"], half_run["full"]["losses"][3:], 1e-5)


PLAN_IL = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
           "stages": [{"backend": "cpu", "devices": 2, "layers": [1, 1], "tp": 2},
                      {"backend": "cpu", "devices": 2, "layers": [1, 1], "dp": 2}]}


def test_resume_into_an_interleaved_plan_equals_uninterrupted(half_run: dict[str, Any]) -> None:
    """Trained with the main job's plan (1F1B, layers 0 | 1-3); resumed with two chunks per stage (layers 0 | 1 and 2 | 3)."""
    config = _config(half_run["root"], "plan_il", steps=6, parallel=PLAN_IL)
    resumed = _train(str(config), "--resume", str(half_run["checkpoints"]), "--run-dir", str(half_run["root"] / "resumed_il"))
    _assert_close(resumed["losses"], half_run["full"]["losses"][3:], 1e-5)
    assert [s["layers"] for s in resumed["stages"]] == [[0, 2], [1, 3]]


def test_resume_into_a_zbv_plan_equals_uninterrupted(half_run: dict[str, Any]) -> None:
    """Resumed with zbv: the V puts layers 0 | 3 on stage 0 (with the head: the loss is logged from there)."""
    config = _config(half_run["root"], "plan_zbv", steps=6, parallel={**PLAN_IL, "schedule": "zbv"})
    resumed = _train(str(config), "--resume", str(half_run["checkpoints"]), "--run-dir", str(half_run["root"] / "resumed_zbv"))
    _assert_close(resumed["losses"], half_run["full"]["losses"][3:], 1e-5)
    assert [s["layers"] for s in resumed["stages"]] == [[0, 3], [1, 2]]


def test_resume_into_dualpipev_says_how_each_stage_runs_its_pairs(half_run: dict[str, Any]) -> None:
    """Resumed with dualpipev (the V as zbv's): its pairs at once on the dp2 stage, in turn on the tp2 one (collectives
    inside the compute), said at the start and in the summary; the losses are the uninterrupted run's."""
    config = _config(half_run["root"], "plan_dpv", steps=6, parallel={**PLAN_IL, "schedule": "dualpipev"})
    result = run_hal("train", str(config), "--resume", str(half_run["checkpoints"]), "--run-dir",
                     str(half_run["root"] / "resumed_dpv"), "--json", timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    resumed = json.loads(result.stdout)
    _assert_close(resumed["losses"], half_run["full"]["losses"][3:], 1e-5)
    assert [s["pairs"].split(":")[0] for s in resumed["stages"]] == ["in turn", "at once"]
    assert "tensor parallelism" in resumed["stages"][0]["pairs"]
    said = result.stderr.splitlines()[0]
    assert "layers 0+3 pairs in turn (tensor parallelism)" in said and "layers 1+2 pairs at once" in said, said


@pytest.mark.parametrize("islands, says", [("0,x", "use comma-separated island numbers"),
                                            ("0,1", "names 2 ranks but the world has 4")])
def test_a_bad_hal_islands_is_one_line_before_any_rank_starts(islands: str, says: str, tmp_path: Path) -> None:
    """Issue 56, 7: every rank failed on it after the start (no ``hal: error:`` line, a run directory left)."""
    run_dir = tmp_path / "run"
    result = run_hal("train", str(MAIN_JOB), "--steps", "1", "--run-dir", str(run_dir), env={"HAL_ISLANDS": islands})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hal: error: HAL_ISLANDS={islands!r}") and says in lines[0], lines
    assert not run_dir.exists()


def test_a_failing_rank_stops_every_rank(half_run: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A checkpoint file damaged after the launcher's checks: the ranks that read it fail, the rest are stopped."""
    from hal.cli.train import spawn_ranks
    from hal.parallel.loop.job_runner import prepare, run_local, write_job

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for item in (half_run["checkpoints"] / "step-000003").iterdir():
        (damaged / item.name).write_bytes(item.read_bytes())
    run_dir = tmp_path / "run"
    job = prepare(str(half_run["config"]), resume=str(damaged), run_dir=str(run_dir))  # passes: the files are intact
    write_job(job)
    (damaged / "stage-1.pt").write_bytes(b"not a checkpoint")
    assert run_local(job, spawn_ranks) == 2
    err = capfd.readouterr().err
    assert "stage-1.pt is unreadable" in err and "the checkpoint is damaged" in err
    assert "hal train: rank" in err
    assert not _processes_mentioning(str(run_dir))


# --- refused before anything starts ----------------------------------------------------------------------------

BAD = {
    "corpus-needs-vocab-256": ({"model": {"vocab_size": 64}}, [], "train.data 'corpus' is byte-level text"),
    "layers-do-not-add-up": ({"model": {"num_layers": 5}}, [], "layers add up to 4"),
    "precision-fp8": ({"precision": "fp8-mixed"}, [], "needs native fp8"),
    "resume-missing": ({}, ["--resume", "no/such/checkpoint"], "no such directory"),
    "steps-zero": ({}, ["--steps", "0"], "--steps 0 is not a step count"),
    "backend-not-used": ({"backend": "cuda"}, [], "backend 'cuda' is not used by hal train"),
    "log-file-a-directory": ({"train": {"log_file": "examples"}}, [], "train.log_file examples: is a directory"),
    "checkpoint-dir-under-a-file": ({"train": {"checkpoint_dir": "README.md/ckpt"}}, [], "README.md is a file"),
    "run-dir-a-file": ({}, ["--run-dir", "README.md"], "--run-dir README.md: exists and is not a directory"),
}


def _bad_config(case: str, tmp_path: Path) -> Path:
    """The main job with ``BAD[case]``'s changes, as a file."""
    raw = yaml.safe_load((REPO / MAIN_JOB).read_text(encoding="utf-8"))
    for key, value in BAD[case][0].items():
        if isinstance(value, dict):
            raw[key].update(value)
        else:
            raw[key] = value
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return config


@pytest.mark.parametrize("case", list(BAD))
def test_bad_run_is_one_line_and_exit_2_with_nothing_started(case: str, tmp_path: Path) -> None:
    _, extra, message = BAD[case]
    config = _bad_config(case, tmp_path)
    run_dir = tmp_path / "run"
    result = run_hal("train", str(config), "--run-dir", str(run_dir), *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error: "), result.stderr
    assert message in lines[0]
    assert not run_dir.exists() and not _processes_mentioning(str(run_dir))


@pytest.mark.parametrize("case", [name for name, (_, extra, _) in BAD.items() if not extra])
def test_hal_plan_refuses_what_hal_train_refuses(case: str, tmp_path: Path) -> None:
    """One preflight: every config-only refusal of hal train is hal plan's too, in the same words."""
    result = run_hal("plan", "--config", str(_bad_config(case, tmp_path)))
    message = BAD[case][2]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error: ") and message in lines[0], result.stderr


def test_bf16_mixed_follows_the_fp32_curve(half_run: dict[str, Any]) -> None:
    """Plan (a) under bf16 autocast on every stage: the same 3 steps, loss within bf16's reach of fp32's."""
    raw = yaml.safe_load(half_run["config"].read_text(encoding="utf-8"))
    raw["precision"] = "bf16-mixed"
    config = half_run["root"] / "plan_a_bf16.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    bf16 = _train(str(config), "--steps", "3", "--run-dir", str(half_run["root"] / "bf16"))
    fp32 = half_run["half"]["losses"]
    assert bf16["precision"] == "bf16-mixed"
    assert bf16["losses"] != fp32  # autocast really ran: bf16 rounding moves the loss
    _assert_close(bf16["losses"], fp32, 2e-2)


def test_zero1_reduce_scatter_follows_the_plain_run(half_run: dict[str, Any]) -> None:
    """Plan (a) with zero1 through hal train equals the plain run (the reduce-scatter step itself is
    checked against plain AdamW in tests/ranks/test_zero.py)."""
    raw = yaml.safe_load(half_run["config"].read_text(encoding="utf-8"))
    raw["parallel"]["zero1"] = True
    config = half_run["root"] / "plan_a_zero1.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    zero1 = _train(str(config), "--steps", "3", "--run-dir", str(half_run["root"] / "zero1"))
    _assert_close(zero1["losses"], half_run["half"]["losses"], 1e-5)


def test_resume_with_another_model_is_refused(half_run: dict[str, Any]) -> None:
    raw = yaml.safe_load(half_run["config"].read_text(encoding="utf-8"))
    raw["model"]["hidden_size"] = 128
    config = half_run["root"] / "wider.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = run_hal("train", str(config), "--resume", str(half_run["checkpoints"]))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "model.hidden_size is 64 but this config's is 128" in result.stderr


# --- several nodes, and the progress line on a terminal ----------------------------------------------------------


def test_a_diverged_run_still_logs_json(tmp_path: Path) -> None:
    """An lr that blows the weights up gives a NaN loss: the log and the summary (what --json prints) say null, not NaN,
    the summary line says the run diverged, and so do a warning line, summary.json and the exit status: 3, not 0 (it
    once ended 0 with a normal-looking summary, whatever drove the loss off)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")
    config = _config(tmp_path, "diverge", steps=3, lr=1e30, warmup_steps=0)
    result = run_hal("train", str(config), "--run-dir", str(tmp_path / "run"), timeout=TIMEOUT)
    assert result.returncode == 3, result.stderr
    said = [line for line in result.stderr.splitlines() if "the run diverged" in line]
    assert len(said) == 1 and said[0].startswith("hal train: warning: the run diverged: the loss at step ") \
        and said[0].endswith("exit status 3"), result.stderr
    diverged = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))["diverged"]
    assert 1 <= diverged["step"] <= 3 and diverged["reason"] in said[0]
    assert "loss nan" in result.stderr  # the progress line says it, and so does the summary line
    assert "-> not finite (diverged)," in result.stdout, result.stdout
    # not a terminal: one plain line per step, nothing redrawn
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/3", "2/3", "3/3"], result.stderr
    # the summary says why there is no MFU, and shows each stage's share of the step computing and its peak memory
    assert "MFU n/a (no fp32 peak FLOP/s known for cpu)" in result.stdout, result.stdout
    stages = [line for line in result.stdout.splitlines() if line.startswith("hal train: stage ")]
    assert len(stages) == 2, result.stdout
    for line in stages:
        assert "% of the step, peak memory " in line and line.endswith(" MiB (peak RSS)"), line
    records = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] is None
    assert json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=refuse)["final_loss"] is None


def test_print_multinode_gives_one_torchrun_line_per_node_and_starts_nothing(tmp_path: Path) -> None:
    result = run_hal("train", MAIN_JOB, "--print-multinode", "2", "--run-dir", str(tmp_path / "shared"))
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if "torchrun" in line]
    assert len(commands) == 2
    for node, line in enumerate(commands):
        assert line.startswith("HAL_BACKEND=cpu torchrun ") and f"--node-rank={node}" in line
        assert "--nproc-per-node=2" in line and "--nnodes=2" in line
        assert line.endswith(f"-m hal.parallel.loop.trainer {tmp_path / 'shared' / 'job.json'}")  # the job file, no YAML
    assert f"cat > {tmp_path / 'shared' / 'job.json'} <<" in result.stdout  # how the job file reaches every node
    assert not (tmp_path / "shared").exists()


def test_print_multinode_of_replicas_puts_a_replica_a_node_and_its_lines_train(tmp_path: Path) -> None:
    """A replicated run on two nodes: a replica a node (its ranks stay together), and the printed lines, run here as
    the two nodes (node 0's address this host, a free port), train the replicas over torchrun's static rendezvous as
    hal train does on one node: the same losses."""
    import subprocess

    from hal.parallel.loop.job_runner import free_port

    # a rank a replica: each torchrun agent and rank is a fresh interpreter, the test's cost
    one_each = {**REPLICAS, "replicas": [{**r, "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}
                                         for r in REPLICAS["replicas"]]}
    config = _config(tmp_path, "replicas", parallel=one_each, steps=2)
    shared = tmp_path / "shared"
    result = run_hal("train", str(config), "--print-multinode", "2", "--run-dir", str(shared))
    assert result.returncode == 0, result.stderr
    assert "# node 0: rank 0 (cpu; replica 0)" in result.stdout and "# node 1: rank 1 (cpu; replica 1)" in result.stdout
    nodes = [line for line in result.stdout.splitlines() if "torchrun" in line]
    assert len(nodes) == 2 and all("--nproc-per-node=1" in line for line in nodes)
    script = result.stdout.replace("NODE0_HOST", "127.0.0.1").replace("--master-port=29500", f"--master-port={free_port()}")
    # each node in the background; then each one's own status (``wait -n`` answered 127 when both had already ended)
    script = "\n".join(line + ' &\npids="$pids $!"' if "torchrun" in line else line for line in script.splitlines())
    script += "\nfor pid in $pids; do wait $pid; done\n"
    islands = {"HAL_ISLANDS": "0,1"}  # each replica its own island
    env = {**os.environ, **islands, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO)}
    ran = subprocess.run(["bash", "-c", "set -e\n" + script],
                         capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    losses = [record["loss"] for record in _log(shared / "train.jsonl")]
    one_node = run_hal("train", str(config), "--run-dir", str(tmp_path / "one_node"), "--json", env=islands, timeout=TIMEOUT)
    assert one_node.returncode == 0, one_node.stderr
    assert losses == json.loads(one_node.stdout)["losses"]


def test_split_nodes_keeps_stages_then_tp_groups_whole() -> None:
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.loop.job_runner import split_nodes

    topology = Topology.from_plan(parse_plan({"stages": [
        {"backend": "cpu", "devices": 2, "layers": 3, "tp": 2}, {"backend": "cpu", "devices": 2, "layers": 1, "dp": 2}]}))
    assert split_nodes(topology, 1) == [range(0, 4)]
    assert split_nodes(topology, 2) == [range(0, 2), range(2, 4)]
    assert split_nodes(topology, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    # replicas: whole replicas first (a replica of 2 stages on 4 ranks beside a 1-stage replica of 2), then stages
    big = Topology.from_plan(parse_plan({"stages": [{"backend": "cpu", "devices": 2, "layers": 2, "dp": 2},
                                                    {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2}]}))
    small = Topology.from_plan(parse_plan({"stages": [{"backend": "cpu", "devices": 2, "layers": 4, "tp": 2}]}), 4)
    assert split_nodes([big, small], 2) == [range(0, 4), range(4, 6)]  # not 3 + 3 across the replicas
    assert split_nodes([big, small], 3) == [range(0, 2), range(2, 4), range(4, 6)]


def test_a_slow_step_says_so_and_a_quick_one_says_nothing() -> None:
    """The first step of a compiled run may take minutes: past ``first_after`` a line says the step still runs and
    why, again every ``every`` seconds, redrawn in place like a progress line; a step that ends in time prints nothing."""
    import time

    from hal.parallel.observe.progress import PROGRESS, Progress, SlowStepNotice

    stream = io.StringIO()
    with SlowStepNotice(Progress(5, stream), 1, "compiling", first_after=0.05, every=0.05) as notice:
        time.sleep(0.4)
    lines = stream.getvalue().splitlines()
    assert notice.said == len(lines) >= 2 and all(PROGRESS.match(line) for line in lines)
    assert lines[0].startswith("step 1/5 still running after 0 s: compiling")
    stream = io.StringIO()
    with SlowStepNotice(Progress(5, stream), 1, "compiling", first_after=5.0) as notice:
        pass
    assert stream.getvalue() == "" and notice.said == 0


def test_progress_updates_in_place_on_a_terminal() -> None:
    from hal.parallel.observe.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(20, stream)
    for step in (1, 2):
        progress.update({"step": step, "loss": 4.0, "tokens_per_s": 1234.0, "step_s": 0.1})
    progress.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and "step 2/20 loss 4.0000 1234 tok/s" in text
    # an evaluation's line stays: it ends the progress line shown, and the next step's line starts a new one
    stream = Terminal()
    progress = Progress(20, stream)
    progress.update({"step": 10, "loss": 4.0, "tokens_per_s": 1234.0, "step_s": 0.1})
    progress.evaluated(10, 3.5)
    progress.update({"step": 11, "loss": 3.9, "tokens_per_s": 1234.0, "step_s": 0.1})
    progress.close()
    assert stream.getvalue() == ("\rstep 10/20 loss 4.0000 1234 tok/s 100 ms/step\x1b[K\n"
                                 f"eval step 10/20 loss 3.5000 ppl {math.exp(3.5):.2f}\n"
                                 "\rstep 11/20 loss 3.9000 1234 tok/s 100 ms/step\x1b[K\n")
    # off a terminal: the same lines, one each, nothing redrawn
    plain = io.StringIO()
    progress = Progress(20, plain)
    progress.update({"step": 10, "loss": 4.0, "tokens_per_s": 1234.0, "step_s": 0.1})
    progress.evaluated(10, 3.5)
    progress.close()
    assert plain.getvalue() == f"step 10/20 loss 4.0000 1234 tok/s 100 ms/step\neval step 10/20 loss 3.5000 ppl {math.exp(3.5):.2f}\n"


def test_the_summary_shows_mfu_where_a_peak_is_known_and_why_not_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    from hal.cli.train import _print_summary
    from hal.parallel.observe.records import compute_share, mfu_note

    stage = {"stage": 0, "backend": "cuda", "ranks": [0, 1], "tp": 2, "dp": 1, "sp": False, "layers": [0, 1, 2],
             "peak_memory_bytes": 3 << 30, "peak_tflops": 1978.0, "compute_share": 0.8}
    summary = {"first_step": 1, "last_step": 20, "steps": 20, "first_loss": 5.5, "final_loss": 2.0, "tokens_per_s": 1e6,
               "mfu": 0.1234, "mfu_note": None, "wall_s": 3.0, "log_file": "t.jsonl", "checkpoint": "c", "stages": [stage]}
    _print_summary(summary, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert ", MFU 12.3%, " in lines[0]
    assert lines[1] == "hal train: stage 0 cuda tp2, layers 0-2: computing 80% of the step, peak memory 3.00 GiB (allocator peak)"
    # the evaluations, where the run had some: first, last and best (they were in the log only)
    _print_summary({**summary, "evals": [{"step": 10, "loss": 3.5}, {"step": 20, "loss": 3.25}, {"step": 30, "loss": 3.3}]},
                   as_json=False)
    evals = [line for line in capsys.readouterr().out.splitlines() if "eval loss" in line]
    assert evals == ["hal train: eval loss 3.5000 (step 10) -> 3.3000 (step 30), best 3.2500 at step 20, 3 evaluation(s)"]
    # the reasons: a device without a catalog peak (named), no step; a stage whose phases were not measured
    cpu = {"compute_s": 0.1, "peak_tflops": None, "backend": "cpu"}
    records = [{"step_s": 1.0, "tokens": 10, "stages": [cpu]}, {"step_s": 0.5, "tokens": 10, "stages": [cpu]}]
    assert mfu_note(records, [{"backend": "cpu", "peak_tflops": None}, {"backend": "cuda", "peak_tflops": 989.0}],
                    "bf16-mixed") == "no bf16 peak FLOP/s known for cpu"
    assert mfu_note([], [], "fp32") == "no step ran"
    assert compute_share(records, 0) == pytest.approx(0.2)  # the steady steps only: 0.1 of 0.5 s
    records[1]["stages"][0] = {**cpu, "compute_s": None}
    assert compute_share(records, 0) is None
    _print_summary({**summary, "mfu": None, "mfu_note": "no bf16 peak FLOP/s known for cpu",
                    "stages": [{**stage, "compute_share": None, "peak_memory_bytes": None}]}, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert ", MFU n/a (no bf16 peak FLOP/s known for cpu), " in lines[0]
    assert lines[1].endswith("computing: not measured (--profile measures it), peak memory unknown")


def test_the_summary_rate_leaves_out_the_first_step_and_checkpoint_writes() -> None:
    from hal.parallel.observe.records import steady_rate

    records = [{"tokens": 100, "step_s": 10.0}, {"tokens": 100, "step_s": 1.0}, {"tokens": 100, "step_s": 1.0}]
    assert steady_rate(records) == 100.0  # not 300 / 12 (warm-up included) nor less (wall time with a checkpoint)
    assert steady_rate(records[:1]) == 10.0 and steady_rate([]) is None


# --- replicas ---------------------------------------------------------------------------------------------------

REPLICAS = yaml.safe_load((REPO / "examples" / "replicas_cpu.yaml").read_text(encoding="utf-8"))["parallel"]
ISLANDS = {"HAL_ISLANDS": "0,0,1,1"}  # each replica its own island: every cross-replica byte through the bridge


def _train_islands(*args: str) -> dict[str, Any]:
    result = run_hal("train", *args, "--json", env=ISLANDS, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_replicas_train_as_the_plan_of_all_rows_and_checkpoints_go_both_ways(half_run: dict[str, Any]) -> None:
    """examples/replicas_cpu.yaml (tp2 on 2 rows beside dp2 on 6, two islands) trains the main job's 8 rows a step as
    its one plan does; its checkpoint resumes into that plan, and that plan's checkpoint into the replicas."""
    root, full = half_run["root"], half_run["full"]["losses"]
    config = _config(root, "replicas", steps=6, parallel={**REPLICAS, "replica_sync": {"overlap": "on"}})
    first = _train_islands(str(config), "--steps", "3", "--run-dir", str(root / "replicas_half"))
    _assert_close(first["losses"], full[:3], 1e-5)
    assert first["world_size"] == 4  # every replica's ranks, not replica 0's
    log = _log(root / "replicas_half" / "train.jsonl")
    assert [r["rows"] for r in log[0]["replicas"]] == [2, 6] and [s["replica"] for s in log[0]["stages"]] == [0, 1]
    # overlap: on — the dp2 replica's exchange begins during its backward; the tp2 replica's waits for it (tp > 1)
    assert [r["buckets_during_backward"] for r in log[-1]["replicas"]] == [None, 1]
    assert all(r["cross_replica_bytes"] > 0 and r["tokens_per_s"] > 0 for r in log[-1]["replicas"])
    into_plan = _train(str(half_run["config"]), "--resume", str(root / "replicas_half" / "checkpoints"),
                       "--run-dir", str(root / "plan_from_replicas"))
    _assert_close(into_plan["losses"], full[3:], 1e-5)
    into_replicas = _train_islands(str(config), "--resume", str(half_run["checkpoints"]),
                                   "--run-dir", str(root / "replicas_from_plan"))
    _assert_close(into_replicas["losses"], full[3:], 1e-5)
    # Into local SGD from either (no replica kept its own inner state, no outer momentum was kept): every replica
    # starts from the one optimizer state, each gap said, and the two sources — the same training — stay the same.
    local = _config(root, "local_from", steps=6, parallel={**REPLICAS, "replica_sync": {"every": 3, "outer_momentum": 0.5}})
    runs = [run_hal("train", str(local), "--resume", str(source), "--json", "--run-dir", str(root / f"local_from_{name}"),
                    env=ISLANDS, timeout=TIMEOUT)
            for name, source in (("replicas", root / "replicas_half" / "checkpoints"), ("plan", half_run["checkpoints"]))]
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert sum("replica(s) [1] resume from replica 0's inner optimizer state" in line
                   and "(it was not a local SGD run)" in line for line in run.stderr.splitlines()) == 1, run.stderr
        assert sum("momentum starts at zero" in line for line in run.stderr.splitlines()) == 1, run.stderr
    _assert_close(json.loads(runs[0].stdout)["losses"], json.loads(runs[1].stdout)["losses"], 1e-5)


REPLICA_BAD = {
    "shares that do not add up": ({**REPLICAS, "global_batch": 9}, [], "add up to 8 (2 + 6)"),
    "an H of 0": ({**REPLICAS, "replica_sync": {"every": 0}}, [], "replica_sync.every' must be a positive integer"),
    "rows auto leaving too few rows": ({**REPLICAS, "global_batch": 7, "replicas": [
        {**REPLICAS["replicas"][0], "rows": "auto"}, {**REPLICAS["replicas"][1], "rows": 6}]}, [],
        "leaves 1 rows for the auto replicas [0]"),
    "auto shares no split of whole micro-batches meets": ({**REPLICAS, "global_batch": 5, "replicas": [
        {**r, "rows": "auto"} for r in REPLICAS["replicas"]]}, [], "use global_batch 4 or 6"),
    "steps off the local SGD meetings": ({**REPLICAS, "replica_sync": {"every": 4}}, ["--steps", "6"],
                                         "--steps 6 is not a multiple of parallel.replica_sync.every 4"),
    "a replica's own model": ({**REPLICAS, "replicas": [{**REPLICAS["replicas"][0], "model": {}}, REPLICAS["replicas"][1]]},
                              [], "replicas train one model"),
}


@pytest.mark.parametrize("case", list(REPLICA_BAD))
def test_bad_replicas_are_one_line_and_exit_2_with_nothing_started(case: str, tmp_path: Path) -> None:
    parallel, extra, message = REPLICA_BAD[case]
    config = _config(tmp_path, "bad", parallel=parallel, steps=8)
    run_dir = tmp_path / "run"
    result = run_hal("train", str(config), "--run-dir", str(run_dir), *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error: ") and message in lines[0], result.stderr
    assert not run_dir.exists()


def test_replicas_clip_the_step_gradient_as_one_plan_and_local_sgd_refuses_it(tmp_path: Path) -> None:
    """train.grad_clip with replicas meeting every step: the norm of the step's one gradient (every replica holds a
    copy after the sync), so the run clips as the one plan of all rows does; with local SGD it is one line."""
    clipped = _train_islands(str(_config(tmp_path, "replicas_clip", parallel=REPLICAS, steps=3, grad_clip=0.05)),
                             "--run-dir", str(tmp_path / "replicas_clip"))
    plan_a = _train(str(_config(tmp_path, "plan_a_clip", steps=3, grad_clip=0.05)), "--run-dir", str(tmp_path / "plan_a"))
    _assert_close(clipped["losses"], plan_a["losses"], 1e-5)
    norms = [r["grad_norm"] for r in _log(tmp_path / "replicas_clip" / "train.jsonl")]
    assert all(n > 0.05 for n in norms)  # it did clip
    _assert_close(norms, [r["grad_norm"] for r in _log(tmp_path / "plan_a" / "train.jsonl")], 1e-5)
    local = {**REPLICAS, "replica_sync": {"every": 2}}
    result = run_hal("train", str(_config(tmp_path, "local_clip", parallel=local, steps=4, grad_clip=0.05)))
    assert result.returncode == 2 and "train.grad_clip with local SGD" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_local_sgd_resumes_at_its_anchor_with_its_outer_momentum(tmp_path: Path) -> None:
    """Local SGD every 2 steps with DiLoCo's outer step: stopped at step 2 and resumed, the run equals the one
    straight through (the anchor is the loaded weights; the outer momentum and each replica's own inner AdamW state
    are read from the checkpoint)."""
    local = {**REPLICAS, "replica_sync": {"every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}}
    config = _config(tmp_path, "local", parallel=local, steps=6)
    full = _train_islands(str(config), "--run-dir", str(tmp_path / "full"))
    half = _train_islands(str(config), "--steps", "2", "--run-dir", str(tmp_path / "half"))
    assert half["losses"] == full["losses"][:2]
    resumed = _train_islands(str(config), "--resume", str(tmp_path / "half" / "checkpoints"), "--run-dir",
                             str(tmp_path / "resumed"))
    _assert_close(resumed["losses"], full["losses"][2:], 1e-6)
    # Resumed where replicas sync every step, the run is the one device's from the same checkpoint: one optimizer state
    # (replica 0's) for every replica, and a line says the local SGD state is not used. (Each replica once took its
    # own: the replicas drifted apart, step 4's loss 5.545201 against 5.546916, and nothing said so.)
    checkpoint = str(tmp_path / "half" / "checkpoints")
    one = _train(str(_config(tmp_path, "one", parallel=ONE_DEVICE, steps=4)), "--resume", checkpoint,
                 "--run-dir", str(tmp_path / "one"))
    every = run_hal("train", str(_config(tmp_path, "every", parallel=REPLICAS, steps=4)), "--resume", checkpoint, "--json",
                    "--run-dir", str(tmp_path / "every"), env=ISLANDS, timeout=TIMEOUT)
    assert every.returncode == 0, every.stderr
    _assert_close(json.loads(every.stdout)["losses"], one["losses"], 1e-6)
    said = [line for line in every.stderr.splitlines() if "local SGD state" in line]
    assert len(said) == 1 and "not used: this run syncs every step" in said[0], every.stderr


def test_profile_draws_each_replicas_timeline(tmp_path: Path) -> None:
    """--profile on a replicated run: each replica's last step as its own document (its ranks only, its plan's stages)
    and picture, and each replica's per-rank shares said, marked with the replica."""
    config = _config(tmp_path, "profiled", parallel=REPLICAS, steps=2)
    result = run_hal("train", str(config), "--profile", "--run-dir", str(tmp_path / "run"), env=ISLANDS, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run" / "timeline.json").exists()
    for index, ranks in enumerate(([0, 1], [2, 3])):
        doc = json.loads((tmp_path / "run" / f"timeline-replica-{index}.json").read_text(encoding="utf-8"))
        assert doc["step"] == 2 and [r["rank"] for r in doc["ranks"]] == ranks
        assert [s["ranks"] for s in doc["stages"]] == [ranks]  # each replica one stage of two ranks (tp2, dp2)
        assert all(r["compute"] > 0 for r in doc["ranks"])
        said = [line for line in result.stderr.splitlines() if line.startswith(f"hal train: replica {index}: ")]
        assert any("per rank: computing / in P2P calls / idle" in line for line in said), result.stderr
        assert (tmp_path / "run" / f"timeline-replica-{index}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_fp8_wire_resumes_with_what_it_rounded_away(tmp_path: Path) -> None:
    """compress: fp8 keeps, on each speaker, what its sends rounded away and adds it to the next: the checkpoint keeps
    those residuals by parameter name, so a run stopped at step 2 and resumed equals the one straight through (without
    them its first resumed sends would carry no feedback and the losses part)."""
    fp8 = {**REPLICAS, "replica_sync": {"compress": "fp8"}}
    config = _config(tmp_path, "fp8", parallel=fp8, steps=5)
    full = _train_islands(str(config), "--run-dir", str(tmp_path / "full"))
    half = _train_islands(str(config), "--steps", "2", "--run-dir", str(tmp_path / "half"))
    assert half["losses"] == full["losses"][:2]
    step_dir = tmp_path / "half" / "checkpoints" / "step-000002"
    meta = json.loads((step_dir / "meta.json").read_text(encoding="utf-8"))
    kept = [f for f in meta["files"] if f.startswith("fp8-residuals-")]
    assert kept and all((step_dir / f).is_file() for f in kept)
    resumed = _train_islands(str(config), "--resume", str(tmp_path / "half" / "checkpoints"), "--run-dir",
                             str(tmp_path / "resumed"))
    assert resumed["losses"] == full["losses"][2:]
    into_plain = run_hal("train", str(_config(tmp_path, "plain", parallel=REPLICAS, steps=3)), "--resume",
                         str(tmp_path / "half" / "checkpoints"), "--run-dir", str(tmp_path / "plain"), env=ISLANDS,
                         timeout=TIMEOUT)
    assert into_plain.returncode == 0, into_plain.stderr
    said = [line for line in into_plain.stderr.splitlines() if "fp8 wire" in line]
    assert len(said) == 1 and "not used" in said[0], into_plain.stderr


def test_auto_rows_are_set_by_a_calibration_said_and_rebalanced_without_changing_the_training(tmp_path: Path) -> None:
    """rows: auto on both replicas: a short calibration at start sets whole micro-batches adding up to the global
    batch, said on stderr and kept in the log; a look at the measured step times after every step may move rows
    (each move said on stderr and marked in the log); the losses are the one plan's whatever the shares."""
    auto = {**REPLICAS, "global_batch": 8, "replica_sync": {"rebalance_every": 1},
            "replicas": [{**r, "rows": "auto"} for r in REPLICAS["replicas"]]}
    config = _config(tmp_path, "auto", parallel=auto, steps=3)
    result = run_hal("train", str(config), "--run-dir", str(tmp_path / "run"), env=ISLANDS, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "replica shares by measured speed" in line]
    assert len(said) == 1 and "rows/s measured" in said[0], result.stderr
    log = _log(tmp_path / "run" / "train.jsonl")
    for record in log:
        rows = [r["rows"] for r in record["replicas"]]
        assert sum(rows) == 8 and all(n >= 2 and n % 2 == 0 for n in rows), rows
        if "rebalanced" in record:
            assert record["rebalanced"] == rows
    moves = [line for line in result.stderr.splitlines() if "replica shares re-balanced from measured step times" in line]
    assert len(moves) == sum("rebalanced" in record for record in log), result.stderr
    plan_a = _train(str(_config(tmp_path, "plan_a", steps=3)), "--run-dir", str(tmp_path / "plan_a"))
    _assert_close([record["loss"] for record in log], plan_a["losses"], 1e-5)


def test_plan_search_starts_from_one_plan_not_replicas(tmp_path: Path) -> None:
    config = _config(tmp_path, "replicas", parallel=REPLICAS, steps=8)
    result = run_hal("plan", "--search", "--config", str(config))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "starts from one plan (parallel.stages)" in lines[0], result.stderr



def test_hal_plan_draws_each_replicas_timeline(tmp_path: Path) -> None:
    png = tmp_path / "replicas.png"
    result = run_hal("plan", "--config", str(REPO / "examples" / "replicas_cpu.yaml"), "--timeline", str(png))
    assert result.returncode == 0, result.stderr
    assert "replica 0: 2 rows, ranks 0-1" in result.stdout and "predicted timelines of the replicas" in result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    from hal.parallel.config.run import load_run_config
    from hal.parallel.observe.timeline import plan_document

    second = load_run_config(REPO / "examples" / "replicas_cpu.yaml", check_backends=False).replicas.replicas[1]
    assert plan_document(second.plan, second.first_rank)["stages"][0]["ranks"] == [2, 3]  # its own ranks, drawn so


@pytest.mark.parametrize("written", [False, True])
def test_a_dying_replica_is_named_in_one_line(written: bool, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """hal train's spawner, four real processes as two replicas of two ranks: rank 2 (replica 1) exits 3, the others
    are stopped; the report names the replica once, the checkpoint that stands (issue 56, 7: it claimed one where none
    was written), and the run's status is the rank's."""
    import sys

    from hal.cli.train import spawn_ranks
    from hal.parallel.loop.job_runner import REPLICA_ENV

    checkpoints = tmp_path / "checkpoints"
    if written:
        (checkpoints / "step-000004").mkdir(parents=True)
        (checkpoints / "step-000004" / "meta.json").write_text("{}")
        (checkpoints / "latest").write_text("step-000004\n")
    body = "import os, sys, time\nif os.environ['RANK'] == '2':\n    sys.exit(3)\ntime.sleep(60)\n"
    envs = [{"RANK": str(r), "WORLD_SIZE": "4", REPLICA_ENV: str(r // 2)} for r in range(4)]
    assert spawn_ranks([[sys.executable, "-c", body]] * 4, envs, checkpoints) == 3
    err = capfd.readouterr().err
    named = [line for line in err.splitlines() if "replica" in line]
    stands = f"the last checkpoint written stands ({checkpoints / 'step-000004'})" if written else "no checkpoint had been written"
    assert named == ["hal train: replica 1 (ranks 2-3) failed first, at its rank 2; every replica was stopped, and " + stands], err


def test_divergence_is_found_wherever_the_loss_leaves_the_finite_or_explodes() -> None:
    from hal.parallel.observe.records import divergence

    assert divergence([5.5, 5.1, 4.8], 256, 1) is None
    assert divergence([5.5, None, 4.8], 256, 11)["step"] == 12  # the log writes a non-finite loss as None
    assert divergence([5.5, float("inf")], 256, 1)["reason"] == "the loss at step 2 was not finite"
    exploded = divergence([5.5, 9.0, 20.0, 9e5], 256, 1)
    assert exploded["step"] == 3 and "exploded past 16.64" in exploded["reason"]  # 3 x max(ln 256 = 5.55, 5.5)
    assert divergence([30.0, 60.0], 256, 1) is None  # a high first loss sets the bound: 90


def test_while_the_ranks_live_the_run_directory_says_which_process_is_which_rank(tmp_path: Path) -> None:
    """RUN_DIR/ranks.json names each rank's pid (and the host) while the ranks run, each process named hal-rank-R in
    ps and top (forked ranks once all showed their zygote's command line); the record goes when they end."""
    import threading
    import time

    run_dir = tmp_path / "run"
    two = {**ONE_DEVICE, "stages": [{"backend": "cpu", "devices": 2, "layers": 4, "dp": 2}]}  # two ranks: the cheapest pair
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(run_hal(
        "train", str(_config(tmp_path, "named", parallel=two, steps=30)), "--run-dir", str(run_dir), timeout=TIMEOUT)))
    runner.start()
    seen: dict[int, str] = {}
    record = run_dir / "ranks.json"
    while runner.is_alive() and len(seen) < 2:
        try:
            doc = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            time.sleep(0.02)
            continue
        assert doc["host"] and [r["rank"] for r in doc["ranks"]] == [0, 1]
        for r in doc["ranks"]:
            try:
                seen[r["rank"]] = Path(f"/proc/{r['pid']}/comm").read_text(encoding="utf-8").strip()
            except OSError:
                pass
    runner.join()
    assert done and done[0].returncode == 0, done[0].stderr if done else "no run"
    assert seen == {r: f"hal-rank-{r}" for r in range(2)}, seen
    assert not record.exists()


def test_backend_flag_moves_every_stage_as_the_readme_says(tmp_path: Path) -> None:
    """The README: a backend in YAML or with --backend. A config written for CUDA (top-level and stages) trains here
    with --backend cpu, said in one line; asking for a backend this host lacks is one line before anything starts."""
    raw = yaml.safe_load(_config(tmp_path, "cuda", parallel={
        **ONE_DEVICE, "stages": [{"backend": "cuda", "devices": 1, "layers": 4}]}, steps=1).read_text(encoding="utf-8"))
    raw["backend"] = "cuda"
    config = tmp_path / "cuda.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    moved = run_hal("train", str(config), "--backend", "cpu", "--run-dir", str(tmp_path / "moved"), "--json", timeout=TIMEOUT)
    assert moved.returncode == 0, moved.stderr
    assert "hal train: --backend cpu: every stage runs on cpu, whatever the config names" in moved.stderr
    assert json.loads(moved.stdout)["stages"][0]["backend"] == "cpu"
    import torch

    if not torch.cuda.is_available():
        refused = run_hal("train", str(config), "--run-dir", str(tmp_path / "refused"))
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and "backend 'cuda' is not available" in lines[0], refused.stderr
        assert not (tmp_path / "refused").exists()
