"""The planner's replica family: shares by speed, the bridge's price, the family it prefers, and the written plan."""
from __future__ import annotations

import pytest
import yaml

from hal.errors import ConfigError
from hal.parallel.config.flops import model_parameters
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.config.replicas import ReplicaSync
from hal.parallel.config.run import load_run_config
from hal.parallel.planner.cluster import parse_cluster, resolve
from hal.parallel.planner.cost import CostModel
from hal.parallel.planner.device_profile import DeviceProfile, LayerPoint, PerToken, Profile
from hal.parallel.planner.replica_search import ReplicaSearch, sync_cost
from hal.parallel.planner.run_search import family_note, preferred, write_replicas
from hal.parallel.planner.search import Search

from .test_planner_cost import MODEL

ASCEND = {"backend": "ascend", "device": "huawei-ascend-910b", "count": 4, "node": 1, "memory_gb": 64}
H100 = {"backend": "cuda", "device": "nvidia-h100-sxm", "count": 4, "node": 0}
BASE = ParallelPlan((StagePlan("cuda", 1, MODEL.num_layers),), "1f1b", 32, 1)  # 32 rows a step


def _profile(device: str, backend: str, f: float) -> DeviceProfile:
    """A layer's time proportional to its rows (backward = 2 x forward)."""
    points = tuple(LayerPoint(1, r, 32, rc, f * r, (2 * f + (f if rc else 0)) * r, 100_000 * r)
                   for rc in (False, True) for r in (1, 2, 4, 8))
    return DeviceProfile(device, backend, "measured", "synthetic", points, PerToken(0, 0, 0), PerToken(0, 0, 0), 0.0)


def _cost(bridge_gbps: float, ascend_f: float = 3e-3) -> CostModel:
    cluster = resolve(parse_cluster({"groups": [H100, ASCEND], "links": {
        "intra_node_gbps": 1e5, "intra_node_latency_us": 0, "bridge_gbps": bridge_gbps, "bridge_latency_us": 0,
        "inter_node_gbps": 1e5, "inter_node_latency_us": 0}}))
    speed = {"nvidia-h100-sxm": 1e-3, "huawei-ascend-910b": ascend_f}
    profile = Profile(MODEL.to_dict(), "fp32", {t.device: _profile(t.device, t.backend, speed[t.device]) for t in cluster.types})
    return CostModel(cluster, profile, MODEL, 32)


def test_each_type_trains_a_replica_sized_by_its_speed_and_the_step_adds_the_bridge() -> None:
    cost = _cost(bridge_gbps=10.0)
    [best] = ReplicaSearch(cost, BASE).run(top=1)
    assert best.devices == ("nvidia-h100-sxm", "huawei-ascend-910b")
    assert sum(best.rows) == 32 and best.rows[0] == 3 * best.rows[1]  # 3x faster: 24 : 8
    assert [r.plan.world_size for r in best.results] == [4, 4]
    assert best.step_s == pytest.approx(best.compute_s + best.sync.seconds)
    assert best.tokens_per_s == pytest.approx(32 * 32 / best.step_s)
    rep = best.replicated(ReplicaSync())
    assert rep.global_batch == 32 and [r.rows for r in rep.replicas] == list(best.rows)
    assert [r.first_rank for r in rep.replicas] == [0, 4]


def test_the_sync_is_the_model_over_the_bridge_halved_by_bf16_divided_by_h_and_striped_over_pairs() -> None:
    cost = _cost(bridge_gbps=1.0)
    [best] = ReplicaSearch(cost, BASE).run(top=1)
    fp32, bf16, local = (sync_cost(cost, best.results), sync_cost(cost, best.results, compress="bf16"),
                         sync_cost(cost, best.results, every=8))
    fp8 = sync_cost(cost, best.results, compress="fp8")
    assert fp32.bridge_bytes == model_parameters(MODEL) * 4 and bf16.bridge_bytes == fp32.bridge_bytes / 2
    assert fp8.bridge_bytes == pytest.approx(fp32.bridge_bytes / 4 * (1 + 4 / 1024))  # a byte a value, a scale a block
    assert fp8.seconds < bf16.seconds
    assert fp32.stripes == 1  # the model's gradient is one bucket: one pair carries it
    assert local.seconds == pytest.approx(fp32.seconds / 8)
    assert bf16.seconds < fp32.seconds
    # two replicas, no latency, infinitely fast islands: a 2-party ring moves the bytes once over 1 GB/s
    assert fp32.seconds == pytest.approx(model_parameters(MODEL) * 4 / 1e9, rel=1e-3)


