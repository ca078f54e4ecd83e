"""The cost model against the simulator's closed forms, its monotonicity, and the search's plans (valid, balanced, what-if)."""
from __future__ import annotations

import dataclasses
import time

import pytest

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan, validate_plan
from hal.parallel.planner.cluster import parse_cluster, resolve
from hal.parallel.planner.cost import CostModel, Placement
from hal.parallel.planner.device_profile import DeviceProfile, LayerPoint, PerToken, Profile
from hal.parallel.planner.make_profile import make_profile
from hal.parallel.planner.run_search import left_out_note
from hal.parallel.planner.search import Search, balance

MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, max_seq_len=32)
FAST = {"intra_node_gbps": 1e5, "intra_node_latency_us": 0}  # the fastest link a cluster may declare


def _profile(device: str, backend: str, f: float = 1e-3, b: float = 2e-3, ends: float = 0.0) -> DeviceProfile:
    """Layer time proportional to rows (no fixed part); recompute adds one forward to the backward."""
    points = tuple(LayerPoint(1, r, 32, rc, f * r, (b + (f if rc else 0)) * r, (4 * 32 * 64 if rc else 100_000) * r)
                   for rc in (False, True) for r in (1, 2, 4))
    return DeviceProfile(device, backend, "measured", "synthetic", points, PerToken(ends, ends, 0), PerToken(ends, ends, 0), 0.0)


def _cost(groups: list[dict], links: dict | None = None, **profiles: DeviceProfile) -> CostModel:
    cluster = resolve(parse_cluster({"groups": groups, "links": links or FAST}))
    profile = Profile(MODEL.to_dict(), "fp32", {t.device: profiles.get(t.device.replace("-", "_"), _profile(t.device, t.backend))
                                                for t in cluster.types})
    return CostModel(cluster, profile, MODEL, 32)


H100 = {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 4}


