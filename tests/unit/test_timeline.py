"""The timeline as data and as a picture, in-process: timer spans, the prediction, the document, the PNG, the CLI."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hal.backends.cpu import CpuBackend
from hal.cli.main import main
from hal.parallel.config.plan import parse_plan
from hal.parallel.config.replicas import ReplicatedPlan
from hal.parallel.config.topology import Topology
from hal.parallel.observe.phase_timer import PhaseTimer
from hal.parallel.observe.timeline import _shares, measured_costs, measured_document, plan_document, rank_record
from hal.parallel.observe.timeline_plot import missing, write_png
from hal.parallel.schedules import Action, Kind, Overlap, P2PBatch, get_schedule

PNG = b"\x89PNG\r\n\x1a\n"
TWO = {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
       "stages": [{"backend": "cpu", "devices": 1, "layers": 3}, {"backend": "cpu", "devices": 2, "layers": 1, "dp": 2}]}
SCHEDULES = {
    "gpipe": {**TWO, "schedule": "gpipe"},
    "1f1b": TWO,
    "zero-bubble": {**TWO, "schedule": "zero-bubble"},
    "interleaved-1f1b": {**TWO, "schedule": "interleaved-1f1b", "virtual_stages": 2, "stages": [
        {"backend": "cpu", "devices": 1, "layers": [2, 1]}, {"backend": "cpu", "devices": 1, "layers": [1, 2]}]},
    "interleaved-zero-bubble": {**TWO, "schedule": "interleaved-zero-bubble", "virtual_stages": 2, "stages": [
        {"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]},
}
CONFIG = """backend: cpu
model: {vocab_size: 256, hidden_size: 32, num_layers: 4, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 64, max_seq_len: 16}
parallel:
  schedule: 1f1b
  micro_batches: 4
  micro_batch_size: 2
  stages:
    - {backend: cpu, devices: 1, layers: 3}
    - {backend: cpu, devices: 1, layers: 1}
