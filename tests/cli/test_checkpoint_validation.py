"""A damaged checkpoint is refused before any rank starts, in one line: checksums catch flipped bytes, the
parent checks meta.json, the stage files' structure, names, shapes and values, and the RNG file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml

from hal.errors import ConfigError
from hal.parallel.loop.job_runner import prepare
from hal.parallel.state.checkpoint import META, file_checksum

from ..conftest import REPO, run_hal

ONE_RANK = {"schedule": "1f1b", "micro_batches": 1, "micro_batch_size": 2,
            "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real checkpoint: 2 steps of the main job's model on one rank."""
    root = tmp_path_factory.mktemp("ckpt")
    raw = yaml.safe_load((REPO / "examples/hetero_cpu.yaml").read_text(encoding="utf-8"))
    raw["parallel"] = ONE_RANK
    raw["train"].update(steps=2, checkpoint_every=None)
    config = root / "one.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = run_hal("train", str(config), "--run-dir", str(root / "run"), "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    return {"config": config, "checkpoint": Path(json.loads(result.stdout)["checkpoint"]), "root": root}


def _copy(trained: dict[str, Path], tmp_path: Path) -> Path:
    target = tmp_path / "step-000002"
    shutil.copytree(trained["checkpoint"], target)
    return target


def _meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / META).read_text(encoding="utf-8"))


def _write_meta(ckpt: Path, meta: Any) -> None:
    (ckpt / META).write_text(json.dumps(meta), encoding="utf-8")


def _restamp(ckpt: Path, name: str) -> None:
    """Rewrite a file's checksum, so only the deeper checks can catch what was changed in it."""
    meta = _meta(ckpt)
    meta["checksums"][name] = file_checksum(ckpt / name)
    _write_meta(ckpt, meta)


def _edit_stage(ckpt: Path, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    blob = torch.load(ckpt / "stage-0.pt", weights_only=True)
    changed = change(blob)
    blob = changed if isinstance(changed, dict) else blob
    torch.save(blob, ckpt / "stage-0.pt")
    _restamp(ckpt, "stage-0.pt")


def _flip_bytes(ckpt: Path) -> None:
    data = bytearray((ckpt / "stage-0.pt").read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    (ckpt / "stage-0.pt").write_bytes(bytes(data))


def _nan_params(blob: dict[str, Any]) -> None:
    for tensor in blob["params"].values():
        tensor.fill_(float("nan"))


def _wrong_shape(blob: dict[str, Any]) -> None:
    name = next(iter(blob["params"]))
    blob["params"][name] = torch.zeros(3, 3)


def _short_moment(blob: dict[str, Any]) -> None:
    name, state = next(iter(blob["optimizer"].items()))
    state["exp_avg"] = state["exp_avg"][:1]  # a rank would fail deep in AdamW's update on it


def _stray_state(blob: dict[str, Any]) -> None:
    blob["optimizer"]["layers.99.mlp.up.weight"] = dict(next(iter(blob["optimizer"].values())))


def _add_residuals(ckpt: Path, blob: Any) -> None:
    """An fp8 wire residual file beside the stage file, listed and checksummed as hal train lists it."""
    name = "fp8-residuals-rank-0.pt"
    torch.save(blob, ckpt / name)
    meta = _meta(ckpt)
    meta["files"].append(name)
    meta["checksums"][name] = file_checksum(ckpt / name)
    _write_meta(ckpt, meta)


def _residual(ckpt: Path, values: torch.Tensor | None = None) -> dict[str, Any]:
    name, tensor = next(iter(torch.load(ckpt / "stage-0.pt", weights_only=True)["params"].items()))
    return {name: torch.zeros(tensor.numel()) if values is None else values}


def _outer_momentum(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, Any]], None]:
    """Local SGD's outer momentum beside the weights (as a replicated local-SGD run keeps it), one entry changed."""
    def edit(blob: dict[str, Any]) -> None:
        blob["outer_momentum"] = {name: torch.zeros_like(t) for name, t in blob["params"].items()}
        name = next(iter(blob["outer_momentum"]))
        blob["outer_momentum"][name] = change(blob["outer_momentum"][name])
    return edit


def _int_parameter(blob: dict[str, Any]) -> None:
    name, tensor = next(iter(blob["params"].items()))
    blob["params"][name] = tensor.to(torch.int64)


