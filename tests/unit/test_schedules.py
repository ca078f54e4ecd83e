"""Schedules as data: the orders GPipe and 1F1B prescribe, their simulated bubble and memory, deadlocks, the registry."""
from __future__ import annotations

import pytest

from hal.errors import ConfigError
from hal.parallel.config.plan import parse_plan
from hal.parallel.schedules import (
    Action,
    Deadlock,
    GPipe,
    Kind,
    OneFOneB,
    Overlap,
    P2PBatch,
    compute_actions,
    get_schedule,
    schedule_names,
    simulate,
)


def _names(steps: list) -> list[str]:
    return [str(s) for s in steps]


def test_gpipe_order_is_every_forward_then_every_backward() -> None:
    for s in range(3):
        assert _names(GPipe().compute_order(3, 2, s)) == ["F0", "F1", "B0", "B1"]
    # communication: a receive right before its compute, a send right after, each posted alone
    assert _names(GPipe().program(3, 2, 1)) == [
        "RECV_F0", "F0", "SEND_F0", "RECV_F1", "F1", "SEND_F1", "RECV_B0", "B0", "SEND_B0", "RECV_B1", "B1", "SEND_B1"]
    assert _names(GPipe().program(2, 2, 0)) == ["F0", "SEND_F0", "F1", "SEND_F1", "RECV_B0", "B0", "RECV_B1", "B1"]


def test_1f1b_order_warms_up_alternates_and_cools_down() -> None:
    sch = OneFOneB()
    assert _names(sch.compute_order(3, 4, 0)) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert _names(sch.compute_order(3, 4, 1)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert _names(sch.compute_order(3, 4, 2)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert _names(sch.compute_order(4, 2, 0)) == ["F0", "F1", "B0", "B1"]  # M < S - 1: all warm-up


def test_1f1b_steady_phase_posts_each_send_with_the_opposite_receive() -> None:
    """send_forward_recv_backward / send_backward_recv_forward: the batches that keep blocking P2P deadlock-free."""
    assert _names(OneFOneB().program(3, 3, 1)) == [
        "RECV_F0", "F0", "SEND_F0", "RECV_F1", "F1", "SEND_F1+RECV_B0", "B0", "SEND_B0+RECV_F2", "F2", "SEND_F2+RECV_B1",
        "B1", "SEND_B1", "RECV_B2", "B2", "SEND_B2"]
    assert _names(OneFOneB().program(2, 2, 0)) == ["F0", "SEND_F0", "F1", "SEND_F1+RECV_B0", "B0", "RECV_B1", "B1"]
    assert _names(OneFOneB().program(2, 2, 1)) == ["RECV_F0", "F0", "B0", "SEND_B0+RECV_F1", "F1", "B1", "SEND_B1"]
    fused = [s for s in OneFOneB().program(3, 3, 1) if isinstance(s, P2PBatch) and len(s.actions) == 2]
    assert all(s.actions[0].kind.name.startswith("SEND") and s.actions[1].kind.name.startswith("RECV") for s in fused)


def test_a_p2p_batch_crosses_one_boundary() -> None:
    with pytest.raises(ValueError, match="crosses one boundary"):
        P2PBatch((Action(Kind.SEND_FORWARD, 0), Action(Kind.RECV_FORWARD, 1)))
    with pytest.raises(ValueError, match="communication actions"):
        P2PBatch((Action(Kind.FORWARD, 0),))


@pytest.mark.parametrize("S,M", [(2, 2), (3, 5), (4, 8), (4, 3), (1, 4)])
def test_peak_in_flight(S: int, M: int) -> None:
    assert simulate(OneFOneB(), S, M).peak_in_flight == tuple(min(S - s, M) for s in range(S))
    assert simulate(GPipe(), S, M).peak_in_flight == (M,) * S


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(2, 4), (3, 5), (4, 8), (4, 4)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
def test_bubble_with_equal_stages(name: str, S: int, M: int, f: float, b: float) -> None:
    sim = simulate(get_schedule(name), S, M, forward_s=f, backward_s=b)
    ideal = (S - 1) / (M + S - 1)
    assert sim.makespan == pytest.approx((M + S - 1) * (f + b))
    assert sim.bubble_overall == pytest.approx(ideal)
    assert sim.bubble == pytest.approx([ideal] * S)
    assert len(sim.timeline) == 2 * S * M


def test_timeline_respects_dependencies_and_latency() -> None:
    sim = simulate(OneFOneB(), 3, 4, forward_s=[1.0, 2.0, 1.0], backward_s=2.0, p2p_s=0.5)
    end = {(sp.action.kind, sp.action.micro_batch, sp.stage): sp.end for sp in sim.timeline}
    for sp in sim.timeline:
        k, m, s = sp.action.kind, sp.action.micro_batch, sp.stage
        if k is Kind.FORWARD and s > 0:
            assert sp.start >= end[(Kind.FORWARD, m, s - 1)] + 0.5
        if k is Kind.BACKWARD:
            assert sp.start >= end[(Kind.FORWARD, m, s)]
            if s < 2:
                assert sp.start >= end[(Kind.BACKWARD, m, s + 1)] + 0.5
    assert sim.makespan == max(sp.end for sp in sim.timeline)
    assert sim.bubble[1] < sim.bubble[0]  # the slow middle stage is the busiest


def test_a_broken_order_is_reported_as_a_deadlock() -> None:
    good = {s: OneFOneB().compute_order(2, 2, s) for s in range(2)}
    assert simulate(good, 2, 2).makespan > 0
    broken = dict(good)
    broken[1] = [Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 1)]
    with pytest.raises(Deadlock, match="stage 1 at B0 waits for F0 on stage 1"):
        simulate(broken, 2, 2)
    crossed = {0: [Action(Kind.FORWARD, 1), Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0), Action(Kind.BACKWARD, 1)],
               1: [Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 1)]}
    assert simulate(crossed, 2, 2).makespan > 0  # out of order but still possible
    cyclic = {0: [Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 1)],
              1: [Action(Kind.FORWARD, 1), Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0), Action(Kind.BACKWARD, 1)]}
    with pytest.raises(Deadlock, match="stage 0 at B0 .*stage 1 at F1 waits for F1 on stage 0"):
        simulate(cyclic, 2, 2)