def test_a_long_replica_search_says_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each one-replica search is a stage search of its own (seconds each on a large cluster): the what-if cluster
    printed nothing for ~58 s after its one 'replicas:' line. Now a line at most every PROGRESS_EVERY_S says how many
    were searched and which runs now (here every one: the bound set to 0)."""
    from hal.parallel.planner import replica_search

    monkeypatch.setattr(replica_search, "PROGRESS_EVERY_S", 0.0)
    said: list[str] = []
    search = ReplicaSearch(_cost(bridge_gbps=10.0), BASE, progress=said.append)
    search.run(top=1)
    lines = [line for line in said if " replica plan(s) searched, now " in line]
    assert len(lines) == search.searched >= 2, said
    assert lines[0].startswith("replicas: 0 replica plan(s) searched, now ") and lines[0].endswith(" s")


def test_the_search_prefers_the_faster_family_and_says_why() -> None:
    fast_bridge = _cost(bridge_gbps=1e4)
    report = Search(fast_bridge, BASE).run(top=2)
    search = ReplicaSearch(fast_bridge, BASE)
    report.replicas = search.run(top=2)
    family = preferred(report)
    quickest = min(report.replicas[0].step_s, report.results[0].prediction.step_s)
    assert (report.replicas[0].step_s == quickest) == (family == "replicas")
    note = family_note(report, search)
    assert note.startswith(f"the cost model prefers {family}") and "replica plan R1" in note and "stage plan #1" in note
    # a bridge too slow to carry the gradients each step: the replicas lose, and the note says the sync's share
    slow = _cost(bridge_gbps=1e-3)
    report = Search(slow, BASE).run(top=2)
    search = ReplicaSearch(slow, BASE)
    report.replicas = search.run(top=2)
    assert preferred(report) == "stages"
    assert report.replicas[0].sync.seconds > report.replicas[0].compute_s
    # a very slow second type: the fast type alone beats both families, and the note says so
    lame = _cost(bridge_gbps=1e4, ascend_f=1.0)
    report = Search(lame, BASE).run(top=1)
    search = ReplicaSearch(lame, BASE)
    report.replicas = search.run(top=1)
    assert "4× nvidia-h100-sxm alone predicts" in family_note(report, search)


def test_a_written_replica_plan_loads_as_a_replicated_run(tmp_path) -> None:
    cost = _cost(bridge_gbps=10.0)
    [best] = ReplicaSearch(cost, BASE).run(top=1)
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump({"model": MODEL.to_dict(), "parallel": BASE.to_dict(), "train": {"seq_len": 32}}))
    run = load_run_config(source, check_backends=False)
    written = tmp_path / "replicas.yaml"
    write_replicas(run, best, written)
    assert written.read_text().startswith("# written by hal plan --search")
    again = load_run_config(written, check_backends=False)
    assert again.replicas is not None and [r.rows for r in again.replicas.replicas] == list(best.rows)
    assert [r.plan.stages[0].backend for r in again.replicas.replicas] == ["cuda", "ascend"]


def test_a_type_too_small_for_a_replica_of_its_own_joins_one_as_a_pipeline_stage(tmp_path) -> None:
    """Mixes: replicas of heterogeneous pipelines. Two MI300X declared with 2 MB each cannot hold the model, nor half
    of it, so no replica of their own; the search splits the three types every way and the best plan puts them in a
    pipeline with another type's devices, beside a plain replica."""
    small = {"backend": "rocm", "device": "amd-mi300x", "count": 2, "node": 2, "memory_gb": 0.002}
    cluster = resolve(parse_cluster({"groups": [H100, ASCEND, small], "links": {
        "intra_node_gbps": 1e5, "intra_node_latency_us": 0, "bridge_gbps": 10.0, "bridge_latency_us": 0,
        "inter_node_gbps": 1e5, "inter_node_latency_us": 0}}))
    speed = {"nvidia-h100-sxm": 1e-3, "huawei-ascend-910b": 3e-3, "amd-mi300x": 1.2e-3}
    profile = Profile(MODEL.to_dict(), "fp32", {t.device: _profile(t.device, t.backend, speed[t.device]) for t in cluster.types})
    search = ReplicaSearch(CostModel(cluster, profile, MODEL, 32), BASE)
    found = search.run(top=10)
    h, a, m = "nvidia-h100-sxm", "huawei-ascend-910b", "amd-mi300x"
    assert set(search.tried) == {(h, a), (h, m), (a, m), (f"{h}+{a}", m), (f"{h}+{m}", a), (h, f"{a}+{m}"), (h, a, m)}
    assert all(m not in c.devices for c in found)  # never a replica of its own
    best = found[0]
    assert best.mixed and best.type_count == 3, best.devices
    plain = next(c for c in found if not c.mixed)
    assert best.step_s < plain.step_s  # the small devices add speed as stages
    mixed = next(r for r, d in zip(best.results, best.devices) if "+" in d)
    used = {k.device for k in mixed.placement.kinds}
    assert m in used and len(used) == 2  # use_all_types: both of its types hold a stage
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump({"model": MODEL.to_dict(), "parallel": BASE.to_dict(), "train": {"seq_len": 32}}))
    written = tmp_path / "replicas.yaml"
    write_replicas(load_run_config(source, check_backends=False), best, written)
    again = load_run_config(written, check_backends=False)
    assert again.replicas is not None and [r.rows for r in again.replicas.replicas] == list(best.rows)
    assert any(len({s.backend for s in r.plan.stages}) == 2 for r in again.replicas.replicas)


