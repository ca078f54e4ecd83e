"""Parallel plans: a table of invalid plans through the real ``hal plan`` (one line, exit 2, nothing
started), the issue's valid plans (a)-(d) with their rank ↔ coordinate maps, and the checks that
need a world size or an accelerator (in-process, with a stand-in backend)."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hal.config import load_config
from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan, parse_plan, validate_plan
from hal.parallel.config.run import TrainConfig, load_run_config, parse_train
from hal.parallel.config.topology import Coord, Topology

from ..conftest import REPO, run_hal

MODEL = "model: {num_layers: 4, num_heads: 4, num_kv_heads: 2, hidden_size: 64, ffn_hidden_size: 128, vocab_size: 256, max_seq_len: 64}\n"
TP2_DP2 = "  stages:\n    - {backend: cpu, devices: 2, layers: 3, tp: 2}\n    - {backend: cpu, devices: 2, layers: 1, dp: 2}\n"


def _parallel(body: str = TP2_DP2, head: str = "  schedule: 1f1b\n  micro_batches: 4\n  micro_batch_size: 2\n") -> str:
    return "parallel:\n" + head + body


def _stages(*stages: str, head: str = "  schedule: 1f1b\n  micro_batches: 4\n  micro_batch_size: 2\n") -> str:
    return _parallel("  stages:\n" + "".join(f"    - {s}\n" for s in stages), head)


# (id, YAML text, words the one `hal: error:` line must contain)
INVALID = [
    ("top-level-typo", MODEL + _parallel().replace("parallel:", "paralel:"), ["unknown key 'paralel'", "did you mean 'parallel'"]),
    ("no-parallel-section", MODEL, ["no 'parallel' section", "stages"]),
    ("parallel-not-mapping", MODEL + "parallel: [1, 2]\n", ["section 'parallel' must be a mapping", "list"]),
    ("parallel-key-typo", MODEL + _parallel(TP2_DP2.replace("stages:", "stagse:")), ["'parallel.stagse'", "did you mean 'stages'"]),
    ("stage-key-typo", MODEL + _stages("{backend: cpu, devices: 4, layers: 4, tpp: 4}"), ["'parallel.stages[0].tpp'", "did you mean 'tp'"]),
    ("stages-empty", MODEL + _parallel("  stages: []\n"), ["'parallel.stages' is empty", "at least one stage"]),
    ("stages-not-list", MODEL + _parallel("  stages: {backend: cpu}\n"), ["'parallel.stages' must be a list", "dict"]),
    ("stage-missing-layers", MODEL + _stages("{backend: cpu, devices: 4}"), ["'parallel.stages[0]' is missing key 'layers'"]),
    ("devices-zero", MODEL + _stages("{backend: cpu, devices: 0, layers: 4}"), ["'parallel.stages[0].devices'", "positive integer", "0"]),
    ("tp-not-int", MODEL + _stages("{backend: cpu, devices: 2, layers: 4, tp: two}"), ["'parallel.stages[0].tp'", "'two'"]),
    ("sp-not-bool", MODEL + _stages("{backend: cpu, devices: 2, layers: 4, tp: 2, sp: 1}"), ["'parallel.stages[0].sp'", "true or false"]),
    ("backend-typo", MODEL + _stages("{backend: cpx, devices: 2, layers: 3, tp: 2}", "{backend: cpu, devices: 2, layers: 1, dp: 2}"),
     ["'parallel.stages[0].backend'", "'cpx'", "did you mean 'cpu'"]),
    ("backend-auto", MODEL + _stages("{backend: auto, devices: 4, layers: 4, dp: 4}"), ["'parallel.stages[0].backend'", "'auto' is not allowed"]),
    ("backend-unavailable", MODEL + _stages("{backend: cpu, devices: 2, layers: 3, tp: 2}", "{backend: ascend, devices: 2, layers: 1, dp: 2}"),
     ["stage 1", "backend 'ascend' is not available", "torch_npu", "hal devices"]),
    ("devices-not-tp-times-dp", MODEL + _stages("{backend: cpu, devices: 2, layers: 3, tp: 2}", "{backend: cpu, devices: 3, layers: 1, dp: 2}"),
     ["stage 1", "devices 3 but tp 1 × dp 2 = 2", "set devices: 2"]),
    ("layers-do-not-add-up", MODEL + _stages("{backend: cpu, devices: 2, layers: 3, tp: 2}", "{backend: cpu, devices: 2, layers: 2, dp: 2}"),
     ["layers add up to 5 (3 + 2)", "model.num_layers is 4"]),
    ("tp-does-not-divide-heads", MODEL + _stages("{backend: cpu, devices: 3, layers: 4, tp: 3}"),
     ["stage 0", "tp 3 does not divide model.num_heads 4", "use tp in {1, 2}"]),
    ("tp-does-not-divide-kv-heads", MODEL + _stages("{backend: cpu, devices: 4, layers: 4, tp: 4}", head="  micro_batches: 1\n"),
     ["tp 4 does not divide model.num_kv_heads 2"]),
    ("tp-does-not-divide-vocab",
     MODEL.replace("vocab_size: 256", "vocab_size: 257") + _stages("{backend: cpu, devices: 2, layers: 4, tp: 2}", head="  micro_batches: 1\n"),
     ["tp 2 does not divide model.vocab_size 257"]),
    ("sp-without-tp", MODEL + _stages("{backend: cpu, devices: 2, layers: 4, dp: 2, sp: true}"), ["stage 0", "sp needs tp ≥ 2", "got tp 1"]),
    ("dp-does-not-divide-micro-batch", MODEL + _stages("{backend: cpu, devices: 2, layers: 3, tp: 2}", "{backend: cpu, devices: 2, layers: 1, dp: 2}",
                                                      head="  micro_batches: 4\n  micro_batch_size: 3\n"),
     ["stage 1", "dp 2 does not divide parallel.micro_batch_size 3", "e.g. 6"]),
    ("sp-sequence-not-divisible", MODEL + _stages("{backend: cpu, devices: 2, layers: 4, tp: 2, sp: true}", head="  micro_batches: 1\n")
     + "train: {seq_len: 31}\n", ["stage 0", "sequence length divisible by 2", "train.seq_len 31"]),
    ("schedule-typo", MODEL + _parallel(head="  schedule: 1f1f\n  micro_batches: 4\n"), ["'parallel.schedule'", "did you mean '1f1b'"]),
    ("1f1b-too-few-micro-batches", MODEL + _stages("{backend: cpu, devices: 1, layers: 2}", "{backend: cpu, devices: 1, layers: 1}",
                                                  "{backend: cpu, devices: 1, layers: 1}", head="  micro_batches: 2\n"),
     ["micro_batches 2 is fewer than the 3 stages", "schedule: gpipe"]),
    ("train-key-typo", MODEL + _parallel() + "train: {stpes: 10}\n", ["'train.stpes'", "did you mean 'steps'"]),
    ("train-seq-too-long", MODEL + _parallel() + "train: {seq_len: 128}\n", ["train.seq_len 128 exceeds model.max_seq_len 64"]),
    ("model-key-typo", MODEL.replace("num_layers", "num_layer") + _parallel(), ["unknown key 'model.num_layer'", "did you mean 'num_layers'"]),
]


def _marked_processes(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker``: anything the command started and left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_plan_gives_one_line_exit_2_and_starts_nothing(tmp_path, case) -> None:
    name, text, needles = case
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    marker = f"hal-plan-test-{uuid.uuid4().hex}"
    result = run_hal("plan", "--config", str(path), env={"HAL_TEST_MARKER": marker})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert _marked_processes(marker) == [], "hal plan left a process running"


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Make starting a process or a process group fail loudly: validation must not need either."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("validation started a process or process group")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.Process, "start", refuse)
    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(dist, "new_group", refuse)


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_plans_are_refused_before_anything_starts(tmp_path, nothing_may_start, case) -> None:
    """The same table in-process: the ConfigError comes from validation alone, with no process or group."""
    _name, text, needles = case
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path, env={})
    assert all(n in str(info.value) for n in needles), str(info.value)


# --- the valid plans ------------------------------------------------------------------------

VALID = {
    "a": ("  schedule: 1f1b\n  micro_batches: 4\n  micro_batch_size: 2\n  stages:\n"
          "    - {backend: cpu, devices: 2, layers: 3, tp: 2}\n"
          "    - {backend: cpu, devices: 2, layers: 1, dp: 2}\n"),
    "b": ("  schedule: 1f1b\n  micro_batches: 4\n  micro_batch_size: 2\n  stages:\n"
          "    - {backend: cpu, devices: 2, layers: 2, dp: 2}\n"
          "    - {backend: cpu, devices: 2, layers: 2, tp: 2, sp: true}\n"),
    "c": ("  schedule: gpipe\n  micro_batches: 4\n  micro_batch_size: 2\n  stages:\n"
          "    - {backend: cpu, devices: 1, layers: 1}\n"
          "    - {backend: cpu, devices: 2, layers: 2, dp: 2}\n"
          "    - {backend: cpu, devices: 1, layers: 1}\n"),
    "d": ("  schedule: 1f1b\n  micro_batches: 2\n  micro_batch_size: 2\n  stages:\n"
          "    - {backend: cpu, devices: 4, layers: 4, tp: 2, dp: 2}\n"),
}

# (stage, dp, tp) of ranks 0..3, by the convention: stages own consecutive ranks, TP innermost.
EXPECTED_COORDS = {
    "a": [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 1, 0)],
    "b": [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1)],
    "c": [(0, 0, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0)],
    "d": [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)],
}
EXPECTED_TP_GROUPS = {"a": [(0, 1), (2,), (3,)], "b": [(0,), (1,), (2, 3)], "c": [(0,), (1,), (2,), (3,)], "d": [(0, 1), (2, 3)]}
EXPECTED_DP_GROUPS = {"a": [(0,), (1,), (2, 3)], "b": [(0, 1), (2,), (3,)], "c": [(0,), (1, 2), (3,)], "d": [(0, 2), (1, 3)]}


def _load_valid(tmp_path: Path, key: str):
    path = tmp_path / f"plan_{key}.yaml"
    path.write_text(MODEL + "parallel:\n" + VALID[key])
    return load_run_config(path, world_size=4, env={})


@pytest.mark.parametrize("key", sorted(VALID))
def test_valid_plan_topology(tmp_path, key) -> None:
    run = _load_valid(tmp_path, key)
    topo = Topology.from_plan(run.plan)
    assert topo.world_size == 4 == run.plan.world_size
    # every rank exactly once, stages contiguous and in order
    flat = [r for k in range(topo.num_stages) for r in topo.stage_ranks(k)]
    assert flat == [0, 1, 2, 3]
    assert [tuple(topo.coord(r)) for r in range(4)] == EXPECTED_COORDS[key]
    for r in range(4):
        c = topo.coord(r)
        assert topo.rank_of(*c) == r and topo.backend_of(r) == "cpu"
    tp_groups = [topo.tp_ranks(m.index, d) for m in topo.stages for d in range(m.dp)]
    dp_groups = [topo.dp_ranks(m.index, t) for m in topo.stages for t in range(m.tp)]
    assert tp_groups == EXPECTED_TP_GROUPS[key] and dp_groups == EXPECTED_DP_GROUPS[key]
    for group in tp_groups:  # TP innermost: consecutive ranks
        assert list(group) == list(range(group[0], group[0] + len(group)))
    for groups in (tp_groups, dp_groups):  # each a partition of the world
        assert sorted(r for g in groups for r in g) == [0, 1, 2, 3]
    # layers: contiguous, covering the model once
    assert [layer for m in topo.stages for layer in m.layer_range] == list(range(run.model.num_layers))


def test_plan_a_details(tmp_path) -> None:
    run = _load_valid(tmp_path, "a")
    assert run.plan.stages == (StagePlan("cpu", 2, 3, tp=2), StagePlan("cpu", 2, 1, dp=2))
    topo = Topology.from_plan(run.plan)
    assert topo.coord(3) == Coord(stage=1, dp=1, tp=0)
    assert topo.boundary_ranks(0) == (0, 1, 2, 3)
    assert topo.stage_islands() == (0, 0, 1, 1)
    assert [m.layer_range for m in topo.stages] == [range(0, 3), range(3, 4)]


def test_topology_lookups_refuse_out_of_range() -> None:
    topo = Topology.from_plan(ParallelPlan((StagePlan("cpu", 4, 4, tp=2, dp=2),), "1f1b", 1, 2))
    for call in (lambda: topo.coord(4), lambda: topo.rank_of(0, 2, 0), lambda: topo.stage_ranks(1), lambda: topo.boundary_ranks(0)):
        with pytest.raises(ValueError):
            call()


def test_defaults_and_train_section() -> None:
    plan = parse_plan({"stages": [{"backend": "cpu", "devices": 2, "layers": 2, "dp": 2},
                                  {"backend": "cpu", "devices": 3, "layers": 2, "dp": 3}]})
    assert (plan.schedule.name, plan.micro_batches, plan.micro_batch_size, plan.zero1) == ("1f1b", 2, 6, False)
    assert parse_train(None) == TrainConfig()
    train = parse_train({"steps": 5, "lr": "1e-3", "data": "corpus", "checkpoint_dir": "ckpt"})
    assert (train.steps, train.lr, train.data, train.checkpoint_dir) == (5, 1e-3, "corpus", "ckpt")
    with pytest.raises(ConfigError, match="'train.data'.*did you mean 'corpus'"):
        parse_train({"data": "corpse"})


# --- checks that need a world size or an accelerator -----------------------------------------------


def _plan(*stages: StagePlan, micro_batches: int = 4, micro_batch_size: int = 2) -> ParallelPlan:
    return ParallelPlan(tuple(stages), "1f1b", micro_batches, micro_batch_size)


def test_world_size_must_match() -> None:
    plan = _plan(StagePlan("cpu", 2, 3, tp=2), StagePlan("cpu", 2, 1, dp=2))
    validate_plan(plan, ModelConfig(), world_size=4)
    with pytest.raises(ConfigError, match=r"the stages use 4 devices \(2 \+ 2\) but the world has 3 ranks"):
        validate_plan(plan, ModelConfig(), world_size=3)


class _FakeAccelerator:
    """Stands in for an available accelerator backend with a fixed number of devices."""

    name, device_type = "cuda", "cuda"

    def __init__(self, count: int) -> None:
        self.count = count

    def availability(self):
        from hal.backend import Availability

        return Availability(True, "stand-in")

    def device_count(self) -> int:
        return self.count


def test_accelerator_device_count_is_checked_per_backend(monkeypatch) -> None:
    import hal.backend_registry as registry

    real = registry.get_backend
    monkeypatch.setattr(registry, "get_backend", lambda name: _FakeAccelerator(2) if name == "cuda" else real(name))
    plan = _plan(StagePlan("cuda", 2, 2, tp=2), StagePlan("cpu", 2, 1, dp=2), StagePlan("cuda", 1, 1), micro_batches=4)
    with pytest.raises(ConfigError, match=r"stage\(s\) 0, 2 put 3 ranks on backend 'cuda'.*this host has 2 cuda device"):
        validate_plan(plan, ModelConfig(), world_size=5)
    validate_plan(plan, ModelConfig(), world_size=5, single_host=False)  # several nodes: each checks its own
    fits = _plan(StagePlan("cuda", 2, 3, tp=2), StagePlan("cpu", 4, 1, dp=4), micro_batch_size=4)
    validate_plan(fits, ModelConfig(), world_size=6)  # cpu ranks share the host: any number fits


def test_hal_config_keeps_sections_as_plain_dicts(tmp_path) -> None:
    path = tmp_path / "hal.yaml"
    path.write_text("backend: cpu\n" + MODEL + "parallel:\n" + VALID["a"] + "train: {steps: 3}\n")
    config = load_config(path, env={})
    assert config.backend == "cpu" and config.train == {"steps": 3}
    assert config.model["num_layers"] == 4 and config.parallel["schedule"] == "1f1b"
    assert config.origins["parallel"] == str(path)
    assert load_config(env={}).parallel is None
    result = run_hal("config", "--config", str(path))  # hal config is unchanged by the sections
    assert result.returncode == 0, result.stderr


def test_hal_does_not_import_parallel() -> None:
    """The data flows config → plan: importing hal (and its config) leaves parallel unloaded."""
    code = "import sys, hal, hal.config, hal.cli; print(any(m == 'hal.parallel' or m.startswith('hal.parallel.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# --- the shipped example ----------------------------------------------------------------------------


def test_example_config_is_accepted() -> None:
    result = run_hal("plan", "--config", "examples/hetero_cpu.yaml")
    assert result.returncode == 0, result.stderr
    assert "boundary 0->1: ranks 0-3" in result.stdout
    report = json.loads(run_hal("plan", "--config", "examples/hetero_cpu.yaml", "--json").stdout)
    assert report["topology"]["world_size"] == 4
    assert [r["tp"] for r in report["topology"]["ranks"]] == [0, 1, 0, 0]
    assert [s["layers"] for s in report["topology"]["stages"]] == [[0], [1, 2, 3]]


def test_the_schedules_guess_says_so_and_this_hosts_calibrated_profile_prices_it(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The main example's idle shares were shown as a prediction from a guess (stage time proportional to its layers:
    stage 0 69 % idle, measured about 28 %). Now the guess says it is one and how to price with measured times; with
    this host's calibrated profile in the cache (``hal plan --calibrate`` makes it), hal plan uses it by itself and
    shows the cost model's idle share beside the guess. (A --profile of the main example's four ranks on the probed
    two-core host also crashed the pricing: an IndexError.)"""
    from hal.parallel.planner.host_profile import CACHE_ENV, profile_path

    config = REPO / "examples" / "hetero_cpu.yaml"
    cache = {CACHE_ENV: str(tmp_path / "cache")}
    guess = run_hal("plan", "--config", str(config), env=cache)
    assert guess.returncode == 0, guess.stderr
    assert "idle share overall 0.385 — a GUESS, not a measurement" in guess.stdout
    assert "--calibrate (a quick calibration of this host, cached)" in guess.stdout
    assert "idle share (cost model)" not in guess.stdout
    monkeypatch.setenv(CACHE_ENV, cache[CACHE_ENV])
    kept = profile_path(load_run_config(config, check_backends=False))
    kept.parent.mkdir(parents=True)
    _synthetic_profile(kept, config)  # as --calibrate leaves it (its numbers: synthetic, not this host's)
    priced = run_hal("plan", "--config", str(config), env=cache)
    assert priced.returncode == 0, priced.stderr
    table = priced.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("stage  idle share (guess)"))
    assert "idle share (cost model)" in table[header] and table[header + 1].startswith("0      0.692")
    assert f"note: priced with this host's calibrated profile ({kept}, made " in priced.stdout
    assert "the plan's 4 cpu ranks share this host's 2 cores" in priced.stdout or os.cpu_count() != 2
    both = run_hal("plan", "--config", str(config), "--calibrate", "--profile", str(kept), env=cache)
    assert both.returncode == 2 and "--profile already gives the times: drop one" in both.stderr