def test_registry_names_and_unknown_names() -> None:
    assert schedule_names() == ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "interleaved-zero-bubble", "zbv",
                                "dualpipev")
    assert isinstance(get_schedule("1f1b"), OneFOneB) and isinstance(get_schedule("gpipe"), GPipe)
    names = "gpipe, 1f1b, interleaved-1f1b, zero-bubble, interleaved-zero-bubble, zbv, dualpipev"
    with pytest.raises(ValueError, match=f"schedule .zb. is unknown; use one of {names}"):
        get_schedule("zb")
    stages = [{"backend": "cpu", "devices": 1, "layers": 1}]
    assert parse_plan({"schedule": "gpipe", "stages": stages}).schedule.name == "gpipe"
    with pytest.raises(ConfigError, match=r"'parallel.schedule': 'gpipee' is not allowed \(did you mean 'gpipe'\?\); use one of "
                                         "gpipe, 1f1b, interleaved-1f1b, zero-bubble, interleaved-zero-bubble, zbv, dualpipev"):
        parse_plan({"schedule": "gpipee", "stages": stages})


# --- zero-bubble (ZB-H1) -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("S,M", [(1, 3), (2, 4), (3, 5), (4, 8), (4, 16), (4, 2), (6, 12)])
def test_zero_bubble_runs_every_action_once_within_1f1b_memory_and_never_slower(S: int, M: int) -> None:
    zb = get_schedule("zero-bubble")
    for s in range(S):
        order = [str(a) for a in zb.compute_order(S, M, s)]
        assert sorted(order) == sorted(f"{k}{m}" for k in "FIW" for m in range(M))  # each F, I and W once
        assert all(order.index(f"I{m}") < order.index(f"W{m}") for m in range(M))
    sim = simulate(zb, S, M, forward_s=1.0, backward_s=2.0)  # equal F, I and W
    ref = simulate(OneFOneB(), S, M, forward_s=1.0, backward_s=2.0)
    assert sim.peak_in_flight == ref.peak_in_flight  # counted until W: 1F1B's activation bound
    assert sim.makespan <= ref.makespan - (S - 1)  # the cool-down's backward chain runs on I halves