train: {steps: 2, data: corpus}
"""


# --- the timer's labelled spans -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["host", "events"])
def test_spans_are_the_labelled_intervals_after_the_origin_in_start_order(mode: str) -> None:
    timer = PhaseTimer(CpuBackend(), mode)
    before = timer.mark()
    time.sleep(0.002)
    origin = timer.mark()
    f0 = Action(Kind.FORWARD, 0)
    with timer.phase("compute", f0):
        time.sleep(0.003)
    with timer.phase("p2p", P2PBatch((Action(Kind.SEND_FORWARD, 0),))):
        pass
    with timer.phase("optimizer"):  # no label: counted in totals, not a span
        pass
    timer.add("schedule", origin, timer.mark(), "schedule")
    timer.add("step", before, timer.mark())
    spans = timer.spans(origin)
    assert [s.phase for s in spans] == ["schedule", "compute", "p2p"]  # by start: the schedule opened at the origin
    assert spans[0].start == 0.0 and spans[1].label == f0 and isinstance(spans[2].label, P2PBatch)
    compute = spans[1]
    assert 0.0 <= compute.start <= compute.end and compute.end - compute.start >= 0.003
    assert timer.totals()["compute"] == pytest.approx(compute.end - compute.start, abs=1e-9)
    assert len(timer.spans(origin, labelled_only=False)) == 5 and timer.spans(origin, labelled_only=False)[0].start < 0


# --- the prediction ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_predicted_timeline_runs_each_stage_program_in_order(name: str) -> None:
    plan = parse_plan(SCHEDULES[name])
    doc = plan_document(plan)
    S, M, V = plan.num_stages, plan.micro_batches, plan.virtual_stages
    schedule = plan.schedule
    for s in range(S):
        program = schedule.program(S, M, s, V) if V > 1 else schedule.program(S, M, s)
        want = [(a.kind.value, a.micro_batch, a.chunk) for a in program if not isinstance(a, P2PBatch)]
        spans = [sp for sp in doc["predicted"]["spans"] if sp["stage"] == s]
        assert [(sp["kind"], sp["mb"], sp["chunk"]) for sp in spans] == want
        _assert_in_sequence(spans)
    assert doc["unit"] == "layer" and doc["ranks"] == [] and len(doc["predicted"]["bubble"]) == S


def _assert_in_sequence(spans: list[dict[str, Any]]) -> None:
    for a, b in zip(spans, spans[1:]):
        assert a["end"] <= b["start"] + 1e-12, (a, b)


# --- the measured document ------------------------------------------------------------------------------------


def _rank(rank: int, stage: int, actions: list[tuple[str, int, float, float]], clock: float) -> dict[str, Any]:
    """A rank record built from (kind, micro-batch, start, end): compute actions and a P2P wait."""
    spans = [("schedule", "schedule", 0.0, max(a[3] for a in actions))]
    for kind, m, start, end in actions:
        label = P2PBatch((Action(Kind.RECV_FORWARD, m),)) if kind == "p2p" else Action(Kind(kind), m)
        spans.append(("p2p" if kind == "p2p" else "compute", label, start, end))
    return rank_record(rank, stage, 0, 0, spans, host="one", clock_at_origin=clock)


def test_ranks_sharing_a_host_are_placed_by_its_clock_and_costs_are_the_measured_means() -> None:
    plan = parse_plan({"schedule": "gpipe", "micro_batches": 2, "micro_batch_size": 1,
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 1}, {"backend": "cpu", "devices": 1, "layers": 1}]})
    # stage 1's clock origin is 1.0 s later than stage 0's: its times move right by 1.0
    first = _rank(0, 0, [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 1, 4.0, 7.0), ("B", 0, 7.0, 9.0)], 10.0)
    second = _rank(1, 1, [("p2p", 0, 0.0, 0.5), ("F", 0, 0.5, 1.5), ("F", 1, 1.5, 2.5), ("B", 1, 2.5, 3.5),
                          ("B", 0, 3.5, 4.5)], 11.0)
    doc = measured_document(plan, Topology.from_plan(plan), [second, first], step=3)
    assert doc["aligned"] == "host clock" and [r["rank"] for r in doc["ranks"]] == [0, 1]
    late = doc["ranks"][1]
    assert late["schedule"] == [1.0, 5.5] and late["spans"][0]["start"] == 1.0 and late["spans"][0]["kind"] == "p2p"
    assert doc["makespan"] == 9.0
    assert doc["ranks"][1]["compute"] == pytest.approx(4.0 / 9.0) and doc["ranks"][1]["p2p"] == pytest.approx(0.5 / 9.0)
    costs = measured_costs(doc)
    assert costs["forward"] == [1.0, 1.0] and costs["backward"] == [2.5, 1.0]
    predicted = doc["predicted"]
    assert predicted["forward"] == [1.0, 1.0] and predicted["makespan"] == pytest.approx(2 + 1 + 1 + 2.5 + 2.5)  # F0 F1 | F1 B0 on stage 1 | B0 B1
    # another host: no shared clock, each rank's origin is the barrier
    apart = measured_document(plan, Topology.from_plan(plan), [first, {**second, "host": "two"}], step=3)
    assert apart["aligned"] == "barrier" and apart["ranks"][1]["schedule"] == [0.0, 4.5]


def test_a_dualpipev_pair_is_one_compute_span_under_its_forward() -> None:
    """A pair run at once (``Overlap``) is one span, kind P, counted as compute, named by both of its actions."""
    from hal.parallel.observe.timeline import span_record

    pair = Overlap(Action(Kind.FORWARD, 3, 0), Action(Kind.BACKWARD, 1, 1))
    record = span_record("compute", pair, 1.0, 2.5)
    assert (record["kind"], record["mb"], record["chunk"], record["what"]) == ("P", 3, 0, "F3|B1c1")
    assert _shares([record], 3.0)["compute"] == pytest.approx(0.5)


# --- the picture --------------------------------------------------------------------------------------------------


def _is_png(path: Path) -> tuple[int, ...]:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG
    return matplotlib.image.imread(str(path)).shape


def test_the_picture_is_a_png_with_both_panels(tmp_path: Path) -> None:
    plan = parse_plan(SCHEDULES["interleaved-zero-bubble"])
    doc = plan_document(plan)
    alone = _is_png(write_png(doc, tmp_path / "plan.png"))
    # a measured document: the prediction's own spans replayed as two ranks' measurements
    ranks = []
    for stage in range(2):
        spans = [("schedule", "schedule", 0.0, doc["predicted"]["makespan"])]
        spans += [("compute", Action(Kind(s["kind"]), s["mb"], s["chunk"]), s["start"], s["end"])
                  for s in doc["predicted"]["spans"] if s["stage"] == stage]
        ranks.append(rank_record(stage, stage, 0, 0, spans, host="h", clock_at_origin=0.0))
    measured = measured_document(plan, Topology.from_plan(plan), ranks, step=1)
    both = _is_png(write_png(measured, tmp_path / "deep" / "timeline.png"))
    assert both[0] > alone[0] and both[1] == alone[1]  # the measured panel adds rows below, same width


def test_the_planned_panel_adds_the_planners_rows_above(tmp_path: Path) -> None:
    doc = plan_document(parse_plan(TWO))
    without = _is_png(write_png(doc, tmp_path / "predicted.png"))
    doc["planned"] = {**doc["predicted"], "assumes": "the planner's cost model", "step_s": 1.0}
    planned = _is_png(write_png(doc, tmp_path / "planned.png"))
    assert planned[0] > without[0] and planned[1] == without[1]  # a panel of one row a stage more, same width


def test_a_planned_only_document_draws_and_reads_back(tmp_path: Path) -> None:
    from hal.parallel.observe.timeline import check_document, planned_document

    plan = parse_plan(TWO)
    doc = planned_document(plan, {**plan_document(plan)["predicted"], "assumes": "the planner's", "step_s": 1.0})
    assert "predicted" not in doc and check_document(json.loads(json.dumps(doc)), "t.json") == doc
    assert _is_png(write_png(doc, tmp_path / "planned.png"))[0] > 100


def test_hal_plan_timeline_writes_the_predicted_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "two.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    out = tmp_path / "out" / "plan.png"
    assert main(["plan", "--config", str(config), "--timeline", str(out)]) == 0
    assert f"predicted timeline {out}" in capsys.readouterr().err
    assert _is_png(out)[0] > 100


def test_without_matplotlib_plan_says_so_in_one_line_and_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "two.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert "pip install 'hetero-hal[report]'" in (missing() or "")
    assert main(["plan", "--config", str(config), "--timeline", str(tmp_path / "plan.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hal: error: --timeline: matplotlib is not installed")
    assert not (tmp_path / "plan.png").exists()


def test_without_matplotlib_a_profiled_train_keeps_the_spans_and_says_why_no_picture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hal.cli.train import _draw_timeline

    plan = parse_plan(TWO)
    (tmp_path / "timeline.json").write_text(json.dumps(plan_document(plan)), encoding="utf-8")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    job = SimpleNamespace(run_dir=tmp_path, planned=None, plan=plan, replicas=ReplicatedPlan.single(plan),
                          timeline_files=lambda: ["timeline.json"])
    _draw_timeline(job)  # no exception: only the picture is missing
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "timeline.png not drawn: matplotlib is not installed" in err
    assert not (tmp_path / "timeline.png").exists()


def test_a_bad_timeline_path_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "two.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    assert main(["plan", str(config), "--timeline", str(tmp_path / "plan.svg")]) == 2
    assert capsys.readouterr().err.startswith("hal: error: --timeline")
    assert main(["plan", str(config), "--timeline", str(tmp_path)]) == 2  # a directory, not a .png file


def test_pairs_run_at_once_are_priced_at_their_measured_share() -> None:
    """A stage whose pairs took half their forward + backward in turn: measured_costs says 0.5, and the simulator
    played with it runs a DualPipeV step shorter than with its pairs in turn (1.0, what it played before)."""
    from hal.parallel.schedules import simulate

    plan = parse_plan({"schedule": "dualpipev", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 1,
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]})
    pair = Overlap(Action(Kind.FORWARD, 3, 0), Action(Kind.BACKWARD, 1, 1))
    spans = [("schedule", "schedule", 0.0, 20.0), ("compute", Action(Kind.FORWARD, 0, 0), 0.0, 1.0),
             ("compute", Action(Kind.FORWARD, 0, 1), 1.0, 2.0), ("compute", Action(Kind.BACKWARD, 0, 0), 2.0, 4.0),
             ("compute", Action(Kind.BACKWARD, 0, 1), 4.0, 6.0), ("compute", pair, 6.0, 7.5)]
    ranks = [rank_record(k, k, 0, 0, spans, host="one", clock_at_origin=0.0) for k in range(2)]
    doc = measured_document(plan, Topology.from_plan(plan), ranks, step=1)
    costs = measured_costs(doc)
    assert costs["pair_share"] == [pytest.approx(0.5), pytest.approx(0.5)]  # 1.5 of F (1) + B (2)
    assert doc["predicted"]["pair_share"] == costs["pair_share"] and "pairs at their measured share" in doc["predicted"]["assumes"]
    dpv = get_schedule("dualpipev")
    at_once = simulate(dpv, 2, 4, virtual_stages=2, pair_share=0.5).makespan
    assert at_once < simulate(dpv, 2, 4, virtual_stages=2, pair_share=1.0).makespan == simulate(dpv, 2, 4, virtual_stages=2).makespan
    with pytest.raises(ValueError, match="pair_share"):
        simulate(dpv, 2, 4, virtual_stages=2, pair_share=0.0)
