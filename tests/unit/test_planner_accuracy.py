"""benchmarks/planner_accuracy.py: bad input is one line on stderr and exit 2, refused before anything is profiled or
trained (the profiling and the training are replaced by failures: neither may start); a usable --profile runs
through a real ``hal train`` run."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import planner_accuracy as pa
from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.device_profile import DeviceProfile, LayerPoint, PerToken, Profile


@pytest.fixture(autouse=True)
def no_long_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the profile is measured or a plan trained: either one here fails the test."""
    import hal.parallel.planner.make_profile as profiler

    def profiled(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the profile was measured before the input was checked")

    def trained(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a plan was trained before the input was checked")

    monkeypatch.setattr(profiler, "make_profile", profiled)
    monkeypatch.setattr(pa, "measured", trained)
    monkeypatch.setattr(pa, "host_op_us", lambda: 2.0)


def write_profile(path: Path, meta: dict[str, Any] | Any) -> Path:
    """A small cpu profile of the cpu-small model at fp32 (made-up times) with ``meta``."""
    model = ModelConfig(**pa.MODELS["cpu-small"])
    points = tuple(LayerPoint(tp=1, rows=rows, seq=64, recompute=rc, forward_s=1e-3 * rows, backward_s=2e-3 * rows * (1.5 if rc else 1),
                              activation_bytes=(1 if rc else 4) * 2**20 * rows)
                   for rows in (1, 2, 4) for rc in (False, True))
    device = DeviceProfile(device="cpu-generic", backend="cpu", source="measured", basis="made up for a test", layers=points,
                           embedding=PerToken(2e-7, 4e-7, 8), head=PerToken(2e-6, 3e-6, 5000),
                           optimizer_s_per_param=3e-9, threads=1)
    Profile(model.to_dict(), "fp32", {"cpu-generic": device}, seq=64, meta=meta).save(path)
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """main(argv) exits 2 with exactly one line on stderr (returned) and nothing on stdout."""
    assert pa.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("planner_accuracy: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--only", "abc"], "argument --only: 'abc' is not a plan number"),
    (["--only", "1,,3"], "argument --only: '' is not a plan number"),
    (["--only", "99"], "--only 99: the plans are numbered 1 to 9"),
    (["--only", "0"], "--only 0: the plans are numbered 1 to 9"),  # not Python's index -1, the last plan
    (["--only", "2,0,10"], "--only 0, 10: the plans are numbered 1 to 9"),
    (["--only", "10", "--compile", "inductor"], "--only 10: the plans with --compile are numbered 1 to 9"),
    (["--steps", "0"], "argument --steps: 0: give 2 or more"),
    (["--steps", "-1"], "argument --steps: -1: give 2 or more"),
    (["--steps", "1"], "argument --steps: 1: give 2 or more"),  # one step: no steady step to take a median of
    (["--steps", "x"], "argument --steps: 'x' is not a whole number"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    line = refused(capsys, argv)
    assert expected in line
    assert "base.yaml" not in line  # not the temporary config the flag went into


def test_save_profile_is_checked_before_profiling(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "--save-profile " + str(tmp_path) + ": is a directory; give a file path" in refused(
        capsys, ["--save-profile", str(tmp_path)])
    (tmp_path / "file").write_text("")
    line = refused(capsys, ["--save-profile", str(tmp_path / "file" / "sub" / "p.json")])
    assert "cannot be created" in line and "is a file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


def test_an_unreadable_profile_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = refused(capsys, ["--profile", str(tmp_path / "missing.json")])
    assert f"--profile {tmp_path / 'missing.json'}: cannot read it" in line  # load_profile's ConfigError, not exit 1
    (tmp_path / "bad.json").write_text("{")
    refused(capsys, ["--profile", str(tmp_path / "bad.json")])


def test_a_profile_compiled_otherwise_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_profile(tmp_path / "p.json", {"compiled_layers": None})
    assert "timed its layers eager, these plans run them compiled with inductor" in refused(
        capsys, ["--profile", str(path), "--compile", "inductor"])


@pytest.mark.parametrize("host", [[0, 0], "abc", [2.0], [2.0, -1.0], [math.nan, 2.0], [True, 2.0], [2.0, "1"], {"a": 1}])
def test_a_bad_host_op_us_is_refused_before_any_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, host: Any) -> None:
    path = write_profile(tmp_path / "p.json", {"host_op_us": host})
    line = refused(capsys, ["--profile", str(path), "--only", "1", "--steps", "2"])
    if isinstance(host, list) and any(isinstance(x, float) and math.isnan(x) for x in host):
        assert f"--profile {path}: " in line  # NaN: load_profile may refuse the file itself (not JSON), as well
    else:
        assert f"--profile {path}: meta.host_op_us is " in line and "not two positive microsecond times" in line


@pytest.mark.multiprocess  # hal train runs the plan for real
@pytest.mark.parametrize("meta", [{"host_op_us": [2.0, 1.5]}, {"host_op_us": None}])
def test_a_usable_profile_runs_through(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path, meta: dict[str, Any]) -> None:
    path = write_profile(tmp_path / "p.json", meta)
    monkeypatch.undo()  # the real host timing and the real training run: only the profile is made up
    assert pa.main(["--profile", str(path), "--only", "1", "--steps", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert [r["plan"] for r in result["rows"]] == [pa.PLANS[0][0]]
    drift = result["rows"][0]["host_vs_profile"]
    assert (drift > 0 and math.isfinite(drift)) if meta.get("host_op_us") else drift is None
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(pa.MODELS))
def test_every_models_plans_are_valid_on_4_ranks(name: str) -> None:
    """Each model's plans (layer counts scaled to its depth) pass the plan checks on 4 ranks, and the deeper
    models keep the 8-layer splits' proportions."""
    from hal.parallel.config.plan import parse_plan, validate_plan

    model = ModelConfig(**pa.MODELS[name])
    assert model.num_layers % 8 == 0
    for label, raw in pa.plans("cuda", name):
        plan = parse_plan(raw)
        validate_plan(plan, model, world_size=4, check_backends=False, seq_len=model.max_seq_len, origin=label)
        assert sum(s.layer_count for s in plan.stages) == model.num_layers