def test_plan_needs_a_config() -> None:
    result = run_hal("plan")
    assert result.returncode == 2 and "give a config file" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_replicated_config_says_how_its_replicas_meet(tmp_path: Path) -> None:
    """hal plan of examples/replicas_cpu.yaml with ``overlap: on`` (written bare, as YAML reads it: a boolean) and
    fp8 on the wire: the first line says both."""
    import yaml

    text = (REPO / "examples" / "replicas_cpu.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    path = tmp_path / "replicas.yaml"
    path.write_text(text.replace("replica_sync: {every: 1}", "replica_sync: {every: 1, overlap: on, compress: fp8}"),
                    encoding="utf-8")
    assert raw["parallel"]["replica_sync"] == {"every": 1}  # the example's line the replace above rewrites
    result = run_hal("plan", "--config", str(path))
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert "fp8 on the wire" in first and "exchanged during the backward" in first, first


def _synthetic_profile(path: Path, config: Path) -> None:
    """A profile of cpu-generic for the config's model: a layer's time proportional to its rows."""
    from hal.parallel.planner.device_profile import DeviceProfile, LayerPoint, PerToken, Profile

    run = load_run_config(config, check_backends=False)
    seq = run.train.seq_len or run.model.max_seq_len
    points = tuple(LayerPoint(1, r, seq, rc, 1e-3 * r, (2e-3 + (1e-3 if rc else 0)) * r, 10_000 * r)
                   for rc in (False, True) for r in (1, 2, 4, 8))
    device = DeviceProfile("cpu-generic", "cpu", "measured", "synthetic", points, PerToken(0, 0, 0), PerToken(0, 0, 0), 0.0)
    Profile(run.model.to_dict(), run.hal.precision, {"cpu-generic": device}, seq=seq).save(path)


def test_hal_plan_with_a_profile_prices_the_configs_own_plan_and_replicas(tmp_path: Path) -> None:
    """hal plan --profile P (no --search): the cost model's step for the plan as written; for replicas, each replica's
    step and the sync (over the bridge when HAL_ISLANDS declares them apart), in text and in --json."""
    import yaml

    example = REPO / "examples" / "replicas_cpu.yaml"
    profile = tmp_path / "profile.json"
    _synthetic_profile(profile, example)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("cluster:\n  groups: [{backend: cpu, device: cpu-generic, count: 4, node: 0, cores: 4}]\n"
                       "  links: {bridge_gbps: 0.01}\n", encoding="utf-8")
    together = run_hal("plan", "--config", str(example), "--profile", str(profile), "--cluster", str(cluster), "--json")
    assert together.returncode == 0, together.stderr
    apart = run_hal("plan", "--config", str(example), "--profile", str(profile), "--cluster", str(cluster), "--json",
                    env={"HAL_ISLANDS": "0,0,1,1"})
    assert apart.returncode == 0, apart.stderr
    a, b = json.loads(together.stdout)["predicted"], json.loads(apart.stdout)["predicted"]
    assert a["rows"] == b["rows"] == [2, 6] and len(a["replicas"]) == 2
    assert a["step_s"] == pytest.approx(a["compute_s"] + a["sync_s"])
    assert b["sync_s"] > 10 * a["sync_s"]  # 10 MB/s across the bridge, against the island's own link
    assert b["compute_s"] == pytest.approx(a["compute_s"])
    text = run_hal("plan", "--config", str(example), "--profile", str(profile), "--cluster", str(cluster))
    assert text.returncode == 0 and "predicted (cost model): step" in text.stdout and "replica 1: 6 rows" in text.stdout
    single = tmp_path / "single.yaml"  # the example's model as one plan: its own predicted step, no sync
    raw = yaml.safe_load(example.read_text(encoding="utf-8"))
    raw["parallel"] = {"micro_batch_size": 2, "micro_batches": 4, "stages": [{"backend": "cpu", "devices": 2, "layers": 4,
                                                                              "dp": 2}]}
    single.write_text(yaml.safe_dump(raw), encoding="utf-8")
    plain = run_hal("plan", "--config", str(single), "--profile", str(profile), "--cluster", str(cluster), "--json")
    assert plain.returncode == 0, plain.stderr
    one_plan = json.loads(plain.stdout)["predicted"]["prediction"]
    assert one_plan["step_s"] > 0 and len(one_plan["stages"]) == 1
    assert one_plan["tokens_per_s"] == pytest.approx(8 * 64 / one_plan["step_s"])
    assert "order" not in one_plan  # 1f1b: a fixed order, nothing calibrates
    played = tmp_path / "played.yaml"  # a zero-bubble pipeline: predicted with the order hal train will keep, and said
    raw["parallel"] = {"micro_batch_size": 2, "micro_batches": 4, "schedule": "zero-bubble",
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 3}, {"backend": "cpu", "devices": 1, "layers": 1}]}
    played.write_text(yaml.safe_dump(raw), encoding="utf-8")
    zb = run_hal("plan", "--config", str(played), "--profile", str(profile), "--cluster", str(cluster), "--json")
    assert zb.returncode == 0, zb.stderr
    order = json.loads(zb.stdout)["predicted"]["prediction"]["order"]
    assert order["chosen"] in ("unit", "measured") and order["measured_step_s"] <= order["unit_step_s"] + 1e-12
    zb = run_hal("plan", "--config", str(played), "--profile", str(profile), "--cluster", str(cluster))
    assert zb.returncode == 0 and "  order: played from these predicted times" in zb.stdout, zb.stdout
    other = tmp_path / "other.yaml"  # the example's plan for another model: the profile is refused in one line
    other.write_text(example.read_text(encoding="utf-8").replace("hidden_size: 64", "hidden_size: 32"), encoding="utf-8")
    one = run_hal("plan", "--config", str(other), "--profile", str(profile), "--cluster", str(cluster))
    assert one.returncode == 2 and "--profile" in one.stderr and len(one.stderr.strip().splitlines()) == 1, one.stderr
    bare = run_hal("plan", "--config", str(example), "--cluster", str(cluster))
    assert bare.returncode == 2 and "--cluster goes with --search or --profile" in bare.stderr


