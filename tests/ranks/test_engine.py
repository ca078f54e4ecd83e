"""The heterogeneous pipeline engine equals a single-process run of the same model, seed and data.

Every plan's first loss (1e-5) and step-1 gradients (rtol 1e-5) are checked against the single process. The
first plan of each schedule (1F1B, GPipe, zero-bubble, interleaved 1F1B, interleaved zero-bubble, ZB-V, DualPipeV) trains
12 AdamW steps within 1e-4; its layout variants train 3 (what a layout can break — a boundary, a tied pair, a
sharded optimizer — shows from step 2 on; drift over many steps belongs to the schedule), which keeps the
suite inside its time on two cores."""
from __future__ import annotations

import pytest
import torch

from ..dist_harness import ok_values, run_world
from ..engine_cases import reference

PLANS = {
    "a: 2 stages 3/1, tp2 -> dp2, 1f1b": {
        "schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
        "stages": [{"backend": "cpu", "devices": 2, "layers": 3, "tp": 2},
                   {"backend": "cpu", "devices": 2, "layers": 1, "dp": 2}]},
    "b: 2 stages, dp2 -> tp2 sp, 1f1b": {
        "schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
        "stages": [{"backend": "cpu", "devices": 2, "layers": 2, "dp": 2},
                   {"backend": "cpu", "devices": 2, "layers": 2, "tp": 2, "sp": True}]},
    "c: 3 stages dp1/dp2/dp1, gpipe": {
        "schedule": "gpipe", "micro_batches": 3, "micro_batch_size": 2,
        "stages": [{"backend": "cpu", "devices": 1, "layers": 1},
                   {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2},
                   {"backend": "cpu", "devices": 1, "layers": 1}]},
    "d: 1 stage tp2 x dp2": {
        "schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
        "stages": [{"backend": "cpu", "devices": 4, "layers": 4, "tp": 2, "dp": 2}]},
}
TIED = "e: tied embeddings, 2 stages tp2 -> dp2 (the two copies' gradients summed)"
PLANS[TIED] = PLANS["a: 2 stages 3/1, tp2 -> dp2, 1f1b"]
# The fused head (parallel.models.fused_head) against the same unfused single-process reference: the
# vocab-parallel chunked path (tp2 sp last stage) and the registry's linear_cross_entropy (tp1, tied).
FUSED_TP = "f: fused head on a tp2 sp last stage (vocab-parallel linear + cross-entropy)"
PLANS[FUSED_TP] = {**PLANS["b: 2 stages, dp2 -> tp2 sp, 1f1b"], "fused_head": True}
FUSED_TIED = "g: fused head, tied embeddings, tp1 dp2 last stage"
PLANS[FUSED_TIED] = {**PLANS["a: 2 stages 3/1, tp2 -> dp2, 1f1b"], "fused_head": True}
# Zero-bubble (split backward, weight gradients deferred): the tp -> dp and dp -> tp boundaries,
# a 3-stage uneven split with a dp2 middle, and tied embeddings.
for key in ("a: 2 stages 3/1, tp2 -> dp2, 1f1b", "b: 2 stages, dp2 -> tp2 sp, 1f1b"):
    PLANS[f"zb {key[:1]}: {key[3:].replace('1f1b', 'zero-bubble')}"] = {**PLANS[key], "schedule": "zero-bubble"}
PLANS["zb c: 3 stages 1/2/1, dp1/dp2/dp1, zero-bubble"] = {**PLANS["c: 3 stages dp1/dp2/dp1, gpipe"], "schedule": "zero-bubble"}
ZB_TIED = "zb e: tied embeddings, 2 stages tp2 -> dp2, zero-bubble"
PLANS[ZB_TIED] = {**PLANS[TIED], "schedule": "zero-bubble"}
# Interleaved 1F1B: two chunks per stage, uneven chunks, the wrap-around link crossing tp -> dp and
# dp -> tp sp layouts, three stages with a dp2 middle (a separate wrap communicator), tied embeddings.
IL_UNEVEN = "il a: interleaved, 2 stages x 2 chunks [2,1]/[1,2], tp2 -> dp2"
PLANS[IL_UNEVEN] = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
                    "stages": [{"backend": "cpu", "devices": 2, "layers": [2, 1], "tp": 2},
                               {"backend": "cpu", "devices": 2, "layers": [1, 2], "dp": 2}]}
PLANS["il b: interleaved, 2 stages x 2 chunks, dp2 -> tp2 sp"] = {
    **PLANS["b: 2 stages, dp2 -> tp2 sp, 1f1b"], "schedule": "interleaved-1f1b", "virtual_stages": 2}
