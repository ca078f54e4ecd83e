"""The cpu node's in-run calibration: real pipelines on gloo, the slowdown and the tp wait solved through the
simulator, the cost model's use of the points (interpolated between them)."""
from __future__ import annotations

import dataclasses

import pytest

from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.planner import calibrate
from hal.parallel.planner.cluster import parse_cluster, resolve
from hal.parallel.planner.cost import CostModel, Placement
from hal.parallel.planner.device_profile import DeviceProfile, PerToken, Profile
from hal.parallel.planner.make_profile import make_profile
from hal.parallel.planner.search import Grid, Search
from hal.parallel.schedules import get_schedule, simulate

from ..dist_harness import run_function_forked

MODEL = ModelConfig(vocab_size=128, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, max_seq_len=32)
CLUSTER = resolve(parse_cluster({"groups": [{"backend": "cpu", "device": "cpu-generic", "count": 4, "cores": 2}]}))


@pytest.fixture(scope="module")
def measured() -> Profile:
    # one timed step a pipeline: this checks the points' shape and order, not the fit's noise
    return make_profile(CLUSTER, MODEL, "fp32", 32, quick=True, links=False, launch=run_function_forked, calibration_steps=1)


def test_profile_of_a_shared_node_carries_measured_calibration(measured: Profile) -> None:
    cpu = measured.devices["cpu-generic"]
    assert "calibration pipelines" in cpu.basis
    solo, *runs = sorted(cpu.contention)
    assert solo == (0.5, 1.0, 0.0)  # one rank of 1 thread on 2 cores: the profile's own conditions
    # 2 ranks (standard pipeline), then 4 ranks in the sparse and the standard pipeline: each keeps the node busier
    assert len(runs) == 3 and solo[0] < runs[0][0] < runs[1][0] < runs[2][0]
    assert all(slowdown >= 1.0 and wait >= 0.0 for _, slowdown, wait in runs)  # never faster than alone
    assert runs[0][2] == 0.0 and runs[1][2] == runs[2][2]  # 2 ranks fit 2 cores: no hand-off wait; 4 ranks: one fitted
    assert cpu.tp_all_reduce[0] == (0.5, 0.0, 0.0) and len(cpu.tp_all_reduce) == 2
    assert cpu.tp_all_reduce[1][1] >= 0.0 and cpu.tp_all_reduce[1][2] >= 0.0  # an all-reduce's wait, an sp exchange's
    back = DeviceProfile.from_dict(cpu.to_dict())
    assert back == cpu


def _played_makespan(device: DeviceProfile, S: int, shape: tuple[int, int, int], slowdown: float, wait: float,
                     p2p: float = 0.0) -> float:
    """The calibration pipeline played with every action ``slowdown`` × its solo compute + ``wait`` (the truth the
    fit must recover)."""
    layers, per_stage, rows = shape
    M = per_stage * S
    solo = [calibrate.solo_compute_s(device, S, k, rows, 32, 1, layers, per_stage) / M for k in range(S)]
    f, b, _ = device.layer(1, rows, 32, False)
    share = f / (f + b)
    return simulate(get_schedule("1f1b"), S, M, forward_s=[slowdown * c * share + wait for c in solo],
                    backward_s=[slowdown * c * (1 - share) + wait for c in solo], p2p_s=p2p).makespan


