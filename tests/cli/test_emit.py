"""``hal train CONFIG --emit slurm|kubernetes|torchrun|hostfile``: golden files for a 2-island plan (8 × H100 beside
8 × Ascend 910B) and a 3-island plan with Cambricon; the Kubernetes output parses as the resources it claims to be;
and the emitted torchrun lines, started as three "nodes" on this host in reverse order (the last island first), train
as the single-host run does — roles are taken by island after c10d rendezvous, not by join order."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ..conftest import run_hal

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "emit"
MODEL = ("model: {vocab_size: 32000, hidden_size: 1024, num_layers: 12, num_heads: 16, num_kv_heads: 8, "
         "ffn_hidden_size: 2816, max_seq_len: 1024}")
PLANS = {
    "two_islands": [("cuda", 8, 6), ("ascend", 8, 6)],
    "three_islands": [("cuda", 8, 4), ("ascend", 16, 4), ("cambricon", 4, 4)],
}


def _config(tmp_path: Path, name: str) -> Path:
    stages = "\n".join(f"    - {{backend: {b}, devices: {n}, tp: {min(n, 8)}, dp: {max(1, n // 8)}, layers: {layers}}}"
                       for b, n, layers in PLANS[name])
    text = (f"precision: bf16-mixed\n{MODEL}\nparallel:\n  schedule: 1f1b\n  micro_batches: 8\n  micro_batch_size: 2\n"
            f"  stages:\n{stages}\ntrain: {{steps: 100, lr: 3.0e-4, data: synthetic}}\n")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("fmt", ["slurm", "kubernetes", "torchrun", "hostfile"])
def test_the_emitted_job_matches_its_golden_file(tmp_path: Path, plan: str, fmt: str) -> None:
    config = _config(tmp_path, plan)
    extra = ["--devices-per-node", "cambricon=4"] if plan == "three_islands" else []
    done = run_hal("train", config.name, "--emit", fmt, "--run-dir", "/shared/runs/" + plan, *extra, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    golden = GOLDEN / f"{plan}.{fmt}"
    if os.environ.get("HAL_UPDATE_GOLDEN"):
        golden.write_text(done.stdout)
    assert done.stdout == golden.read_text(), f"{golden} differs; HAL_UPDATE_GOLDEN=1 rewrites it (and review the diff)"
    assert not Path("/shared/runs/" + plan).exists()  # printed, never written


def test_the_kubernetes_output_is_a_configmap_and_a_jobset(tmp_path: Path) -> None:
    config = _config(tmp_path, "three_islands")
    done = run_hal("train", config.name, "--emit", "kubernetes", "--run-dir", "/shared/runs/k", "--devices-per-node",
                   "cambricon=4", "--resource", "rocm=hygon.com/dcu", cwd=tmp_path)
    doc = yaml.safe_load(done.stdout)
    assert doc["kind"] == "List" and [i["kind"] for i in doc["items"]] == ["ConfigMap", "JobSet"]
    config_map, jobset = doc["items"]
    assert json.loads(config_map["data"]["job.json"])["config"] == "three_islands.yaml"  # the job file itself
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["metadata"]["name"]
    jobs = jobset["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["island0-cuda", "island1-ascend", "island2-cambricon"]
    wants = {"island0-cuda": ("nvidia.com/gpu", 8, 1), "island1-ascend": ("huawei.com/Ascend910", 8, 2),
             "island2-cambricon": ("cambricon.com/mlu", 4, 1)}
    for j in jobs:
        spec = j["template"]["spec"]
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        resource, count, nodes = wants[j["name"]]
        assert container["resources"]["limits"] == {resource: count} and spec["parallelism"] == nodes
        assert container["command"][0] == "torchrun" and "--rdzv-backend=c10d" in container["command"]
        assert "--nnodes=4" in container["command"] and {"name": "HAL_ROLES", "value": "by-island"} in container["env"]
        assert {v["name"] for v in pod["volumes"]} == {"job", "runs"}


def test_bad_emit_input_is_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path, "two_islands")
    for args, words in ((["--devices-per-node", "cuda=3"], "do not fill nodes of 3"),
                        (["--devices-per-node", "cuda"], "give BACKEND=VALUE"),
                        (["--print-multinode", "2"], "give one"),
                        (["--emit", "pbs"], "invalid choice")):
        emit = [] if "--emit" in args else ["--emit", "slurm"]
        done = run_hal("train", config.name, *emit, *args, cwd=tmp_path)
        assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1, (args, done.stderr)
    done = run_hal("train", config.name, "--devices-per-node", "cuda=8", cwd=tmp_path)
    assert done.returncode == 2 and "add --emit" in done.stderr


# --- three "nodes" on this host, started in reverse order -----------------------------------------------------

STANDIN_PLAN = """
precision: fp32
model: {vocab_size: 256, hidden_size: 32, num_layers: 4, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 64, max_seq_len: 32}
parallel:
  schedule: 1f1b
  micro_batches: 4
  micro_batch_size: 2
  stages:
    - {backend: cpu, devices: 1, layers: 1}
    - {backend: ascend, devices: 2, layers: 2, tp: 2}
    - {backend: cambricon, devices: 1, layers: 1}
