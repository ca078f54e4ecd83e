"""What a stop in the middle of a checkpoint write leaves behind, undone by ``hal train`` before and after its ranks run
(issue 56, 7: a ``.tmp-step-N`` folder was left for good)."""
from __future__ import annotations

from pathlib import Path

from hal.parallel.state.checkpoint import latest_written, tidy


def _step(root: Path, name: str, content: str = "{}") -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "meta.json").write_text(content)
    return root / name


def test_a_write_cut_short_is_removed_and_the_last_complete_checkpoint_stands(tmp_path: Path) -> None:
    done = _step(tmp_path, "step-000002")
    (tmp_path / "latest").write_text("step-000002\n")
    _step(tmp_path, ".tmp-step-000004")
    lines = tidy(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002"]
    assert lines == [f"removed {tmp_path / '.tmp-step-000004'}, a checkpoint write that was cut short"]
    assert latest_written(tmp_path) == done


def test_a_replacement_cut_short_puts_the_old_copy_back_and_a_finished_one_drops_it(tmp_path: Path) -> None:
    _step(tmp_path, ".old-step-000002", '{"step": 2}')  # renamed aside; the new copy never arrived
    (tmp_path / "latest").write_text("step-000002\n")
    _step(tmp_path, "step-000003")
    _step(tmp_path, ".old-step-000003")  # the new step-000003 arrived: the aside copy is stale
    lines = tidy(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]
    assert (tmp_path / "step-000002" / "meta.json").read_text() == '{"step": 2}'
    assert len(lines) == 2 and latest_written(tmp_path) == tmp_path / "step-000002"


def test_nothing_to_tidy_says_nothing(tmp_path: Path) -> None:
    assert tidy(tmp_path / "absent") == [] and tidy(None) == [] and tidy(tmp_path) == []
    assert latest_written(tmp_path) is None and latest_written(None) is None