def test_the_node_fit_recovers_slowdown_its_growth_and_the_wait_per_action() -> None:
    device = _synthetic(())
    S = 4
    shapes = calibrate.node_shapes(2)
    played = [calibrate.play(device, S, shape, 32) for shape in shapes]
    occupancy = [p.busy * S / 2 for p in played]
    assert occupancy[1] < occupancy[0]  # the sparse pipeline's bubble leaves the node less busy
    truth = lambda o: 1.5 + 0.8 * (o - occupancy[0])  # noqa: E731 - a busier node computes slower
    measured = [_played_makespan(device, S, shape, truth(o), 0.003) for shape, o in zip(shapes, occupancy)]
    slowdown, slope, wait = calibrate.fit_node(played, occupancy, measured)
    assert (slowdown, slope, wait) == pytest.approx((1.5, 0.8, 0.003), rel=1e-6)
    # no wait in the measurements: none is invented; one slowdown for all: no growth
    measured = [_played_makespan(device, S, shape, 1.7, 0.0) for shape in shapes]
    assert calibrate.fit_node(played, occupancy, measured) == pytest.approx((1.7, 0.0, 0.0), abs=1e-9)
    # transfers are the cost model's to charge: played with them, the fit finds the same slowdown and wait
    sent = [calibrate.play(device, S, shape, 32, p2p_s=0.002) for shape in shapes]
    assert all(p.p2p_s > 0 and p.compute_s == q.compute_s for p, q in zip(sent, played))
    with_p2p = [_played_makespan(device, S, shape, truth(o), 0.003, p2p=0.002) - p.p2p_s
                for shape, o, p in zip(shapes, occupancy, sent)]
    assert calibrate.fit_node(sent, occupancy, with_p2p) == pytest.approx((1.5, 0.8, 0.003), rel=0.05)
    # faster than the profile alone (a noisy host): the slowdown stays 1, the wait 0
    measured = [0.5 * p.compute_s for p in played]
    slowdown, slope, wait = calibrate.fit_node(played, occupancy, measured)
    assert slowdown == 1.0 and wait == 0.0 and slope >= 0.0


def test_tp_wait_is_what_reproduces_the_measured_schedule() -> None:
    device = _synthetic(((0.5, 1.0, 0.0), (1.5, 2.0, 0.001)))
    rows = 2
    # tp: compute × the slowdown at the run's occupancy and the node's 1 ms wait an action, plus 16 all-reduces a
    # micro-batch of 2 ms each
    tp_solo = [2.0 * calibrate.solo_compute_s(device, 2, k, rows, 32, 2) / 8 for k in range(2)]
    calls = calibrate.LAYERS * 4
    target = simulate(get_schedule("1f1b"), 2, 8, forward_s=[c / 3 + 0.002 * calls / 2 for c in tp_solo],
                      backward_s=[2 * c / 3 + 0.002 * calls / 2 for c in tp_solo], action_s=0.001).makespan
    wait = calibrate.tp_wait_s(device, [{"compute_s": 1.0, "schedule_s": target}] * 4, 2, 2, rows, 32, 1.5)
    assert wait == pytest.approx(0.002, rel=1e-6)
    # sp: twice the exchanges a layer for the same measured schedule — each half the wait
    wait = calibrate.tp_wait_s(device, [{"compute_s": 1.0, "schedule_s": target}] * 4, 2, 2, rows, 32, 1.5, sp=True)
    assert wait == pytest.approx(0.001, rel=1e-6)


def test_points_interpolate_and_an_uncalibrated_profile_says_none() -> None:
    device = _synthetic(((0.5, 1.0, 0.0), (1.0, 1.5, 0.0), (1.5, 2.5, 0.002)), ((0.5, 0.0), (1.5, 0.001)))
    assert device.stretch(0.25) == 1.0 and device.stretch(0.75) == pytest.approx(1.25) and device.stretch(1.25) == pytest.approx(2.0)
    assert device.stretch(2.0) == pytest.approx(3.5)  # beyond the last point: its segment's slope
    assert device.action_wait_s(0.75) == 0.0 and device.action_wait_s(1.25) == pytest.approx(0.001)
    assert device.tp_all_reduce_s(1.0) == pytest.approx(0.0005)
    bare = _synthetic(())
    assert bare.stretch(1.0) is None and bare.tp_all_reduce_s(1.0) is None and bare.action_wait_s(1.0) == 0.0
    older = _synthetic(((0.5, 1.0), (1.5, 2.0)))  # a profile from before the wait was measured: slowdown only
    assert older.stretch(1.0) == pytest.approx(1.5) and older.action_wait_s(1.5) == 0.0