train: {steps: 3, lr: 3.0e-3, seed: 0, weight_decay: 0.0, data: corpus}
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_env(job_id: str) -> dict[str, str]:
    """A "node"'s shell: this interpreter's torchrun first on PATH, this checkout importable, one rendezvous endpoint."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HAL_")}, "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HAL_RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "HAL_JOB_ID": job_id}


def _start_islands(tmp_path: Path, run_dir: Path, order: list[int], nproc: dict[int, int] | None = None) -> dict[int, subprocess.CompletedProcess]:
    """Emit the torchrun lines, write the job file, start each island's line as a "node" (its own torchrun) in
    ``order``, and wait for all."""
    (tmp_path / "plan.yaml").write_text(STANDIN_PLAN)
    emitted = run_hal("train", "plan.yaml", "--emit", "torchrun", "--run-dir", str(run_dir), cwd=tmp_path)
    assert emitted.returncode == 0, emitted.stderr
    text = emitted.stdout
    heredoc = re.search(r"^mkdir -p .*?^HAL_JOB_EOF$", text, re.S | re.M)
    assert heredoc is not None
    subprocess.run(["bash", "-c", heredoc.group(0)], check=True)
    lines = {i: line for i, line in enumerate(ln for ln in text.splitlines() if ln.startswith("HAL_BACKEND="))}
    env = _node_env("reverse")
    standin = {0: "ascend,cambricon", 1: "ascend", 2: "cambricon"}
    procs = {}
    for island in order:
        line = lines[island]
        if nproc and island in nproc:
            line = re.sub(r"--nproc-per-node=\d+", f"--nproc-per-node={nproc[island]}", line)
        procs[island] = subprocess.Popen(["bash", "-c", line], env={**env, "HAL_STANDIN": standin[island]}, cwd=tmp_path,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        time.sleep(1.0)  # each "node" joins after the one before
    done = {}
    for island, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        done[island] = subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    return done


def test_emitted_lines_started_in_reverse_order_train_as_the_single_host_run(tmp_path: Path) -> None:
    done = _start_islands(tmp_path, tmp_path / "nodes", order=[2, 1, 0])
    assert all(p.returncode == 0 for p in done.values()), "\n".join(p.stdout[-1500:] for p in done.values())
    nodes = [json.loads(line)["loss"] for line in (tmp_path / "nodes" / "train.jsonl").read_text().splitlines()]
    single = run_hal("train", "plan.yaml", "--standin", "ascend,cambricon", "--run-dir", str(tmp_path / "one"), cwd=tmp_path,
                     timeout=240)
    assert single.returncode == 0, single.stderr[-2000:]
    one = [json.loads(line)["loss"] for line in (tmp_path / "one" / "train.jsonl").read_text().splitlines()]
    assert len(nodes) == 3 and nodes == one, (nodes, one)


def test_a_world_that_cannot_fill_the_plan_ends_on_every_rank_naming_the_island(tmp_path: Path) -> None:
    done = _start_islands(tmp_path, tmp_path / "short", order=[2, 1, 0], nproc={1: 1})  # the ascend node brings 1, not 2
    said = "island 1 (ascend, plan ranks 1-2) needs 2 process(es) and 1 joined"
    for island, proc in done.items():
        assert proc.returncode != 0 and said in proc.stdout, (island, proc.stdout[-2000:])


# --- a lost rank under torchrun --max-restarts ------------------------------------------------------------------

RESTART_PLAN = """
precision: fp32
model: {vocab_size: 256, hidden_size: 32, num_layers: 4, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 64, max_seq_len: 32}
parallel:
  schedule: 1f1b
  micro_batches: 4
  micro_batch_size: 2
  stages:
    - {backend: cpu, devices: 1, layers: 2}
    - {backend: cpu, devices: 1, layers: 2}