def test_zero_bubble_bubble_at_4_stages_and_8_micro_batches() -> None:
    """30 time units against 1F1B's (M + S - 1)(F + B) = 33: every stage idles 6 of 30 (0.20 against 0.27)."""
    sim = simulate(get_schedule("zero-bubble"), 4, 8, forward_s=1.0, backward_s=2.0)
    assert sim.makespan == pytest.approx(30.0) and sim.bubble == pytest.approx([0.2] * 4)
    assert len(sim.timeline) == 3 * 4 * 8
    # with W free (weight_share 0), the input halves alone: the split costs nothing where W is cheap
    assert simulate(get_schedule("zero-bubble"), 4, 8, backward_s=2.0, weight_share=0.0).makespan <= 33.0
    # one share a stage (a profile measures it per device type): equal shares play as the one fraction does
    zb = get_schedule("zero-bubble")
    assert simulate(zb, 4, 8, weight_share=[0.3] * 4).makespan == pytest.approx(simulate(zb, 4, 8, weight_share=0.3).makespan)
    with pytest.raises(ValueError, match="weight_share: a fraction"):
        simulate(zb, 4, 8, weight_share=[0.3, 0.3, 1.2, 0.3])


def test_zero_bubble_posts_1f1b_batches_and_sends_after_input_halves() -> None:
    program = [str(a) for a in get_schedule("zero-bubble").program(3, 4, 1)]
    assert "SEND_F1+RECV_B0" in program and "SEND_B0" in program and "W0" in program
    assert program.index("I0") < program.index("SEND_B0") < program.index("W0")
    assert not any(step.startswith(("RECV_B", "SEND_B")) and "W" in step for step in program)


def test_zero_bubble_takes_a_compiled_stage_beside_an_eager_one() -> None:
    stages = [{"backend": "cpu", "devices": 1, "layers": 1}, {"backend": "cpu", "devices": 1, "layers": 1, "compile": True}]
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import validate_plan

    model = ModelConfig(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=16, max_seq_len=4)
    plan = parse_plan({"schedule": "zero-bubble", "stages": stages, "micro_batches": 2})
    validate_plan(plan, model, world_size=2, check_backends=False)
    assert [plan.stage_compiles(k) for k in range(2)] == [False, True]


# --- interleaved 1F1B -------------------------------------------------------------------------------------


def test_interleaved_order_is_megatrons() -> None:
    """Groups of S micro-batches walk the chunks forward, backwards walk them in reverse; 2(S-s-1)+(V-1)S warm-up."""
    sch = get_schedule("interleaved-1f1b")
    assert _names(sch.compute_order(2, 4, 0, 2)) == [
        "F0", "F1", "F0c1", "F1c1", "F2", "B0c1", "F3", "B1c1", "F2c1", "B0", "F3c1", "B1", "B2c1", "B3c1", "B2", "B3"]
    assert _names(sch.compute_order(2, 4, 1, 2)) == [
        "F0", "F1", "F0c1", "B0c1", "F1c1", "B1c1", "F2", "B0", "F3", "B1", "F2c1", "B2c1", "F3c1", "B3c1", "B2", "B3"]
    for S, M, V in ((2, 4, 2), (4, 8, 3), (3, 6, 2)):
        for s in range(S):
            order = sch.compute_order(S, M, s, V)
            assert sorted((a.kind.value, a.chunk, a.micro_batch) for a in order) == sorted(
                (k, v, m) for k in "FB" for v in range(V) for m in range(M))
            warm = min(2 * (S - s - 1) + (V - 1) * S, M * V)
            assert [a.kind for a in order].index(Kind.BACKWARD) == warm + (warm < M * V)  # the steady phase starts with an F