def test_replicas_a_user_wrote_are_priced_with_the_bridge_hal_profile_measured_between_islands_declared_apart() -> None:
    """Two dp2 replicas of one GPU type on one host, declared apart (HAL_ISLANDS): their gradients cross the host-staged
    bridge, priced at the bridge figure ``hal profile`` measured (here 2 GB/s), not the native link between the GPUs."""
    from hal.parallel.planner.cost import Placement
    from hal.parallel.planner.device_profile import LinkProfile
    from hal.parallel.planner.replica_search import predict_replicas

    cluster = resolve(parse_cluster({"groups": [{**H100, "node": 0}], "links": {
        "intra_node_gbps": 1e5, "intra_node_latency_us": 0}}))
    bridge = LinkProfile("bridge", "cuda", 2.0, 0.0, "measured", "synthetic")
    profile = Profile(MODEL.to_dict(), "fp32", {"nvidia-h100-sxm": _profile("nvidia-h100-sxm", "cuda", 1e-3)},
                      {"cuda-bridge": bridge})
    cost = CostModel(cluster, profile, MODEL, 32)
    plan = ParallelPlan((StagePlan("cuda", 2, MODEL.num_layers, dp=2),), "1f1b", 8, 2)
    apart = predict_replicas([cost, cost], [plan, plan], [16, 16], bridged=True)
    together = predict_replicas([cost, cost], [plan, plan], [16, 16])
    alone = cost.predict(plan, Placement.pack(plan, cluster.types))
    assert [r.prediction.step_s for r in apart.results] == [alone.step_s, alone.step_s]
    assert apart.step_s == pytest.approx(alone.step_s + apart.sync.seconds)
    wire = model_parameters(MODEL) * 4
    assert apart.sync.seconds == pytest.approx(wire / 2e9, rel=0.01)  # one bucket, one pair, 2 GB/s
    assert together.sync.seconds < apart.sync.seconds / 100  # inside one island: the GPUs' own link
    assert cost.link(cluster.types[0], cluster.types[0], True, bridged=True)[:2] == (2.0, 0.0)


def test_where_hal_profile_timed_the_bridges_all_reduce_it_prices_every_bucket_instead_of_the_broadcast() -> None:
    """The exchange sums its buckets staged and striped over the host channels, which a broadcast's single stream
    does not show (3x slower on H200 hosts): a bridge profile with the all-reduce timed (4 KiB: 1 ms, 32 MiB: 9 ms)
    prices each bucket from it — latency plus bytes at the measured rate — and the broadcast figure goes unused."""
    from hal.parallel.planner.device_profile import LinkProfile
    from hal.parallel.planner.replica_search import predict_replicas
    from hal.parallel.replicas.sync import BUCKET_BYTES

    cluster = resolve(parse_cluster({"groups": [{**H100, "node": 0}], "links": {
        "intra_node_gbps": 1e5, "intra_node_latency_us": 0}}))
    sizes = (4 << 10, BUCKET_BYTES)
    timed = LinkProfile("bridge", "cuda", 2.0, 0.0, "measured", "synthetic", {"all_reduce": (1e-3, 9e-3)}, sizes)
    plan = ParallelPlan((StagePlan("cuda", 2, MODEL.num_layers, dp=2),), "1f1b", 8, 2)
    synced = {}
    for name, bridge in (("timed", timed), ("broadcast only", LinkProfile("bridge", "cuda", 2.0, 0.0, "measured", "x"))):
        profile = Profile(MODEL.to_dict(), "fp32", {"nvidia-h100-sxm": _profile("nvidia-h100-sxm", "cuda", 1e-3)},
                          {"cuda-bridge": bridge})
        cost = CostModel(cluster, profile, MODEL, 32)
        synced[name] = predict_replicas([cost, cost], [plan, plan], [16, 16], bridged=True).sync.seconds
    wire = model_parameters(MODEL) * 4
    per_byte = (9e-3 - 1e-3) / (sizes[1] - sizes[0])
    # one bucket, 2 speakers (the hand-back inside each island, over its 1e5 GB/s link, adds next to nothing)
    assert synced["timed"] == pytest.approx(1e-3 - sizes[0] * per_byte + wire * per_byte, rel=1e-4)
    assert synced["broadcast only"] == pytest.approx(wire / 2e9, rel=0.01)