train: {steps: 40, lr: 3.0e-3, seed: 0, weight_decay: 0.0, data: corpus, checkpoint_every: 5}
"""


def _parent(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _pids_named(name: str, ancestor: int) -> list[int]:
    """This test's processes named ``name``: descendants of ``ancestor`` (the torchrun it started; torchrun starts its
    workers in sessions of their own), never another test's ranks."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != name:
                continue
        except OSError:
            continue
        pid = int(entry.name)
        for _ in range(8):
            pid = _parent(pid)
            if pid in (0, 1) or pid == ancestor:
                break
        if pid == ancestor:
            found.append(int(entry.name))
    return found


def test_a_rank_killed_mid_run_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """torchrun --max-restarts 1 restarts both ranks after rank 1 is SIGKILLed past step 12; they resume from the
    latest complete checkpoint by themselves (step 10 or 15), the log and summary record one restart and the steps
    done again, and every step's loss equals the uninterrupted hal train run's."""
    import signal

    (tmp_path / "plan.yaml").write_text(RESTART_PLAN)
    run_dir = tmp_path / "elastic"
    emitted = run_hal("train", "plan.yaml", "--emit", "torchrun", "--run-dir", str(run_dir), cwd=tmp_path)
    assert emitted.returncode == 0, emitted.stderr
    heredoc = re.search(r"^mkdir -p .*?^HAL_JOB_EOF$", emitted.stdout, re.S | re.M)
    assert heredoc is not None
    subprocess.run(["bash", "-c", heredoc.group(0)], check=True)
    (line,) = [ln for ln in emitted.stdout.splitlines() if ln.startswith("HAL_BACKEND=")]
    line = line.replace("--rdzv-backend=c10d", "--max-restarts=1 --rdzv-backend=c10d")
    env = _node_env("restart")
    proc = subprocess.Popen(["bash", "-c", line], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    log = run_dir / "train.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.is_file() and sum('"step"' in ln for ln in log.read_text().splitlines()) >= 12 and _pids_named("hal-rank-1", proc.pid):
            break
        time.sleep(0.05)
    victims = _pids_named("hal-rank-1", proc.pid)
    assert victims, "rank 1 never ran"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    restarts = [ln for ln in lines if "restart" in ln]
    assert len(restarts) == 1 and restarts[0]["restart"] == 1 and restarts[0]["resumed_at_step"] % 5 == 0, restarts
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == restarts and "restart 1: resumed at step" in out
    advice = summary["checkpoint_cadence"]  # from this run's measured step and checkpoint write times
    assert advice["every"] == 5 and advice["suggested_every"] >= 1 and advice["write_s"] > 0 and advice["step_s"] > 0
    single = run_hal("train", "plan.yaml", "--run-dir", str(tmp_path / "one"), cwd=tmp_path, timeout=240)
    assert single.returncode == 0, single.stderr[-2000:]
    one = {ln["step"]: ln["loss"] for ln in map(json.loads, (tmp_path / "one" / "train.jsonl").read_text().splitlines())}
    last = {}
    for ln in lines:
        if "step" in ln:
            last[ln["step"]] = ln["loss"]  # a step done again: its later line
    assert last == one, {s: (last.get(s), one[s]) for s in one if last.get(s) != one[s]}
    assert summary["final_loss"] == json.loads((tmp_path / "one" / "summary.json").read_text())["final_loss"]


def test_the_example_prints_a_plain_slurm_job_for_one_island(tmp_path: Path) -> None:
    """examples/hetero_cpu.yaml runs on one island: a plain batch job (no hetjob, no het groups) a Slurm user runs as is."""
    done = run_hal("train", str(REPO / "examples" / "hetero_cpu.yaml"), "--emit", "slurm", "--run-dir", "/shared/runs/h",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "hetjob" not in script and "--het-group" not in script and '"$SLURM_JOB_NODELIST"' in script
    assert "srun --export=ALL,HAL_BACKEND=cpu" in script and "--rdzv-backend=c10d" in script
    assert "cat > /shared/runs/h/job.json <<'HAL_JOB_EOF'" in script