@pytest.mark.parametrize("S,M,V", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 3), (3, 6, 4)])
def test_interleaved_bubble_matches_the_closed_form(S: int, M: int, V: int) -> None:
    """Equal chunks, backward = 2 x forward: idle share (S-1)/(V*M+S-1), V times below 1F1B's (S-1)/(M+S-1)."""
    sim = simulate(get_schedule("interleaved-1f1b"), S, M, virtual_stages=V, forward_s=1.0, backward_s=2.0)
    assert sim.bubble_overall == pytest.approx((S - 1) / (V * M + S - 1), abs=1e-12)
    assert simulate(OneFOneB(), S, M).bubble_overall == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "interleaved-zero-bubble"])
@pytest.mark.parametrize("S,M,V", [(2, 4, 2), (3, 3, 2), (4, 8, 2), (4, 8, 3)])
def test_interleaved_batches_mirror_over_every_link(S: int, M: int, V: int, name: str) -> None:
    """Both ends of a link post the same sequence of batches, each send against the peer's receive: the
    pairing NCCL's per-communicator queues need, and one link order per round so no ring of waits forms."""
    sch = get_schedule(name)
    programs = [sch.program(S, M, s, V) for s in range(S)]
    flip = {Kind.SEND_FORWARD: Kind.RECV_FORWARD, Kind.SEND_BACKWARD: Kind.RECV_BACKWARD}
    for s in range(S):
        for peer in range(S):
            mine = [b for b in programs[s] if isinstance(b, P2PBatch) and b.peer_stage == peer]
            theirs = [b for b in programs[peer] if isinstance(b, P2PBatch) and b.peer_stage == s]
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                sends = sorted((flip[x.kind].value, x.micro_batch) for x in a.actions if x.kind in flip)
                recvs = sorted((x.kind.value, x.micro_batch) for x in b.actions if x.kind not in flip)
                assert sends == recvs, (s, peer, str(a), str(b))
    # every transfer the model's virtual stages need is there exactly once
    sent = sum(1 for p in programs for b in p if isinstance(b, P2PBatch) for a in b.actions if a.kind in flip)
    assert sent == 2 * M * (S * V - 1)


def test_interleaved_needs_chunks_stages_and_groups_of_micro_batches() -> None:
    sch = get_schedule("interleaved-1f1b")
    with pytest.raises(ValueError, match="virtual_stages ≥ 2"):
        sch.compute_order(2, 4, 0, 1)
    with pytest.raises(ValueError, match="micro_batches 6 must be a multiple of 4"):
        sch.compute_order(4, 6, 0, 2)
    with pytest.raises(ValueError, match="runs one chunk per stage"):
        OneFOneB().program(2, 4, 0, 2)


def _interleaved_plan(**over: object) -> dict:
    plan = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
            "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]}
    plan.update(over)
    return plan