IL_THREE = "il c: interleaved, 3 stages x 2 chunks, dp1/dp2/dp1"
PLANS[IL_THREE] = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 3, "micro_batch_size": 2,
                   "stages": [{"backend": "cpu", "devices": 1, "layers": 2},
                              {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2},
                              {"backend": "cpu", "devices": 1, "layers": 2}]}
IL_TIED = "il d: interleaved, tied embeddings, uneven chunks, tp2 -> dp2"
PLANS[IL_TIED] = PLANS[IL_UNEVEN]
IL_BRIDGED = "il e: interleaved, 3 stages x 2 chunks, every stage its own island (every link bridged)"
PLANS[IL_BRIDGED] = PLANS[IL_THREE]
ISLANDS = {IL_BRIDGED: [0, 1, 1, 2]}  # bridged links post blocking batches: the link order keeps the ring free of waits
IZB_UNEVEN = "izb a: interleaved zero-bubble, 2 stages x 2 chunks [2,1]/[1,2], tp2 -> dp2, tied"
PLANS[IZB_UNEVEN] = {**PLANS[IL_UNEVEN], "schedule": "interleaved-zero-bubble"}
IZB_THREE = "izb c: interleaved zero-bubble, 3 stages x 2 chunks, dp1/dp2/dp1"
PLANS[IZB_THREE] = {**PLANS[IL_THREE], "schedule": "interleaved-zero-bubble"}
PLANS["izb b: interleaved zero-bubble, 2 stages x 2 chunks, dp2 -> tp2 sp"] = {
    **PLANS["b: 2 stages, dp2 -> tp2 sp, 1f1b"], "schedule": "interleaved-zero-bubble", "virtual_stages": 2}
# ZB-V: two chunks a stage in a V (the first stage holds the embedding and the head, the last stage
# turns each micro-batch round in memory): tp -> dp and dp -> tp sp layouts, uneven chunks, tied
# embeddings on one stage, three stages with a dp2 middle, every link bridged.
ZBV_UNEVEN = "zbv a: zbv, 2 stages x 2 chunks [2,1]/[1,2], tp2 -> dp2, tied"
PLANS[ZBV_UNEVEN] = {**PLANS[IL_UNEVEN], "schedule": "zbv"}
PLANS["zbv b: zbv, 2 stages x 2 chunks, dp2 -> tp2 sp"] = {
    **PLANS["b: 2 stages, dp2 -> tp2 sp, 1f1b"], "schedule": "zbv", "virtual_stages": 2}
ZBV_THREE = "zbv c: zbv, 3 stages x 2 chunks, dp1/dp2/dp1, 5 micro-batches"
PLANS[ZBV_THREE] = {**PLANS[IL_THREE], "schedule": "zbv", "micro_batches": 5}
ZBV_BRIDGED = "zbv d: zbv, 3 stages x 2 chunks, every stage its own island"
PLANS[ZBV_BRIDGED] = PLANS[ZBV_THREE]
ISLANDS[ZBV_BRIDGED] = [0, 1, 1, 2]
# DualPipeV: ZB-V's V in DeepSeek's phase order (whole backwards paired with forwards, split ones in the cool-down).
DPV_UNEVEN = "dpv a: dualpipev, 2 stages x 2 chunks [2,1]/[1,2], tp2 -> dp2, tied"
PLANS[DPV_UNEVEN] = {**PLANS[IL_UNEVEN], "schedule": "dualpipev"}
DPV_BRIDGED = "dpv b: dualpipev, 3 stages x 2 chunks, dp1/dp2/dp1, 6 micro-batches, every stage its own island"
PLANS[DPV_BRIDGED] = {**PLANS[IL_THREE], "schedule": "dualpipev", "micro_batches": 6}
ISLANDS[DPV_BRIDGED] = [0, 1, 1, 2]
# Activation checkpointing under a split backward: the recompute (in a pair's backward, beside the forward's thread,
# and in the cool-down's I) builds the split linears the forward built, or torch's checkpoint refuses it.
DPV_CHECKPOINTED = "dpv c: dualpipev, 2 stages x 2 chunks, every layer checkpointed"
PLANS[DPV_CHECKPOINTED] = {"schedule": "dualpipev", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
                           "stages": [{"backend": "cpu", "devices": 1, "layers": 2, "checkpoint": True},
                                      {"backend": "cpu", "devices": 1, "layers": 2, "checkpoint": True}]}
