"""The planner's prediction a written plan keeps (``planned:``): written, read back, checked, replayed, drawn."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from hal.errors import ConfigError
from hal.parallel.config.plan import parse_plan
from hal.parallel.config.planned import parallel_digest, read_planned
from hal.parallel.config.run import load_run_config
from hal.parallel.observe.timeline import planned_timeline
from hal.parallel.planner.run_search import write_plan
from hal.parallel.planner.search import Search

from .test_planner_cost import MODEL, _cost, _profile

GROUPS = [{"backend": "cpu", "device": "cpu-generic", "count": 2, "cores": 8},
          {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2, "node": 1}]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, object]:
    """``_written`` once for the tests that only read it (a search takes seconds on a busy core)."""
    return _written(tmp_path_factory.mktemp("written"))


def _written(tmp_path: Path) -> tuple[Path, dict, object]:
    """A plan written by write_plan from a search over a cpu + H100 cluster (every type used: two stages)."""
    cost = _cost(GROUPS, cpu_generic=_profile("cpu-generic", "cpu", f=1e-2, b=2e-2))
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump({"precision": "fp32", "model": MODEL.to_dict(),
                                      "parallel": {"micro_batches": 8, "micro_batch_size": 1,
                                                   "stages": [{"backend": "cpu", "devices": 1, "layers": 8}]},
                                      "train": {"steps": 2}, "cluster": {"groups": GROUPS}}))
    run = load_run_config(source, check_backends=False)
    result = Search(cost, run.plan, use_all_types=True).run(top=1).results[0]
    out = tmp_path / "plan.yaml"
    write_plan(run, result, out, cost, "p.json")
    return out, yaml.safe_load(out.read_text()), result


def test_a_written_plan_keeps_its_prediction_and_replays_it(written: tuple[Path, dict, object]) -> None:
    out, data, result = written
    section = data["planned"]
    assert section["by"] == "hal plan --search" and section["profile"] == "profile p.json"
    assert section["step_s"] == pytest.approx(result.prediction.step_s)
    run = load_run_config(out, check_backends=False)
    assert run.planned is not None and run.planned.matches and run.plan.num_stages >= 2
    replay = planned_timeline(run.planned, run.plan)
    # the same simulator inputs give the same schedule the cost model predicted, every action of the plan drawn
    assert replay["makespan"] == pytest.approx(result.prediction.schedule_s)
    assert replay["bubble"] == pytest.approx(list(result.prediction.bubble))
    assert len(replay["spans"]) == sum(1 for s in replay["spans"] if s["kind"] in "FBIW") > 0
    assert replay["step_s"] == pytest.approx(result.prediction.step_s)


def test_an_edited_plan_keeps_its_section_but_no_longer_matches_it(written: tuple[Path, dict, object],
                                                                   tmp_path: Path) -> None:
    data, out = copy.deepcopy(written[1]), tmp_path / "plan.yaml"
    data["parallel"]["fused_head"] = not data["parallel"]["fused_head"]
    out.write_text(yaml.safe_dump(data))
    run = load_run_config(out, check_backends=False)
    assert run.planned is not None and not run.planned.matches
    assert read_planned(None, run.plan, "x") is None  # no section: nothing planned


@pytest.mark.parametrize("edit, says", [
    (lambda s: "not a mapping", "planned: must be a mapping"),
    (lambda s: {**s, "simulate": [1, 2]}, "planned.simulate: missing or not a mapping"),
    (lambda s: {**s, "simulate": {**s["simulate"], "forward_s": [0.1]}}, "planned.simulate.forward_s: 1 value(s) for 2 stage(s)"),
    (lambda s: {**s, "simulate": {**s["simulate"], "backward_s": [-1.0, 0.1]}}, "planned.simulate.backward_s: a list of seconds"),
    (lambda s: {**s, "simulate": {k: v for k, v in s["simulate"].items() if k != "forward_s"}}, "planned.simulate.forward_s: missing"),
    (lambda s: {**s, "simulate": {**s["simulate"], "speedup": 2}}, "planned.simulate: unknown key(s) speedup"),
    (lambda s: {**s, "simulate": {**s["simulate"], "p2p_s": "fast"}}, "planned.simulate.p2p_s: seconds"),
    (lambda s: {**s, "step_s": float("nan")}, "planned.step_s: seconds"),
    (lambda s: {**s, "simulate": {**s["simulate"], "virtual_stages": 3}}, "planned.simulate.virtual_stages: 3, the plan has"),
    (lambda s: {**s, "estimated": "all of it"}, "planned.estimated: a list"),
    (lambda s: {**s, "simulate": {**s["simulate"], "chunk_share": [[0.5, 0.5]]}}, "planned.simulate.chunk_share: 2 row(s) of 1"),
    # what used to pass the check and break the replay or the drawing after a run
    (lambda s: {**s, "simulate": {**s["simulate"], "forward_s": [1e308, 0.1]}}, "planned.simulate.forward_s: a list of seconds"),
    (lambda s: {**s, "step_s": 10 ** 400}, "planned.step_s: seconds"),
    (lambda s: {**s, "simulate": {**s["simulate"], "host_forward_s": [10 ** 400, 0.1]}}, "planned.simulate.host_forward_s"),
    (lambda s: {**s, "simulate": {**s["simulate"], "virtual_stages": 1.0}}, "planned.simulate.virtual_stages: 1.0"),
    (lambda s: {**s, "simulate": {**s["simulate"], "virtual_stages": True}}, "planned.simulate.virtual_stages: True"),
    (lambda s: {**s, "simulate": {**s["simulate"], "chunk_share": [[0.0], [1.0]]}}, "each row summing to 1"),
    (lambda s: {**s, "simulate": {**s["simulate"], "chunk_share": [[12.0], [1.0]]}}, "each row summing to 1"),
    (lambda s: {**s, "speedup": 2}, "planned: unknown key(s) speedup"),
    (lambda s: {**s, "schedule_s": "x"}, "planned.schedule_s: seconds"),
    (lambda s: {**s, "profile": "p" * 5000}, "planned.profile and planned.by: text of at most 1024"),
    (lambda s: {**s, "estimated": ["x" * 5000]}, "planned.estimated: a list"),
])
def test_a_damaged_section_is_one_line_naming_the_key(written: tuple[Path, dict, object], edit, says) -> None:
    _, data, result = written
    assert result.plan.num_stages == 2
    section = edit(copy.deepcopy(data["planned"]))
    with pytest.raises(ConfigError) as err:
        read_planned(section, result.plan, "plan.yaml")
    message = str(err.value)
    assert message.startswith("plan.yaml: ") and says in message and "\n" not in message
    assert message.endswith("write the plan again with hal plan --search --write, or delete the planned: section")


def test_the_digest_follows_the_parallel_section() -> None:
    two = {"micro_batches": 4, "micro_batch_size": 2, "stages": [{"backend": "cpu", "devices": 1, "layers": 2}] * 2}
    a, b = parse_plan(two), parse_plan({**two, "micro_batches": 8})
    assert parallel_digest(a) == parallel_digest(parse_plan(a.to_dict())) != parallel_digest(b)