def test_the_wait_per_action_costs_more_where_actions_are_more() -> None:
    """The same plan interleaved (twice the actions) or with its backward split (zero-bubble) pays the calibrated
    wait more often; without a wait the three cost the same compute."""
    waits = _synthetic(((0.5, 1.0, 0.0), (2.0, 2.0, 0.004)))
    none = _synthetic(((0.5, 1.0, 0.0), (2.0, 2.0, 0.0)))
    kinds = (CLUSTER.types[0],) * 4
    grow = {}
    for schedule, V in (("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)):
        plan = ParallelPlan(tuple(StagePlan("cpu", 1, 2) for _ in range(4)), schedule, 8, 2, virtual_stages=V)
        place = Placement.pack(plan, kinds)
        with_wait = CostModel(CLUSTER, _profile(waits), MODEL, 32).predict(plan, place).schedule_s
        grow[schedule] = with_wait - CostModel(CLUSTER, _profile(none), MODEL, 32).predict(plan, place).schedule_s
    assert 0 < grow["1f1b"] < grow["zero-bubble"] and grow["1f1b"] < grow["interleaved-1f1b"]


def test_cost_model_charges_the_calibrated_slowdown_and_tp_all_reduces() -> None:
    plain = _synthetic(())
    busy = _synthetic(((0.5, 1.0), (1.5, 2.0)), ((0.5, 0.0), (1.5, 0.002)))
    pipeline = ParallelPlan(tuple(StagePlan("cpu", 1, 2) for _ in range(4)), "1f1b", 8, 2)
    tp = ParallelPlan((StagePlan("cpu", 2, 4, tp=2), StagePlan("cpu", 2, 4, tp=2)), "1f1b", 4, 2)
    kinds = (CLUSTER.types[0],)
    for plan in (pipeline, tp):
        place = Placement.pack(plan, kinds * plan.num_stages)
        before = CostModel(CLUSTER, _profile(plain), MODEL, 32).predict(plan, place)
        after = CostModel(CLUSTER, _profile(busy), MODEL, 32).predict(plan, place)
        assert after.step_s > before.step_s * 1.2, (plan.num_stages, before.step_s, after.step_s)
    # tp's all-reduces: the calibrated wait per call lengthens the tp stages beyond the slowdown alone
    no_tp_wait = dataclasses.replace(busy, tp_all_reduce=((0.5, 0.0), (1.5, 0.0)))
    place = Placement.pack(tp, kinds * 2)
    slower = CostModel(CLUSTER, _profile(busy), MODEL, 32).predict(tp, place).stages[0].forward_s
    assert slower > CostModel(CLUSTER, _profile(no_tp_wait), MODEL, 32).predict(tp, place).stages[0].forward_s
    # sp: with its own calibrated wait, a layer's four exchanges each way pay that wait (none: the all-reduce's, twice)
    sp = ParallelPlan((StagePlan("cpu", 2, 4, tp=2, sp=True), StagePlan("cpu", 2, 4, tp=2, sp=True)), "1f1b", 4, 2)
    priced = {}
    for name, exchange in (("cheap", 0.0001), ("dear", 0.004)):
        device = dataclasses.replace(busy, tp_all_reduce=((0.5, 0.0, 0.0), (1.5, 0.002, exchange)))
        priced[name] = CostModel(CLUSTER, _profile(device), MODEL, 32).predict(sp, place).stages[0].forward_s
    older = CostModel(CLUSTER, _profile(busy), MODEL, 32).predict(sp, place).stages[0].forward_s
    assert priced["cheap"] < older < priced["dear"]


def _synthetic(contention: tuple, tp_points: tuple = ()) -> DeviceProfile:
    from hal.parallel.planner.device_profile import LayerPoint, PerToken

    layers = tuple(LayerPoint(1, r, 32, rc, 1e-3 * r, 2e-3 * r * (1.5 if rc else 1.0), 1000 * r) for r in (1, 2, 4) for rc in (False, True))
    return DeviceProfile("cpu-generic", "cpu", "measured", "synthetic", layers, PerToken(1e-7, 1e-7, 8), PerToken(1e-6, 2e-6, 64),
                         1e-9, threads=1, contention=contention, tp_all_reduce=tp_points)


def _profile(device: DeviceProfile) -> Profile:
    return Profile(MODEL.to_dict(), "fp32", {"cpu-generic": device}, {}, 32, {})


# --- the accelerator side, run here on gloo ranks: the same code, the cpu's clock ----------------------------

def test_tp_layers_are_measured_with_their_group_and_used_as_they_are() -> None:
    """Two ranks split one layer (sp off and on): each point says so, the profile reads it at that tp and sp as
    measured (no tp 1 split), and the cost model adds no ring formula on top of it."""
    from hal.parallel.planner.measure import measure_tp_layers

    points = measure_tp_layers("cpu", MODEL, seq=32, rows=(1, 2), precision="fp32", repeats=1, launch=run_function_forked)
    assert [(p.tp, p.sp, p.rows, p.seq, p.recompute) for p in points] == [
        (2, False, 1, 32, False), (2, False, 2, 32, False), (2, True, 1, 32, False), (2, True, 2, 32, False)]
    assert all(p.forward_s > 0 and p.backward_s > 0 and p.activation_bytes > 0 for p in points)
    by = {(p.sp, p.rows): p for p in points}
    assert by[(True, 2)].activation_bytes < by[(False, 2)].activation_bytes  # sp keeps a sequence slice of the norms' inputs
    base = tuple(dataclasses.replace(p, tp=1, sp=False, forward_s=1.0, backward_s=1.0) for p in points if not p.sp)
    prof = DeviceProfile("cpu-generic", "cpu", "measured", "test", base + points, *(_ends(),) * 2, 0.0)
    assert prof.has_tp_points(2, False) and prof.has_tp_points(2, True) and not prof.has_tp_points(4, False)
    for sp in (False, True):
        f, b, act = prof.layer(2, 2, 32, False, sp)
        assert (f, b, act) == pytest.approx((by[(sp, 2)].forward_s, by[(sp, 2)].backward_s, by[(sp, 2)].activation_bytes))
    assert prof.layer(4, 2, 32, False)[0] == pytest.approx(1.0)  # tp 4 unmeasured: tp 1 at rows / 4 (one point: ∝ rows)


def _ends() -> PerToken:
    return PerToken(0.0, 0.0, 0)


def test_engine_host_work_is_what_reproduces_the_calibration_pipeline() -> None:
    """The per-action host time calibrate_host finds makes the cost model's step equal the measured pipeline's, run
    step by step as hal train runs it."""
    device = make_profile(CLUSTER, MODEL, "fp32", 32, quick=True, links=False, launch=run_function_forked, calibrate=False).devices["cpu-generic"]
    # layers 100x faster than measured: the model's compute alone falls short, the rest is the engine's host work
    device = dataclasses.replace(device, layers=tuple(dataclasses.replace(p, forward_s=p.forward_s / 100, backward_s=p.backward_s / 100)
                                                      for p in device.layers))
    kind = CLUSTER.types[0]
    measured: list[float] = []

    def launch(target: str, world: int, kwargs: dict, **kw: object):  # the real launcher; its result kept
        run = run_function_forked(target, world, kwargs, **kw)
        steps = [max(t) for t in zip(*(run.values[r]["steps_s"] for r in range(world)))]
        measured.append(sorted(steps)[len(steps) // 2])
        return run

    per_step = calibrate.calibrate_host(device, CLUSTER, kind, MODEL, precision="fp32", seq=32, launch=launch, steps=3)
    assert per_step > 0 and len(measured) == 1
    plan = calibrate.calibration_plan("cpu", calibrate.HOST_STAGES, calibrate.HOST_ROWS)
    config = ModelConfig(**{**MODEL.to_dict(), "num_layers": calibrate.HOST_STAGES * calibrate.LAYERS})
    prof = Profile(config.to_dict(), "fp32", {kind.device: dataclasses.replace(device, action_host_s=per_step)}, seq=32)
    pred = CostModel(CLUSTER, prof, config, 32).predict(plan, Placement.pack(plan, (kind,) * 2))
    assert pred.step_s == pytest.approx(measured[0], rel=1e-3)  # hal train's step: the schedule and the optimizer


def test_fit_increasing_solves_and_clamps() -> None:
    assert calibrate.fit_increasing(lambda x: 2 + 3 * x, 5.0) == pytest.approx(1.0, abs=1e-6)
    assert calibrate.fit_increasing(lambda x: 2 + 3 * x, 1.0) == 0.0  # already slower than measured: no host work
    assert calibrate.fit_increasing(lambda x: max(4.0, 10 * x), 6.0) == pytest.approx(0.6, abs=1e-6)  # flat, then rising


# --- the dp sync of a cpu node: its collectives measured with every pair of ranks at once ------------------------

def test_loaded_collectives_are_measured_in_pairs_and_priced_into_the_dp_sync() -> None:
    """One launch of the node's ranks measures the island link, the bridge link (each in a 2-rank world of its own)
    and the loaded collectives of every pair at once (``measure_node_links``)."""
    from hal.parallel.planner.device_profile import LinkProfile
    from hal.parallel.planner.measure import BRIDGE_SUM_SIZES, LINK_SIZES, LOADED_OPS, measure_node_links

    inside, bridge, loaded = measure_node_links("cpu", 4, run_function_forked, iters=3, loaded_iters=3)
    assert (inside.kind, bridge.kind) == ("island", "bridge") and "declared islands" in bridge.basis
    assert inside.bandwidth_gbps > 0 and bridge.bandwidth_gbps > 0
    # the bridge's all-reduce, as the replicas' exchange sums a bucket (what prices their sync), beside its broadcast
    assert set(bridge.loaded_collectives) == {"all_reduce"} and not inside.loaded_collectives
    assert 0 < bridge.loaded_collectives["all_reduce"][0] < bridge.loaded_collectives["all_reduce"][1]
    assert bridge.loaded_sizes == BRIDGE_SUM_SIZES
    assert loaded is not None and set(loaded) == set(LOADED_OPS)
    assert all(0 < small < large for small, large in loaded.values())  # 16 MiB takes longer than 4 KiB
    island = LinkProfile("island", "cpu", 3.0, 100.0, "measured", "test", loaded, LINK_SIZES)
    two = island.collective_s("all_reduce", LINK_SIZES[1], 2)
    assert two == pytest.approx(loaded["all_reduce"][1], rel=1e-9)  # at a measured size: the measurement
    assert island.collective_s("all_reduce", LINK_SIZES[1], 4) > two  # more ranks: more ring steps
    assert island.collective_s("all_reduce", 1e3, 1) == 0.0 and island.collective_s("broadcast", 1e3, 2) is None

    # the cost model: a dp stage's sync is the loaded all-reduce (ZeRO-1: reduce-scatter + all-gather), not the ring
    # formula over the P2P link — made 100x slower here, the sync follows
    device = _synthetic(((0.5, 1.0, 0.0), (2.0, 2.0, 0.0)))
    slow = {op: (a * 100, b * 100) for op, (a, b) in loaded.items()}
    plan = ParallelPlan((StagePlan("cpu", 2, 4, dp=2), StagePlan("cpu", 2, 4, dp=2)), "1f1b", 4, 2)
    zero = dataclasses.replace(plan, zero1=True)
    place = Placement.pack(plan, (CLUSTER.types[0],) * 2)
    syncs = {}
    for name, table in (("measured", loaded), ("slow", slow)):
        link = LinkProfile("island", "cpu", 3.0, 100.0, "measured", "test", table, LINK_SIZES)
        prof = Profile(MODEL.to_dict(), "fp32", {"cpu-generic": device}, {"cpu-island": link}, 32, {})
        cost = CostModel(CLUSTER, prof, MODEL, 32)
        preds = [cost.predict(p, place) for p in (plan, zero)]
        syncs[name] = [pred.stages[0].grad_sync_s for pred in preds]
        # the search's screening prices the stages' tail (dp sync + AdamW) as the full prediction does
        grids = [Grid(CLUSTER.types[0], 2, 1, 2, False)] * 2
        screened = [Search(cost, p)._tail(grids, [4, 4], p.zero1) for p in (plan, zero)]
        assert screened == pytest.approx([max(st.grad_sync_s + st.optimizer_s for st in pred.stages) for pred in preds],
                                         rel=1e-6)
    assert syncs["slow"][0] == pytest.approx(100 * syncs["measured"][0], rel=0.05)
    assert syncs["slow"][1] == pytest.approx(100 * syncs["measured"][1], rel=0.05)
    bare = Profile(MODEL.to_dict(), "fp32", {"cpu-generic": device}, {}, 32, {})  # not measured: the ring formula stands
    assert CostModel(CLUSTER, bare, MODEL, 32).predict(plan, place).stages[0].grad_sync_s > 0