def _plan(S: int, M: int, schedule: str = "1f1b", **stage: object) -> ParallelPlan:
    return ParallelPlan(tuple(StagePlan("cuda", 1, MODEL.num_layers // S, **stage) for _ in range(S)), schedule, M, 1)


def test_equal_stages_give_the_1f1b_closed_form() -> None:
    cost = _cost([H100])
    S, M = 4, 8
    plan = _plan(S, M)
    pred = cost.predict(plan, Placement.pack(plan, (cost.cluster.types[0],) * S))
    stage = 2 * (1e-3 + 2e-3)  # two layers, forward + backward, one row
    assert pred.step_s == pytest.approx((M + S - 1) * stage, rel=1e-6)  # no p2p, optimizer or sync in this profile
    assert pred.bubble[0] == pytest.approx((S - 1) / (M + S - 1), rel=1e-6)
    assert pred.in_flight == (4, 3, 2, 1) and pred.tokens_per_s == pytest.approx(M * 32 / pred.step_s)


def test_costs_move_the_right_way() -> None:
    cost = _cost([H100])

    def predict(plan: ParallelPlan, c: CostModel = cost):
        return c.predict(plan, Placement.pack(plan, (c.cluster.types[0],) * plan.num_stages))

    base = predict(_plan(4, 8))
    rc = predict(_plan(4, 8, checkpoint=True))
    assert rc.step_s > base.step_s and rc.stages[0].activation_bytes < base.stages[0].activation_bytes
    assert predict(_plan(4, 16)).step_s > base.step_s and predict(_plan(4, 16)).bubble_overall < base.bubble_overall
    assert predict(_plan(4, 8, "zero-bubble")).step_s < base.step_s
    slow = _cost([H100], {"intra_node_gbps": 0.001, "intra_node_latency_us": 1000})
    assert predict(_plan(4, 8), slow).step_s > base.step_s + 2 * 3 * 1e-3  # at least the boundary latencies
    dp = ParallelPlan((StagePlan("cuda", 2, 4, 1, 2), StagePlan("cuda", 2, 4, 1, 2)), "1f1b", 4, 2)
    zero = dataclasses.replace(dp, zero1=True)
    assert predict(zero).stages[0].weights_bytes < predict(dp).stages[0].weights_bytes


def test_balance_gives_the_faster_stage_more_layers() -> None:
    assert balance([1.0, 3.0], [0.0, 0.0], 8) == [6, 2]
    assert balance([1.0, 1.0], [0.0, 4.0], 8) == [6, 2]  # the head's cost counts
    assert balance([1.0, 1.0], [0.0, 0.0], 3, V=2) is None  # each stage needs a layer a chunk


def test_search_plans_are_valid_and_use_the_fast_device() -> None:
    cost = _cost([{"backend": "cpu", "device": "cpu-generic", "count": 2, "cores": 8},
                  {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2, "node": 1}],
                 cpu_generic=_profile("cpu-generic", "cpu", f=1e-2, b=2e-2))
    base = ParallelPlan((StagePlan("cpu", 1, 8),), "1f1b", 8, 1)
    report = Search(cost, base).run(top=3)
    assert report.results and report.considered >= report.confirmed
    steps = [r.prediction.step_s for r in report.results]
    assert steps == sorted(steps)
    for r in report.results:
        validate_plan(r.plan, MODEL, world_size=r.plan.world_size, check_backends=False, seq_len=32, single_host=False)
        assert r.plan.global_batch_size == 8
    best = report.results[0]
    layers = {}
    for stage, kind in zip(best.plan.stages, best.placement.kinds):
        layers[kind.device] = layers.get(kind.device, 0) + stage.layer_count
    assert layers.get("nvidia-h100-sxm", 0) > layers.get("cpu-generic", 0)  # 10× faster: most layers
    # a cpu 100× slower is best left out; asked to use every type, the search keeps both and gives the cpu least
    slow = _cost([{"backend": "cpu", "device": "cpu-generic", "count": 2, "cores": 8},
                  {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2, "node": 1}],
                 cpu_generic=_profile("cpu-generic", "cpu", f=1e-1, b=2e-1))
    alone = Search(slow, base).run(top=1)
    assert {k.device for k in alone.results[0].placement.kinds} == {"nvidia-h100-sxm"}
    assert left_out_note(alone, slow.cluster) == ("plan #1 leaves out 2× cpu-generic: the plans giving it stages ranked "
                                                  "slower (--use-all-types: every type holds a stage)")
    both = Search(slow, base, use_all_types=True).run(top=3)
    assert left_out_note(both, slow.cluster) is None  # every type holds a stage: nothing to say
    for r in both.results:
        assert {k.device for k in r.placement.kinds} == {"nvidia-h100-sxm", "cpu-generic"}
        per = {}
        for stage, kind in zip(r.plan.stages, r.placement.kinds):
            per[kind.device] = per.get(kind.device, 0) + stage.layer_count
        assert per["nvidia-h100-sxm"] > per["cpu-generic"]


def test_a_compiled_config_is_searched_with_every_schedule_and_each_pick_validates() -> None:
    """Compiled layers run under the split backward too (their linears eager between the graphs), so a compiled
    config searches the zero-bubble family beside the rest, and every plan it returns passes the plan check."""
    from hal.parallel.config.plan import validate_plan

    cost = _cost([{"backend": "cuda", "device": "nvidia-h100-sxm", "count": 4}])
    plain = ParallelPlan((StagePlan("cuda", 1, 8),), "1f1b", 8, 1)
    compiled = dataclasses.replace(plain, compile=True)
    report = Search(cost, compiled).run(top=50)
    assert report.results and all(r.plan.compile for r in report.results)
    assert {r.plan.schedule.name for r in report.results} & {"zero-bubble", "interleaved-zero-bubble", "zbv"}
    for r in report.results:
        validate_plan(r.plan, cost.model, world_size=None, check_backends=False)
        # the catalog-estimated profile has no measured split program: a split plan's prediction says how it was priced
        assert any("priced with whole layers" in e for e in r.prediction.estimated) == r.plan.schedule.splits_backward
    # the profile timed its layers eager: every compiled plan's prediction says so
    assert all(any("compile their layers, timed eager" in e for e in r.prediction.estimated) for r in report.results)
    assert not any("timed eager" in e for r in Search(cost, plain).run(top=3).results for e in r.prediction.estimated)


def test_what_if_ascend_and_h100_from_catalog_figures() -> None:
    model = ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                        ffn_hidden_size=8192, max_seq_len=2048)
    cluster = resolve(parse_cluster({"groups": [
        {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 8, "node": 0},
        {"backend": "ascend", "device": "huawei-ascend-910b", "count": 8, "node": 1,  # the catalog has no figures:
         "peak_tflops": {"bf16": 313}, "memory_gb": 64, "memory_bandwidth_gbps": 1600}]}))  # community figures, declared
    profile = make_profile(cluster, model, "bf16-mixed", 2048, links=False)  # neither is here: both estimated
    assert sorted(profile.estimated()) == ["huawei-ascend-910b", "nvidia-h100-sxm"]
    cost = CostModel(cluster, profile, model, 2048)
    started = time.monotonic()
    report = Search(cost, ParallelPlan((StagePlan("cuda", 1, 16),), "1f1b", 64, 1)).run(top=3)
    assert time.monotonic() - started < 30
    best = report.results[0].prediction
    assert any("nvidia-h100-sxm compute (estimated" in e for e in best.estimated)
    assert best.fits and best.tokens_per_s > 0
    mixed = [r for r in report.results if len({k.backend for k in r.placement.kinds}) > 1]
    for r in mixed:
        assert any("bridge between backends" in e for e in r.prediction.estimated)


def test_recompute_times_follow_from_the_plain_layer_and_keep_their_measured_memory() -> None:
    """A checkpointed layer: the plain forward, then a backward that re-runs it; noisy recompute points
    (here 3x the plain layer) do not reach the times, only their activation bytes are used."""
    plain = tuple(LayerPoint(1, r, 32, False, 1e-3 * r, 2e-3 * r, 100_000 * r) for r in (1, 2, 4))
    noisy = tuple(LayerPoint(1, r, 32, True, 3e-3 * r, 9e-3 * r, 8_000 * r) for r in (1, 2, 4))
    prof = DeviceProfile("cpu-generic", "cpu", "measured", "synthetic", plain + noisy, PerToken(0, 0, 0), PerToken(0, 0, 0), 0.0)
    f, b, act = prof.layer(1, 2, 32, True)
    assert f == pytest.approx(2e-3) and b == pytest.approx(2e-3 + 4e-3) and act == pytest.approx(16_000)
    assert prof.layer(1, 2, 32, False) == pytest.approx((2e-3, 4e-3, 200_000))
    only_recompute = DeviceProfile("cpu-generic", "cpu", "measured", "synthetic", noisy, PerToken(0, 0, 0), PerToken(0, 0, 0), 0.0)
    assert only_recompute.layer(1, 2, 32, True) == pytest.approx((6e-3, 18e-3, 16_000))  # nothing to derive from: measured


def _clocked(host: float) -> DeviceProfile:
    """An accelerator profile with both clocks: the device 1 + 2 ms a layer row, the host ``host`` s per call."""
    points = tuple(LayerPoint(1, r, 32, False, max(host, 1e-3 * r), max(host, 2e-3 * r), 100_000 * r,
                              host, host, 1e-3 * r, 2e-3 * r) for r in (1, 2, 4))
    return DeviceProfile("nvidia-h100-sxm", "cuda", "measured", "synthetic", points, PerToken(0, 0, 0), PerToken(0, 0, 0), 0.0)


@pytest.mark.parametrize("host,host_bound", [(1e-4, False), (5e-3, True)])
def test_a_host_slower_than_its_device_bounds_the_step_by_its_enqueue_time(host: float, host_bound: bool) -> None:
    """The device runs the schedule (its dependencies, its bubble); each host enqueues its whole program without
    waiting, so the step is the longer of the two — 1F1B's closed form on device times, or M × the host's time."""
    cost = _cost([H100], nvidia_h100_sxm=_clocked(host))
    S, M = 4, 8
    plan = _plan(S, M)
    pred = cost.predict(plan, Placement.pack(plan, (cost.cluster.types[0],) * S))
    device = (M + S - 1) * 2 * (1e-3 + 2e-3)  # two layers a stage, one row
    enqueue = M * 2 * (host + host)
    if host_bound:  # the hosts set the pace; what the devices still run after them (the drain) comes on top
        assert enqueue < pred.step_s <= enqueue + S * 2 * (1e-3 + 2e-3) + 1e-9
    else:
        assert pred.step_s == pytest.approx(device, rel=1e-6)
    assert pred.bound.startswith("host of stage") == host_bound, pred.bound
    rc = cost.predict(_plan(S, M, checkpoint=True), Placement.pack(plan, (cost.cluster.types[0],) * S))
    assert rc.step_s > pred.step_s  # recompute: the forward again, on both clocks


def test_engine_host_work_counts_per_compute_action() -> None:
    """A calibrated host cost per compute action lengthens a host-bound stage by actions × that cost; interleaving
    (twice the actions, each half as long) costs its host more."""
    host = 5e-3
    plain = _cost([H100], nvidia_h100_sxm=_clocked(host))
    cost = _cost([H100], nvidia_h100_sxm=dataclasses.replace(_clocked(host), action_host_s=1e-3))
    S, M = 4, 8
    plan = _plan(S, M)
    place = Placement.pack(plan, (cost.cluster.types[0],) * S)
    before, after = plain.predict(plan, place), cost.predict(plan, place)
    assert after.schedule_s == pytest.approx(before.schedule_s + 2 * M * 1e-3, rel=1e-6)  # 2M actions on the busiest host
    il = _plan(S, M, "interleaved-1f1b")
    il = dataclasses.replace(il, virtual_stages=2, stages=tuple(dataclasses.replace(st, layers=(1, 1)) for st in il.stages))
    gap = cost.predict(il, place).schedule_s - plain.predict(il, place).schedule_s
    assert gap == pytest.approx(4 * M * 1e-3, rel=1e-6)


def test_tp_points_measured_with_their_group_replace_the_ring_formula() -> None:
    """Measured tp-2 points (host and device clocks included) are read as they are: no tp 1 split, no ring all-reduce."""
    tp1 = _clocked(1e-4)
    tp2 = tuple(dataclasses.replace(p, tp=2, sp=True, forward_s=7e-3 * p.rows, backward_s=9e-3 * p.rows, host_forward_s=3e-3,
                                    host_backward_s=4e-3, device_forward_s=7e-3 * p.rows, device_backward_s=9e-3 * p.rows)
                for p in tp1.layers)
    prof = dataclasses.replace(tp1, layers=tp1.layers + tp2)
    assert prof.clocks(2, 2, 32, False, sp=True) == pytest.approx((3e-3, 4e-3, 14e-3, 18e-3))
    assert prof.clocks(2, 2, 32, False, sp=False) == pytest.approx((1e-4, 1e-4, 1e-3, 2e-3))  # sp off: tp 1 at rows / 2
    slow_links = {"intra_node_gbps": 1e-3, "intra_node_latency_us": 1000}
    cost = _cost([H100], slow_links, nvidia_h100_sxm=prof)
    plan = ParallelPlan((StagePlan("cuda", 4, 8, tp=2, dp=2, sp=True),), "1f1b", 2, 4)
    pred = cost.predict(plan, Placement.pack(plan, (cost.cluster.types[0],)))
    assert pred.stages[0].tp_comm_s == 0.0  # the measured points hold the collectives
    unmeasured = _cost([H100], slow_links, nvidia_h100_sxm=tp1).predict(plan, Placement.pack(plan, (cost.cluster.types[0],)))
    assert unmeasured.stages[0].tp_comm_s > 0.1  # the ring formula over a very slow link


def test_the_heads_transient_peak_counts_once_on_the_last_stage() -> None:
    """An accelerator profile's head transient (logits gradient, the loss's copies) adds rows × seq × bytes / tp to
    the last stage's memory only, once whatever the in-flight micro-batches."""
    base = _clocked(1e-4)
    heavy = dataclasses.replace(base, head=dataclasses.replace(base.head, transient_bytes=1000))
    S, M = 4, 8
    plan = _plan(S, M)
    before = _cost([H100], nvidia_h100_sxm=base).predict(plan, Placement.pack(plan, (resolve(parse_cluster({"groups": [H100]})).types[0],) * S))
    after = _cost([H100], nvidia_h100_sxm=heavy).predict(plan, Placement.pack(plan, (resolve(parse_cluster({"groups": [H100]})).types[0],) * S))
    grown = [a.memory_bytes - b.memory_bytes for a, b in zip(after.stages, before.stages)]
    assert grown == [0, 0, 0, 1 * 32 * 1000]


def test_a_fused_head_plan_is_priced_with_the_fused_head_and_says_so_where_the_profile_lacks_it() -> None:
    """The last stage's head follows the plan: the fused one's time, per-token bytes and the weight gradient it holds
    per micro-batch (fixed_bytes) where the plan fuses; the plain head otherwise, and where the profile has no fused
    measurement the plain head prices the fused plan and the note says so."""
    from hal.parallel.planner.run_search import unfused_head_note

    base = _clocked(1e-4)
    plain, fused = PerToken(1e-5, 2e-5, 500, 300), PerToken(3e-5, 1e-6, 100, 50, fixed_bytes=7000)
    profiled = dataclasses.replace(base, head=plain, fused_head=fused)
    group = resolve(parse_cluster({"groups": [H100]})).types[0]
    S, M = 2, 4
    unfused_plan, fused_plan = _plan(S, M), dataclasses.replace(_plan(S, M), fused_head=True)

    def last(plan: ParallelPlan, prof: DeviceProfile):
        return _cost([H100], nvidia_h100_sxm=prof).predict(plan, Placement.pack(plan, (group,) * S)).stages[-1]

    tokens = 1 * 32
    a, b = last(unfused_plan, profiled), last(fused_plan, profiled)
    assert a.activation_bytes - b.activation_bytes == pytest.approx(tokens * (500 - 100) + tokens * (300 - 50) - 7000, abs=2)
    assert b.forward_s - a.forward_s == pytest.approx(tokens * (3e-5 - 1e-5), rel=1e-6)
    assert b.backward_s - a.backward_s == pytest.approx(tokens * (1e-6 - 2e-5), rel=1e-6)
    old = dataclasses.replace(base, head=plain)  # a profile written before the fused head was measured
    assert last(fused_plan, old).activation_bytes == a.activation_bytes
    profile = Profile(MODEL.to_dict(), "fp32", {"nvidia-h100-sxm": old})
    note = unfused_head_note([fused_plan], profile)
    assert note and "nvidia-h100-sxm" in note and "hal profile again" in note
    assert unfused_head_note([unfused_plan], profile) is None
    assert unfused_head_note([fused_plan], Profile(MODEL.to_dict(), "fp32", {"nvidia-h100-sxm": profiled})) is None


def test_a_written_plan_mixing_backends_names_no_top_level_backend(tmp_path) -> None:
    """hal train refuses a top-level backend its stages contradict: --write drops it for a plan over cpu and cuda,
    and sets it to the plan's one backend otherwise; the parallel: section is the plan as searched."""
    import yaml

    from hal.parallel.config.run import load_run_config
    from hal.parallel.planner.run_search import write_plan

    groups = [{"backend": "cpu", "device": "cpu-generic", "count": 2, "cores": 8},
              {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 2, "node": 1}]
    cost = _cost(groups, cpu_generic=_profile("cpu-generic", "cpu", f=1e-2, b=2e-2))
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump({"backend": "cpu", "precision": "fp32", "model": MODEL.to_dict(),
                                      "parallel": {"micro_batches": 8, "micro_batch_size": 1,
                                                   "stages": [{"backend": "cpu", "devices": 1, "layers": 8}]},
                                      "train": {"steps": 2}, "cluster": {"groups": groups}}))
    run = load_run_config(source, check_backends=False)
    mixed = Search(cost, run.plan, use_all_types=True).run(top=1).results[0]
    only_cuda = Search(cost, run.plan).run(top=1).results[0]
    assert {k.backend for k in mixed.placement.kinds} == {"cpu", "cuda"} and {k.backend for k in only_cuda.placement.kinds} == {"cuda"}
    for result, top in ((mixed, None), (only_cuda, "cuda")):
        out = tmp_path / f"plan-{top}.yaml"
        write_plan(run, result, out, cost)
        data = yaml.safe_load(out.read_text())
        assert data.get("backend") == top
        assert load_run_config(out, check_backends=False).plan == result.plan


def test_a_cluster_too_large_for_the_batch_is_said_as_such() -> None:
    """No layout at all (8 rows, 8 layers, 4 heads over 4096 devices) is not 'out of memory': the line names the split."""
    cost = _cost([{**H100, "count": 4096}])
    with pytest.raises(ConfigError, match="no layout splits a global batch of 8 rows and 8 layers over the cluster's "
                                          "4096 devices; declare fewer devices or raise the global batch"):
        Search(cost, ParallelPlan((StagePlan("cuda", 1, 8),), "1f1b", 8, 1)).run(top=1)


def test_expert_gradients_sync_over_their_own_replicas_only() -> None:
    """Dense gradients ring over every dp replica; a rank's 1 / ep of the experts over the dp / ep ranks holding the
    same experts -- none at ep = dp (what the engine's two groups do)."""
    cost = _cost([H100], {"intra_node_gbps": 1.0, "intra_node_latency_us": 5})
    kind = cost.cluster.types[0]
    params, experts = 10e6, 8e6
    dense_only = cost.dp_sync_s(kind, params - experts, 4, False, spans=False)
    sync, _ = cost.stage_sync_s(kind, params, experts, 1, 4, 4, False, spans=False)
    assert sync == pytest.approx(dense_only)  # ep = dp: each expert shard lives on one rank of the stage
    sync2, _ = cost.stage_sync_s(kind, params, experts, 1, 4, 2, False, spans=False)
    assert sync2 == pytest.approx(dense_only + cost.dp_sync_s(kind, experts / 2, 2, False, spans=False))
    sync1, _ = cost.stage_sync_s(kind, params, experts, 1, 4, 1, False, spans=False)
    assert sync1 > sync2 > sync
    assert sync1 == pytest.approx(cost.dp_sync_s(kind, params - experts, 4, False, spans=False)
                                  + cost.dp_sync_s(kind, experts, 4, False, spans=False))


# --- the search's size: polynomial past its exhaustive bound, progress, declared figures within physics ------------
CATALOG_GPUS = ("nvidia-h100-sxm", "nvidia-h100-pcie", "nvidia-h200-sxm", "nvidia-a100-sxm4-80gb", "nvidia-a100-sxm4-40gb",
                "nvidia-a100-pcie-80gb", "nvidia-a100-pcie-40gb", "amd-mi300x", "amd-mi250x", "huawei-ascend-910b")


def _many_types(n: int, count: int = 8) -> CostModel:
    backend = {"nvidia": "cuda", "amd": "rocm", "huawei": "ascend"}
    groups = [{"backend": backend[d.split("-")[0]], "device": d, "count": count, "node": i}
              for i, d in enumerate(CATALOG_GPUS[:n])]
    return _cost(groups, **{d.replace("-", "_"): _profile(d, backend[d.split("-")[0]], f=1e-3 * (1 + i / 4),
                                                          b=2e-3 * (1 + i / 4)) for i, d in enumerate(CATALOG_GPUS[:n])})


def test_the_layout_count_is_what_the_exhaustive_search_walks() -> None:
    cost = _many_types(3, count=2)
    search = Search(cost, _plan(1, 8))
    assert search.layout_count() == sum(1 for _ in search.layouts())  # 8 layers: no layout has too many stages here
    report = search.run(1)
    assert not report.bounded and report.layouts == search.layout_count()


def test_ten_device_types_are_searched_in_polynomially_many_layouts_and_say_so() -> None:
    from hal.parallel.planner.search import EXACT_LAYOUTS, ROUNDS

    cost = _many_types(10)
    said: list[str] = []
    search = Search(cost, _plan(1, 8), progress=said.append, progress_s=0.0)
    assert search.layout_count() > 10**15  # what the exhaustive search would walk
    report = search.run(3)
    T, G = 10, max(len(search.grids(t)) for t in cost.cluster.types)
    assert report.bounded and 0 < report.layouts <= 4 * (ROUNDS * T * G + 1) * T + T * G
    assert any(f"more than the {EXACT_LAYOUTS:,} searched exhaustively" in n for n in report.notes)
    assert report.results and report.results[0].plan.stages
    assert sum(line.startswith("searching: ") for line in said) >= report.layouts // 2  # progress_s=0: a line a layout


def test_bounded_search_finds_the_exhaustive_searchs_plan_on_a_small_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from hal.parallel.planner import search as search_module

    cost = _many_types(3, count=4)
    exhaustive = Search(cost, _plan(1, 8)).run(1)
    monkeypatch.setattr(search_module, "EXACT_LAYOUTS", 0)  # the bound itself, lowered: the same cluster searched bounded
    bounded = Search(cost, _plan(1, 8)).run(1)
    assert bounded.bounded and bounded.layouts < exhaustive.layouts
    assert bounded.results[0].prediction.step_s <= 1.05 * exhaustive.results[0].prediction.step_s


@pytest.mark.parametrize("where, key, value, says", [
    ("links", "inter_node_gbps", 1e-300, "must be between 0.001 and 100000 GB/s"),
    ("links", "bridge_gbps", 1e9, "must be between 0.001 and 100000 GB/s"),
    ("links", "intra_node_latency_us", 1e12, "must be at most 1e+07 µs"),
    ("group", "memory_gb", 1e-6, "must be between 0.001 and 100000 GB"),
    ("group", "memory_bandwidth_gbps", 1e12, "must be between 1 and 1e+06 GB/s"),
    ("group", "peak_tflops", {"bf16": 1e30}, "must be between 0.001 and 100000 TFLOP/s"),
])
def test_declared_figures_outside_physics_are_one_line(where: str, key: str, value: object, says: str) -> None:
    group = {**H100, **({key: value} if where == "group" else {})}
    links = {key: value} if where == "links" else None
    with pytest.raises(ConfigError) as err:
        resolve(parse_cluster({"groups": [group], **({"links": links} if links else {})}, "c.yaml"))
    message = str(err.value)
    assert says in message and key in message and "\n" not in message and "no device or link that exists" in message


@pytest.mark.parametrize("schedule", ["zero-bubble", "zbv"])
def test_a_played_schedule_is_predicted_with_the_order_hal_train_will_keep(schedule: str) -> None:
    """Uneven stages (9/6/5/4 of 24 layers) and links that take time: the prediction plays the order from its own
    times, as hal train's calibration will, and keeps it only where the simulator finds it faster — never slower
    than the unit order; ``order: unit`` (and a fixed-order schedule) is predicted as before."""
    model = dataclasses.replace(MODEL, num_layers=24)
    cluster = resolve(parse_cluster({"groups": [H100], "links": {"intra_node_gbps": 1, "intra_node_latency_us": 200}}))
    cost = CostModel(cluster, Profile(model.to_dict(), "fp32", {"nvidia-h100-sxm": _profile("nvidia-h100-sxm", "cuda")}), model, 32)
    V = 2 if schedule == "zbv" else 1
    layers = [9, 6, 5, 4] if V == 1 else [(5, 4), (3, 3), (3, 2), (2, 2)]
    plan = ParallelPlan(tuple(StagePlan("cuda", 1, n) for n in layers), schedule, 8, 1, virtual_stages=V)
    place = Placement.pack(plan, (cluster.types[0],) * 4)
    unit = cost.predict(plan, place)
    measured = cost.predict(plan, place, measured_order=True)
    assert unit.order is None and measured.order is not None
    assert measured.order["measured_step_s"] <= measured.order["unit_step_s"] + 1e-12
    assert measured.step_s <= unit.step_s + 1e-12
    if schedule == "zbv":  # uneven stages: the play helps (ZB-H1's unit order is already what its play finds here)
        assert measured.order["chosen"] == "measured" and measured.step_s < unit.step_s
    assert max(measured.in_flight) <= max(unit.in_flight)  # within the schedule's memory bound
    pinned = cost.predict(dataclasses.replace(plan, order="unit"), place, measured_order=True)
    assert pinned.order is None and pinned.step_s == unit.step_s