def _int_moment(blob: dict[str, Any]) -> None:
    state = next(iter(blob["optimizer"].values()))
    state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.int32)


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "outer momentum holding NaN": (lambda c: _edit_stage(c, _outer_momentum(lambda t: t.fill_(float("nan")))),
                                   "the outer momentum of embed.weight holds NaN or inf; the checkpoint is damaged"),
    "outer momentum of the wrong shape": (lambda c: _edit_stage(c, _outer_momentum(lambda t: t[:1])),
                                          "the outer momentum of embed.weight has shape (1, "),
    "outer momentum of integers": (lambda c: _edit_stage(c, _outer_momentum(lambda t: t.to(torch.int64))),
                                   "the outer momentum of embed.weight is torch.int64, not floating point"),
    "outer momentum not a dict": (lambda c: _edit_stage(c, lambda b: {**b, "outer_momentum": [1]}),
                                  "its local SGD outer momentum is not a dict of tensors"),
    "an integer parameter": (lambda c: _edit_stage(c, _int_parameter), "parameter embed.weight is torch.int64, not floating"),
    "an integer AdamW moment": (lambda c: _edit_stage(c, _int_moment), "exp_avg_sq is torch.int32, not floating point"),
    "fp8 residuals of the wrong size": (lambda c: _add_residuals(c, {"replica": 0, "residuals": _residual(c, torch.zeros(3))}),
                                        "float32 values; the checkpoint is damaged"),
    "fp8 residuals holding NaN": (lambda c: _add_residuals(c, {"replica": 0, "residuals": {
        k: v.fill_(float("nan")) for k, v in _residual(c).items()}}), "holds NaN or inf"),
    "fp8 residual file of the wrong structure": (lambda c: _add_residuals(c, {"residuals": _residual(c)}),
                                                 "is not an fp8 residual file"),
    "fp8 residual of no parameter": (lambda c: _add_residuals(c, {"replica": 0, "residuals": {"layers.99.w": torch.zeros(2)}}),
                                     "a residual for 'layers.99.w', a parameter not in this model"),
    "flipped bytes": (_flip_bytes, "stage-0.pt does not match its checksum"),
    "all-NaN parameters": (lambda c: _edit_stage(c, _nan_params), "holds NaN or inf"),
    "wrong-shape parameter": (lambda c: _edit_stage(c, _wrong_shape), "has shape (3, 3), this model needs"),
    "stage file of the wrong structure": (lambda c: _edit_stage(c, lambda b: {"weights": b["params"]}), "is not a stage file"),
    "a parameter missing": (lambda c: _edit_stage(c, lambda b: {**b, "params": dict(list(b["params"].items())[1:])}),
                            "is missing"),
    "an AdamW moment of the wrong shape": (lambda c: _edit_stage(c, _short_moment), "exp_avg has shape (1,"),
    "optimizer state of no parameter": (lambda c: _edit_stage(c, _stray_state),
                                        "optimizer state of 'layers.99.mlp.up.weight', a parameter not in this model"),
    "bad RNG file": (lambda c: (torch.save({"torch_cpu": torch.zeros(3)}, c / "rng.pt"), _restamp(c, "rng.pt")),
                     "rng.pt does not hold the host RNG state"),
    "negative step": (lambda c: _write_meta(c, {**_meta(c), "step": -5}), "step -5 is not a step count"),
    "step as a string": (lambda c: _write_meta(c, {**_meta(c), "step": "2"}), "step '2' is not a step count"),
    "no model key": (lambda c: _write_meta(c, {k: v for k, v in _meta(c).items() if k != "model"}), "has no model section"),
    "meta.json a list": (lambda c: _write_meta(c, [1, 2]), "holds a list, not an object"),
    "files: 7": (lambda c: _write_meta(c, {**_meta(c), "files": 7}), "files 7 is not a list"),
    "a file name leaving the directory": (lambda c: _write_meta(c, {**_meta(c), "files": ["../x.pt", "rng.pt"]}),
                                          "is not a list of stage-K.pt, replica-R-stage-K.pt, fp8-residuals-rank-N.pt and "
                                          "rng.pt names"),
    "checksums for other files": (lambda c: _write_meta(c, {**_meta(c), "checksums": {"rng.pt": "sha256:0"}}),
                                  "checksums do not name exactly its files"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_checkpoint_is_refused_before_training(case: str, trained: dict[str, Path], tmp_path: Path) -> None:
    damage, needle = CASES[case]
    ckpt = _copy(trained, tmp_path)
    damage(ckpt)
    with pytest.raises(ConfigError, match=None) as caught:
        prepare(str(trained["config"]), steps=4, resume=str(ckpt), run_dir=str(tmp_path / "run"))
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_the_intact_checkpoint_passes_the_same_checks(trained: dict[str, Path], tmp_path: Path) -> None:
    job = prepare(str(trained["config"]), steps=4, resume=str(_copy(trained, tmp_path)), run_dir=str(tmp_path / "run"))
    assert job.start == 2
    with_residuals = _copy(trained, tmp_path / "fp8")
    _add_residuals(with_residuals, {"replica": 0, "residuals": _residual(with_residuals)})
    assert prepare(str(trained["config"]), steps=4, resume=str(with_residuals), run_dir=str(tmp_path / "run2")).start == 2


def test_the_command_refuses_flipped_bytes_in_one_line_with_nothing_started(trained: dict[str, Path], tmp_path: Path) -> None:
    ckpt = _copy(trained, tmp_path)
    _flip_bytes(ckpt)
    result = run_hal("train", str(trained["config"]), "--steps", "4", "--resume", str(ckpt), "--run-dir", str(tmp_path / "run"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "does not match its checksum" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_without_checksums_resumes_with_one_warning_line(trained: dict[str, Path], tmp_path: Path) -> None:
    ckpt = _copy(trained, tmp_path)
    meta = _meta(ckpt)
    del meta["checksums"]  # as an older hal wrote it
    _write_meta(ckpt, meta)
    result = run_hal("train", str(trained["config"]), "--steps", "3", "--resume", str(ckpt), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "records no checksums" in line]
    assert len(said) == 1 and said[0].startswith(f"hal: warning: --resume {ckpt}: the checkpoint records no checksums")
    assert "UserWarning" not in result.stderr and "warnings.warn(" not in result.stderr
