"""``train.tensorboard: true``: the step lines' scalars as a TensorBoard event file, read back and compared
with the JSON lines; and without the package, one line before any rank starts."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from hal.parallel.observe.tensorboard import TAGS

from ..conftest import REPO, run_hal

TIMEOUT = 240


def _config(tmp_path: Path) -> Path:
    """Two 1-device stages, stage 1 in fp16 (a loss scale), grad_clip, eval every 2 steps on a held-out part."""
    data = tmp_path / "bytes.bin"  # the shipped corpus as a plain uint16 token file: ids 0..255
    np.frombuffer((REPO / "examples/data/corpus.txt").read_bytes(), dtype=np.uint8).astype("<u2").tofile(data)
    raw = {
        "backend": "cpu", "precision": "fp32", "fallback": "allow",
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "ffn_hidden_size": 64, "max_seq_len": 16},
        "parallel": {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
                     "stages": [{"backend": "cpu", "devices": 1, "layers": 1},
                                {"backend": "cpu", "devices": 1, "layers": 1, "precision": "fp16-mixed"}]},
        "train": {"steps": 4, "lr": 3e-3, "warmup_steps": 1, "lr_schedule": "cosine", "grad_clip": 1.0,
                  "data": str(data), "validation": 0.1, "eval_every": 2, "tensorboard": True},
    }
    path = tmp_path / "board.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_event_file_holds_every_step_lines_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    result = run_hal("train", str(_config(tmp_path)), "--run-dir", str(run_dir), timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    want: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name, tag in TAGS.items():
            if isinstance(record.get(name), (int, float)):
                want.setdefault(tag, []).append((record["step"], float(record[name])))
    # every kind of scalar is there: the loop's, the loss scale (fp16 stage), the evaluation (steps 2 and 4 only)
    assert set(want) == set(TAGS.values()), sorted(want)
    assert [step for step, _ in want["eval/loss"]] == [2, 4]
    got = _scalars(run_dir / "tensorboard")
    assert set(got) == set(want)
    for tag, points in want.items():
        assert [step for step, _ in got[tag]] == [step for step, _ in points], tag
        for (_, value), (_, expected) in zip(got[tag], points):  # event files store float32
            assert math.isclose(value, expected, rel_tol=1e-6), (tag, value, expected)
    assert len(list((run_dir / "tensorboard").iterdir())) == 1  # one event file, from the writer rank only


def test_asking_for_it_without_the_package_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    (blocker / "tensorboard").mkdir(parents=True)
    (blocker / "tensorboard" / "__init__.py").write_text("raise ImportError('tensorboard is not installed here')\n")
    config = _config(tmp_path)
    for args in (["train", str(config), "--run-dir", str(tmp_path / "run")], ["plan", str(config)]):
        result = run_hal(*args, env={"PYTHONPATH": f"{blocker}:{REPO}"})
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hal: error: "), result.stderr
        assert "train.tensorboard" in lines[0] and "pip install 'hetero-hal[tensorboard]'" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_only_numbers_are_written(tmp_path: Path) -> None:
    """A null grad_norm (a skipped step) or a missing key is left out, not written as 0."""
    pytest.importorskip("tensorboard")
    from hal.parallel.observe.tensorboard import TensorBoardLog

    board = TensorBoardLog(tmp_path / "tb")
    board.write({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "skipped": True})
    board.write({"step": 2, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5})
    board.close()
    got: dict[str, Any] = _scalars(tmp_path / "tb")
    assert got == {"train/loss": [(1, 2.5), (2, 2.0)], "train/lr": [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))],
                   "train/grad_norm": [(2, 0.5)]}