def test_a_type_whose_devices_cannot_all_share_a_small_batch_share_trains_it_on_fewer() -> None:
    """16 slow devices beside 4 fast ones get a share of a few rows, which 16 ranks cannot split (a dp or tp rank for
    each): the replica takes fewer of them (halving) rather than no replica plan at all (on a 1 x H200 host with
    its 16-core cpu, hal plan --search said "replica plans: none")."""
    slow = {"backend": "ascend", "device": "huawei-ascend-910b", "count": 16, "node": 1, "memory_gb": 64}
    cluster = resolve(parse_cluster({"groups": [H100, slow], "links": {
        "intra_node_gbps": 1e5, "intra_node_latency_us": 0, "bridge_gbps": 10.0, "bridge_latency_us": 0,
        "inter_node_gbps": 1e5, "inter_node_latency_us": 0}}))
    speed = {"nvidia-h100-sxm": 1e-3, "huawei-ascend-910b": 0.1}
    profile = Profile(MODEL.to_dict(), "fp32", {t.device: _profile(t.device, t.backend, speed[t.device]) for t in cluster.types})
    [best] = ReplicaSearch(CostModel(cluster, profile, MODEL, 32), BASE).run(top=1)
    rows = dict(zip(best.devices, best.rows))
    assert rows["huawei-ascend-910b"] < 16
    assert best.results[1].plan.world_size < 16  # a dp (or tp) rank a row at most: fewer ranks


def test_replicas_sharing_a_nodes_cores_are_priced_with_each_others_load() -> None:
    """Two dp2 cpu replicas on one 2-core node: each computes while the other does, so each is priced at the node's
    whole load (on the 2-core host, examples/replicas_cpu.yaml was predicted 26 % short without it, 0.7 % with);
    on two nodes of their own they do not meet."""
    from hal.parallel.planner.cost import Placement
    from hal.parallel.planner.replica_search import predict_replicas

    def cost(nodes: list[dict]) -> CostModel:
        cluster = resolve(parse_cluster({"groups": nodes}))
        profile = Profile(MODEL.to_dict(), "fp32", {"cpu-generic": _profile("cpu-generic", "cpu", 1e-3)})
        return CostModel(cluster, profile, MODEL, 32)

    plan = ParallelPlan((StagePlan("cpu", 2, MODEL.num_layers, dp=2),), "1f1b", 4, 2)
    one = cost([{"backend": "cpu", "device": "cpu-generic", "count": 4, "node": 0, "cores": 2}])
    two = cost([{"backend": "cpu", "device": "cpu-generic", "count": 2, "node": n, "cores": 2} for n in (0, 1)])
    alone = one.predict(plan, Placement.pack(plan, one.cluster.types)).step_s
    shared = predict_replicas([one, one], [plan, plan], [8, 8])
    apart = predict_replicas([two, two], [plan, plan], [8, 8])
    assert [r.placement.starts for r in apart.results] == [(0,), (2,)]  # replica 1's ranks after replica 0's
    assert all(r.prediction.step_s == pytest.approx(alone) for r in apart.results)
    assert all(r.prediction.step_s > 1.5 * alone for r in shared.results)  # 4 busy ranks on 2 cores, not 2
    assert one.background == {}  # the caller's cost model is left as it was
    with pytest.raises(ConfigError, match="the replicas use 6 cpu-generic devices but the cluster"):
        predict_replicas([one, one, one], [plan, plan, plan], [8, 4, 4])