@pytest.mark.parametrize("over,message", [
    ({"virtual_stages": 1}, "set parallel.virtual_stages ≥ 2"),
    ({"schedule": "1f1b"}, "virtual_stages 2 needs an interleaved schedule"),
    ({"micro_batches": 3}, "micro_batches 3 must be a multiple of 2, e.g. 4"),
    ({"virtual_stages": 3, "stages": [{"backend": "cpu", "devices": 1, "layers": 3},
                                      {"backend": "cpu", "devices": 1, "layers": 1}]},
     r"stage 1 \(parallel.stages\[1\].layers\): 1 layers do not split into 3 equal chunks"),
    ({"stages": [{"backend": "cpu", "devices": 1, "layers": [1, 1, 1]}, {"backend": "cpu", "devices": 1, "layers": 1}]},
     r"\[1, 1, 1\] lists 3 chunk\(s\) but parallel.virtual_stages is 2"),
    ({"stages": [{"backend": "cpu", "devices": 1, "layers": [2, 0]}, {"backend": "cpu", "devices": 1, "layers": 2}]},
     r"layers\[1\]' must be a positive integer"),
])
def test_plan_refuses_what_interleaving_cannot_run(over: dict, message: str) -> None:
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import validate_plan

    model = ModelConfig(num_layers=4)
    with pytest.raises(ConfigError, match=message):
        validate_plan(parse_plan(_interleaved_plan(**over)), model, world_size=None, check_backends=False)
    validate_plan(parse_plan(_interleaved_plan()), model, world_size=None, check_backends=False)


def test_interleaved_topology_takes_layers_in_virtual_stage_order() -> None:
    from hal.parallel.config.topology import Topology

    plan = parse_plan(_interleaved_plan(stages=[{"backend": "cpu", "devices": 1, "layers": [2, 1]},
                                                 {"backend": "cpu", "devices": 1, "layers": [1, 2]}]))
    topo = Topology.from_plan(plan)
    assert [m.layer_ranges for m in topo.stages] == [(range(0, 2), range(3, 4)), (range(2, 3), range(4, 6))]
    assert topo.virtual_stages == 2 and topo.wrap_ranks() == (0, 1)
    assert topo.to_dict()["boundaries"][-1]["from_stage"] == 1 and topo.to_dict()["boundaries"][-1]["to_stage"] == 0


@pytest.mark.parametrize("S,M,V", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 3), (3, 6, 2)])
def test_interleaved_zero_bubble_fills_the_bubble_at_interleaved_1f1bs_memory(S: int, M: int, V: int) -> None:
    """Every F, I and W once per chunk; the same peak of held chunk activations as interleaved 1F1B; less idle."""
    zb, il = get_schedule("interleaved-zero-bubble"), get_schedule("interleaved-1f1b")
    for s in range(S):
        order = zb.compute_order(S, M, s, V)
        assert sorted((a.kind.value, a.chunk, a.micro_batch) for a in order) == sorted(
            (k, v, m) for k in "FIW" for v in range(V) for m in range(M))
    a = simulate(zb, S, M, virtual_stages=V, forward_s=1.0, backward_s=2.0)
    b = simulate(il, S, M, virtual_stages=V, forward_s=1.0, backward_s=2.0)
    assert a.peak_in_flight == b.peak_in_flight
    assert a.bubble_overall < b.bubble_overall
    if (S, M, V) == (4, 8, 2):
        assert a.bubble_overall == pytest.approx(2 / 18) and b.bubble_overall == pytest.approx(3 / 19)


