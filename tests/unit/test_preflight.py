"""One preflight: the checks in one order, each command's subset named from it, and hal plan's subset catching a
path hal train would refuse -- without making anything."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hal.errors import ConfigError
from hal.parallel.loop import preflight as preflight_module
from hal.parallel.loop.preflight import CHECKS, CONFIG, LOADED, PLAN, PROFILE, SEARCH, TRAIN, Request, preflight

from ..conftest import REPO


def test_every_command_names_checks_of_the_one_list() -> None:
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names)) and names[:2] == ["steps", "config"]
    assert TRAIN == tuple(names)
    assert set(PLAN) <= set(TRAIN) and set(LOADED) <= set(PLAN)
    assert {"config"} <= set(CONFIG) & set(PROFILE) & set(SEARCH) and set(CONFIG) <= set(PLAN)  # one door for every command
    assert not {"steps", "resume", "cpu binding"} & set(PLAN)  # flags hal plan does not have
    with pytest.raises(ValueError, match="no preflight check is called nonsense"):
        preflight(Request("x.yaml"), ("config", "nonsense"))


def _config(tmp_path: Path, train: dict[str, object]) -> Path:
    raw = yaml.safe_load((REPO / "examples" / "hetero_cpu.yaml").read_text(encoding="utf-8"))
    raw["train"].update(train)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_the_plan_subset_checks_the_configured_paths_and_makes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x", encoding="utf-8")
    config = _config(tmp_path, {"checkpoint_dir": str(tmp_path / "a-file" / "ckpt")})
    with pytest.raises(ConfigError, match="a-file is a file"):
        preflight(Request(str(config), writes=False), PLAN)
    good = _config(tmp_path, {"log_file": str(tmp_path / "logs" / "train.jsonl")})
    checked = preflight(Request(str(good), writes=False), PLAN)
    assert checked.run_dir is None and checked.checkpoint_dir is None  # no run directory: nothing chosen
    assert checked.log_file == tmp_path / "logs" / "train.jsonl" and not (tmp_path / "logs").exists()
    assert len(checked.precision) == checked.loaded.plan.num_stages


def test_the_train_subset_fills_every_part_of_the_job(tmp_path: Path) -> None:
    config = _config(tmp_path, {})
    checked = preflight(Request(str(config), steps=2, run_dir=str(tmp_path / "run")), TRAIN)
    assert (checked.steps, checked.start, checked.checkpoint) == (2, 0, None)
    assert checked.log_file == tmp_path / "run" / "train.jsonl"
    assert checked.checkpoint_dir == tmp_path / "run" / "checkpoints"
    assert not (tmp_path / "run").exists()  # checked as creatable, made by the run


def test_each_stage_backend_is_resolved_once_and_every_check_asks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    real = preflight_module.get_backend
    monkeypatch.setattr(preflight_module, "get_backend", lambda name: asked.append(name) or real(name))
    checked = preflight(Request(str(_config(tmp_path, {})), writes=False), PLAN)
    stages = checked.loaded.plan.stages
    assert asked == [stage.backend for stage in stages]  # once a stage, though precision, moe compile and memory ask
    assert [(v.index, v.backend.name) for v in checked.stages] == [(k, s.backend) for k, s in enumerate(stages)]
    assert len(checked.precision) == len(checked.stages)


def test_the_config_door_refuses_what_hal_train_would(tmp_path: Path) -> None:
    """hal config's checks (CONFIG) include the loop's: a local SGD run that would not end at a meeting."""
    raw = yaml.safe_load((REPO / "examples" / "replicas_cpu.yaml").read_text(encoding="utf-8"))
    raw["parallel"]["replica_sync"] = {"every": 4}
    raw["train"]["steps"] = 6
    raw["train"].pop("checkpoint_every", None)
    path = tmp_path / "local_sgd.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(ConfigError, match="train.steps 6 is not a multiple of parallel.replica_sync.every 4: .* use steps: 4"):
        preflight(Request(str(path), local=False, writes=False), CONFIG)
    with pytest.raises(ConfigError, match="--steps 6 is not a multiple of parallel.replica_sync.every 4: .* use --steps 4"):
        preflight(Request(str(path), steps=6, local=False, writes=False), ("steps", *CONFIG))