# Compiled layers (aot_eager on the cpu) under ZB-V: each chunk's first forward eager, the linears eager between the
# layers' graphs so their weight gradients wait for W (the only graph breaks), no lru_cache warning from the rope tables.
ZBV_COMPILED = "zbv e: zbv, compiled layers, 2 stages x 2 chunks [2,1]/[1,2], tp2 -> dp2, tied"
PLANS[ZBV_COMPILED] = {**PLANS[ZBV_UNEVEN], "compile": True, "compile_backend": "aot_eager"}
# Orders played from measured times (parallel.order: measured): times under which the play's order differs from the unit
# one (tests/unit/test_stage_times.py checks that it does), the transfers derived by playing the order in rounds. The
# interleaved zero-bubble run switches after its first step, as hal train does after its calibration step (4 steps on it).
TIMED: dict[str, tuple[dict, int]] = {}
IZB_TIMED = "timed izb a: interleaved zero-bubble, order from link-heavy times after step 1, tp2 -> dp2, tied"
PLANS[IZB_TIMED] = PLANS[IZB_UNEVEN]
LINK_HEAVY_2X2 = {"forward": [[0.5, 0.5]] * 2, "backward_input": [[0.5, 0.5]] * 2, "backward_weight": [[0.5, 0.5]] * 2,
                  "links": [3.0, 3.0]}
TIMED[IZB_TIMED] = (LINK_HEAVY_2X2, 1)
ZBV_TIMED = "timed zbv d: zbv, 3 stages x 2 chunks, every stage its own island, order from uneven stage times"
PLANS[ZBV_TIMED] = PLANS[ZBV_THREE]
ISLANDS[ZBV_TIMED] = [0, 1, 1, 2]
TIMED[ZBV_TIMED] = ({"forward": [[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]], "backward_input": [[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]],
                     "backward_weight": [[0.15, 0.15]] * 3, "links": [0.5, 0.5]}, 0)
ZB_TIMED = "timed zb c: zero-bubble, 3 stages 1/2/1, dp1/dp2/dp1, every stage its own island, transfers of a timed play"
PLANS[ZB_TIMED] = PLANS["zb c: 3 stages 1/2/1, dp1/dp2/dp1, zero-bubble"]
ISLANDS[ZB_TIMED] = [0, 1, 1, 2]
TIMED[ZB_TIMED] = ({"forward": [[3.0], [1.0], [1.0]], "backward_input": [[3.0], [1.0], [1.0]], "backward_weight": [[3.0], [1.0], [1.0]],
                    "links": [2.0, 2.0]}, 0)
LAYERS = {ZBV_COMPILED: 6, IZB_TIMED: 6, ZBV_TIMED: 6, DPV_UNEVEN: 6, DPV_BRIDGED: 6, IL_UNEVEN: 6, IL_THREE: 6, IL_TIED: 6,
          IL_BRIDGED: 6, IZB_UNEVEN: 6, IZB_THREE: 6, ZBV_UNEVEN: 6, ZBV_THREE: 6, ZBV_BRIDGED: 6}
TIED_PLANS = {ZBV_COMPILED, TIED, FUSED_TIED, ZB_TIED, IL_TIED, IZB_UNEVEN, ZBV_UNEVEN, DPV_UNEVEN, IZB_TIMED}
STEPS, LR = 8, 3e-3  # AdamW steps of the long runs (one plan per schedule): drift shows within them
VARIANT_STEPS = 3
LONG_RUNS = {"a: 2 stages 3/1, tp2 -> dp2, 1f1b", "c: 3 stages dp1/dp2/dp1, gpipe", "zb a: 2 stages 3/1, tp2 -> dp2, zero-bubble",
             IL_UNEVEN, IZB_UNEVEN, ZBV_UNEVEN, DPV_UNEVEN}  # one plan per schedule: STEPS steps