def test_split_backward_schedules_take_compiled_stages() -> None:
    """A compiled layer runs its linears eagerly between its graphs under a split backward
    (tests/unit/test_compile_stage.py), so the zero-bubble family accepts compiled stages."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import validate_plan

    for schedule in ("interleaved-zero-bubble", "zbv"):
        plan = parse_plan(_interleaved_plan(schedule=schedule, compile=True))
        validate_plan(plan, ModelConfig(num_layers=4), world_size=None, check_backends=False)


# --- ZB-V ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S", [2, 3, 4, 8])
def test_v_placement_is_a_v_and_its_own_inverse(S: int) -> None:
    from hal.parallel.schedules.placement import last_stage, neighbours, position, virtual_index

    seen = [position(j, S, 2, "v") for j in range(2 * S)]
    assert seen == [(k, 0) for k in range(S)] + [(k, 1) for k in reversed(range(S))]
    assert all(virtual_index(k, c, S, "v") == j for j, (k, c) in enumerate(seen))
    assert last_stage(S, "v") == 0 and last_stage(S, "loop") == S - 1
    assert neighbours(S - 1, 0, S, 2, "v") == ((S - 2, 0), (S - 1, 1))  # the turn stays on the last stage
    assert neighbours(0, 1, S, 2, "v") == ((1, 1), None)  # the first stage ends the model
    with pytest.raises(ValueError, match="holds 2 chunks a stage"):
        position(0, S, 3, "v")


@pytest.mark.parametrize("S,M", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_zbv_runs_every_action_once_at_1f1bs_peak_memory_and_beats_izb(S: int, M: int) -> None:
    """Every F, I and W once per chunk; at most 2S half-stage activations held anywhere (S whole stages,
    1F1B's peak on its first stage); less idle than interleaved zero-bubble over the same two chunks."""
    zbv = get_schedule("zbv")
    for s in range(S):
        order = zbv.compute_order(S, M, s, 2)
        assert sorted((a.kind.value, a.chunk, a.micro_batch) for a in order) == sorted(
            (k, v, m) for k in "FIW" for v in range(2) for m in range(M))
    a = simulate(zbv, S, M, virtual_stages=2, forward_s=1.0, backward_s=2.0)
    assert max(a.peak_in_flight) <= 2 * S
    if M >= S:
        assert max(a.peak_in_flight) / 2 <= max(simulate(OneFOneB(), S, M).peak_in_flight)
    if M % S == 0:
        b = simulate(get_schedule("interleaved-zero-bubble"), S, M, virtual_stages=2, forward_s=1.0, backward_s=2.0)
        assert a.bubble_overall < b.bubble_overall
    if (S, M) == (4, 8):  # 25.5 units of F=1, I=W=1 a chunk... against IZB's 27 and 1F1B's 33
        assert a.makespan == pytest.approx(25.5) and a.bubble_overall == pytest.approx(1.5 / 25.5)


@pytest.mark.parametrize("S,M", [(2, 4), (3, 5), (4, 8)])
def test_zbv_talks_to_neighbours_only_and_turns_round_in_memory(S: int, M: int) -> None:
    sch = get_schedule("zbv")
    programs = [sch.program(S, M, s, 2) for s in range(S)]
    flip = {Kind.SEND_FORWARD: Kind.RECV_FORWARD, Kind.SEND_BACKWARD: Kind.RECV_BACKWARD}
    for s in range(S):
        peers = {b.peer_stage for b in programs[s] if isinstance(b, P2PBatch)}
        assert peers <= {s - 1, s + 1} and s not in peers
        for peer in peers:
            mine = [b for b in programs[s] if isinstance(b, P2PBatch) and b.peer_stage == peer]
            theirs = [b for b in programs[peer] if isinstance(b, P2PBatch) and b.peer_stage == s]
            assert [sorted((flip[x.kind].value, x.micro_batch) for x in a.actions if x.kind in flip) for a in mine] == [
                sorted((x.kind.value, x.micro_batch) for x in b.actions if x.kind not in flip) for b in theirs]
    sent = sum(1 for p in programs for b in p if isinstance(b, P2PBatch) for a in b.actions if a.kind in flip)
    assert sent == 2 * M * (2 * S - 2)  # every hand-over but the last stage's turn, both directions


@pytest.mark.parametrize("S,M", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (8, 16), (8, 32)])
def test_dualpipev_runs_every_micro_batch_once_each_way_in_its_phases(S: int, M: int) -> None:
    """Every forward once per chunk and every backward once (whole, or I then W); the orders play without a
    deadlock (``rounds`` raises one); neighbours only; 2S + 1 chunk activations held at most (ZB-V: 2S)."""
    from hal.parallel.schedules.interleaved import rounds

    sch = get_schedule("dualpipev")
    for s in range(S):
        order = sch.compute_order(S, M, s, 2)
        forwards = sorted((a.chunk, a.micro_batch) for a in order if a.kind is Kind.FORWARD)
        backwards = sorted((a.chunk, a.micro_batch) for a in order if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT))
        assert forwards == backwards == sorted((c, m) for c in range(2) for m in range(M))
        halves = [(a.chunk, a.micro_batch) for a in order if a.kind is Kind.BACKWARD_INPUT]
        weights = [(a.chunk, a.micro_batch) for a in order if a.kind is Kind.BACKWARD_WEIGHT]
        # split: phase 3's and 7's S - s - 1 each, and both chunks in phase 6's second half; W in I's order
        assert halves == weights and len(halves) == 2 * (S - s - 1) + 2 * ((s + 1) - (s + 1) // 2)
        whole = [a for a in order if a.kind is Kind.BACKWARD]
        assert len(whole) + len(halves) == 2 * M
    rounds(sch, S, M, 2)
    sim = simulate(sch, S, M, virtual_stages=2, forward_s=1.0, backward_s=2.0)
    assert max(sim.peak_in_flight) == 2 * S + 1  # ZB-V's 2S chunk activations and the one a pair adds
    assert sim.makespan < simulate(OneFOneB(), S, M).makespan
    programs = [sch.program(S, M, s, 2) for s in range(S)]
    for s in range(S):
        assert {b.peer_stage for b in programs[s] if isinstance(b, P2PBatch)} <= {s - 1, s + 1}
        # the steady state's pairs (phases 4 and 5), each a forward and the other chunk's whole backward, ready together
        pairs = [step for step in programs[s] if isinstance(step, Overlap)]
        assert len(pairs) == len(sch.pairs(S, M, s)) == 2 * (M - 2 * S + s + 1) + (S - s - 1)
        assert all(p.backward.kind is Kind.BACKWARD and p.forward.chunk != p.backward.chunk for p in pairs)
        assert compute_actions(programs[s]) == sch.compute_order(S, M, s, 2)


def test_dualpipev_needs_two_micro_batches_a_stage() -> None:
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import validate_plan

    with pytest.raises(ConfigError, match="dualpipev needs at least 2 x the 2 stages = 4 micro-batches, the plan has 3"):
        validate_plan(parse_plan(_interleaved_plan(schedule="dualpipev", micro_batches=3)), ModelConfig(num_layers=4),
                      world_size=None, check_backends=False)
    validate_plan(parse_plan(_interleaved_plan(schedule="dualpipev", micro_batches=4)), ModelConfig(num_layers=4),
                  world_size=None, check_backends=False)


def test_zbv_simulation_charges_no_transfer_at_the_turn() -> None:
    slow = simulate(get_schedule("zbv"), 2, 4, virtual_stages=2, p2p_s=0.5)
    # forward of micro-batch 0 reaches the last stage's second chunk after one transfer, not two
    turn = next(sp for sp in slow.timeline if sp.stage == 1 and sp.action == Action(Kind.FORWARD, 0, 1))
    first = next(sp for sp in slow.timeline if sp.stage == 1 and sp.action == Action(Kind.FORWARD, 0, 0))
    assert first.start == pytest.approx(0.5 + 0.5) and turn.start == pytest.approx(first.end)


@pytest.mark.parametrize("over,message", [
    ({"virtual_stages": 3, "stages": [{"backend": "cpu", "devices": 1, "layers": 3},
                                      {"backend": "cpu", "devices": 1, "layers": 3}]},
     "zbv places exactly 2 chunks on every stage .a V.; set parallel.virtual_stages: 2 .got 3."),
    ({"virtual_stages": 1}, "set parallel.virtual_stages ≥ 2"),
    ({"stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}, "zbv needs at least 2 stages"),
])
def test_plan_refuses_what_zbv_cannot_run(over: dict, message: str) -> None:
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import validate_plan

    raw = _interleaved_plan(schedule="zbv", micro_batches=3, **over)
    model = ModelConfig(num_layers=sum(s["layers"] for s in raw["stages"]))
    with pytest.raises(ConfigError, match=message):
        validate_plan(parse_plan(raw), model, world_size=None, check_backends=False)
    validate_plan(parse_plan(_interleaved_plan(schedule="zbv", micro_batches=3)), ModelConfig(num_layers=4),
                  world_size=None, check_backends=False)  # any number of micro-batches


def test_zbv_topology_puts_the_head_on_the_first_stage() -> None:
    from hal.parallel.config.topology import Topology

    plan = parse_plan(_interleaved_plan(schedule="zbv", stages=[{"backend": "cpu", "devices": 1, "layers": [2, 1]},
                                                                 {"backend": "cpu", "devices": 1, "layers": [1, 2]}]))
    topo = Topology.from_plan(plan)
    assert [m.layer_ranges for m in topo.stages] == [(range(0, 2), range(5, 6)), (range(2, 3), range(3, 5))]
    assert topo.last_stage == 0 == plan.last_stage and not topo.has_wrap
    assert [b["to_stage"] for b in topo.to_dict()["boundaries"]] == [1] and topo.to_dict()["placement"] == "v"


def test_host_clocks_set_the_pace_and_the_drain_comes_on_top() -> None:
    """An accelerator's host enqueues back to back and never waits; a device action starts no sooner than its host
    began it and ends no sooner than its host finished: a slow host sets the pace, the devices' drain adds."""
    plain = simulate(get_schedule("1f1b"), 3, 6, forward_s=1.0, backward_s=2.0)
    zero = simulate(get_schedule("1f1b"), 3, 6, forward_s=1.0, backward_s=2.0, host_forward_s=0.0, host_backward_s=0.0)
    assert zero.makespan == plain.makespan  # free hosts change nothing
    one = simulate(get_schedule("1f1b"), 1, 4, forward_s=1.0, backward_s=2.0, host_forward_s=3.0, host_backward_s=3.0)
    assert one.makespan == pytest.approx(4 * 6.0)  # one stage: its host alone
    S, M = 4, 8
    slow = simulate(get_schedule("1f1b"), S, M, forward_s=0.1, backward_s=0.2, host_forward_s=1.0, host_backward_s=1.0,
                    host_action_s=0.5)
    enqueue = M * (1.0 + 1.0 + 2 * 0.5)
    assert enqueue < slow.makespan <= enqueue + S * (0.1 + 0.2 + 1.0 + 0.5) + 1e-9  # the last backwards drain down the stages
    with pytest.raises(ValueError, match="host_forward_s"):
        simulate(get_schedule("1f1b"), 2, 2, host_forward_s=[1.0])


@pytest.mark.parametrize("name,V", [("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)])
def test_a_fixed_time_per_action_is_paid_by_every_compute_action(name: str, V: int) -> None:
    """``action_s`` lengthens each action whatever its share of the compute: the same as folding it into the
    per-micro-batch times once per action (V chunks; a split backward's I and W both pay it)."""
    S, M, a = 4, 8, 0.25
    fixed = simulate(get_schedule(name), S, M, forward_s=1.0, backward_s=2.0, virtual_stages=V, action_s=a)
    if name == "zero-bubble":  # I and W share the backward half and half (weight_share 0.5): each pays a
        folded = simulate(get_schedule(name), S, M, forward_s=1.0 + a, backward_s=2.0 + 2 * a, virtual_stages=V)
    else:
        folded = simulate(get_schedule(name), S, M, forward_s=1.0 + V * a, backward_s=2.0 + V * a, virtual_stages=V)
    assert fixed.makespan == pytest.approx(folded.makespan)
    assert fixed.makespan > simulate(get_schedule(name), S, M, forward_s=1.0, backward_s=2.0, virtual_stages=V).makespan
    with pytest.raises(ValueError, match="action_s"):
        simulate(get_schedule(name), S, M, action_s=-1.0, virtual_stages=V)