def test_a_dualpipev_plan_says_how_each_stage_will_run_its_pairs(tmp_path: Path) -> None:
    """At once on a plain stage, in turn (and why, in brief) on a tp2 one, as hal train will run them; --json has why."""
    path = tmp_path / "dpv.yaml"
    path.write_text(MODEL + "parallel:\n  schedule: dualpipev\n  virtual_stages: 2\n  micro_batches: 4\n"
                    "  micro_batch_size: 2\n  stages:\n    - {backend: cpu, devices: 2, layers: 2, tp: 2}\n"
                    "    - {backend: cpu, devices: 1, layers: 2}\n")
    shown = run_hal("plan", "--config", str(path))
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout[shown.stdout.index("pairs (forward and backward at once)"):].splitlines()
    assert table[1].split()[-3:] == ["turn", "(tensor", "parallelism)"] and table[2].split()[-2:] == ["at", "once"]
    report = json.loads(run_hal("plan", "--config", str(path), "--json").stdout)
    assert report["schedule"]["pairs"][0].startswith("in turn: tensor parallelism: ") and report["schedule"]["pairs"][1] == "at once"
    refused = run_hal("plan", "--config", str(path), env={"HAL_PAIR_OVERLAP": "yes"})  # hal train says it the same way
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "hal: error: HAL_PAIR_OVERLAP='yes': use 0 (every pair in turn), 1 (at once wherever a stage can) or leave it "
        "unset (at once but on compiled stages)"], refused.stderr