assert LONG_RUNS <= set(PLANS) and {p["schedule"] for n, p in PLANS.items() if n in LONG_RUNS} == {
    p["schedule"] for p in PLANS.values()}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_single_process(name: str) -> None:
    plan = PLANS[name]
    tied = name in TIED_PLANS
    world = sum(s["devices"] for s in plan["stages"])
    layers = LAYERS.get(name, 4)
    steps = STEPS if name in LONG_RUNS else VARIANT_STEPS
    ref = reference(plan, STEPS, LR, tied=tied, num_layers=layers)  # cached, shared: a variant reads its first steps
    times, switch_at = TIMED.get(name, (None, 0))
    pairs = plan["schedule"] == "dualpipev"  # its pairs at once on every stage that can
    results = run_world("tests.engine_cases", "engine_run", world, deadline_s=300, plan_raw=plan, steps=steps, lr=LR,
                        tied=tied, num_layers=layers, islands=ISLANDS.get(name), times=times, switch_at=switch_at,
                        pair_overlap="1" if pairs else None)
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [outcome[1] for outcome in results.values()]
    losses = [v["losses"] for v in values if v["losses"][0] is not None]  # the stage holding the head (zbv: the first)
    head = plan["stages"][0 if plan["schedule"] in ("zbv", "dualpipev") else -1]  # the V: the loss on the first stage
    assert len(losses) == head["devices"], f"{len(losses)} ranks reported a loss; the head's stage has {head['devices']}"
    for run in losses:
        assert len(run) == steps, (len(run), steps)
        assert abs(run[0] - ref["losses"][0]) <= 1e-5 * abs(ref["losses"][0]), (run[0], ref["losses"][0])
        for got, want in zip(run, ref["losses"]):
            assert abs(got - want) <= 1e-4 * abs(want), (run, ref["losses"])
    seen = set()
    for v in values:
        for pname, grad in v["grads"].items():
            want = ref["grads"][pname]
            got = torch.tensor(grad, dtype=want.dtype)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"{name}: gradient of {pname}")
            seen.add(pname)
    assert seen == set(ref["grads"]), set(ref["grads"]) - seen
    if plan.get("compile"):
        for v in values:
            assert v["compiled"]["graphs"] >= 1 and v["compiled"]["lru_warnings"] == 0, v["compiled"]
            eager_on_purpose = ("_apply_split_linear", "_apply_mapping")  # split linears; tp collectives (tp2 stage)
            assert all(any(f in reason for f in eager_on_purpose) for reason in v["compiled"]["breaks"]), v["compiled"]["breaks"]
    if pairs:  # a tp stage runs its pairs one after the other (its collectives), any other at once, every step
        for v in values:
            how, ran = v["pairs"]
            tp = plan["stages"][v["coord"][0]].get("tp", 1)
            if tp > 1:
                assert how.startswith("in turn: tensor parallelism") and ran == 0, v["pairs"]
            else:
                assert how == "at once" and ran >= steps, v["pairs"]
    if times is not None:  # time_links: every stage but the last times its boundary (a loop's last stage: the wrap, not it)
        S = len(plan["stages"])
        for v in values:
            stage = v["coord"][0]
            assert (v["link"] is None) == (stage == S - 1) and (v["link"] is None or v["link"] > 0), (stage, v["link"])


def test_sends_overlap_compute(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stage 0 computes every forward before stage 1 receives any (see ``engine_cases.overlap_run``)."""
    results = run_world("tests.engine_cases", "overlap_run", 2, deadline_s=120, gate=str(tmp_path / "gate"), micro_batches=4)
    values = ok_values(results, 2)
    ref = reference({"schedule": "gpipe", "micro_batches": 4, "micro_batch_size": 2,
                     "stages": [{"backend": "cpu", "devices": 2, "layers": 4}]}, 1, 0.0)
    assert values[0] is None and abs(values[1] - ref["losses"][0]) <= 1e-5 * ref["losses"][0]


def test_loss_fn_is_the_engines_to_choose() -> None:
    """The last stage returns logits; ``loss_fn`` turns each micro-batch's into its loss (default: the token mean)."""
    from hal.parallel.models.stage import full_model

    from ..engine_cases import MODEL, batch, first_half_loss

    M = 3
    values = ok_values(run_world("tests.engine_cases", "loss_fn_run", 1, deadline_s=120, micro_batches=M), 1)
    got = values[0]
    assert got["seen"] == [((2, MODEL.max_seq_len, MODEL.vocab_size), (2, MODEL.max_seq_len))] * M
    ref = reference({"schedule": "1f1b", "micro_batches": M, "micro_batch_size": 2,
                     "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}, 1, 0.0)
    assert abs(got["losses"]["default"] - ref["losses"][0]) <= 1e-5 * ref["losses"][0]
    model, tokens = full_model(MODEL, 0), batch(0, 0, M, 2, MODEL.max_seq_len, MODEL.vocab_size)
    with torch.no_grad():
        want = sum(float(first_half_loss(model(tokens[m, :, :-1]), tokens[m, :, 1:])) for m in range(M)) / M
    assert abs(got["losses"]["first_half"] - want) <= 1e-5 * want
    assert abs(want - ref["losses"][0]) > 1e-3  # the two losses differ: the test can tell them apart
