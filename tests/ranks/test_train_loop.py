"""The loop people expect: lr warm-up and decay, the whole pipeline's gradient norm clipped, no decay on norms."""
from __future__ import annotations

import glob
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hal.parallel.loop.optim_schedule import learning_rate

from ..conftest import run_hal
from ..dist_harness import ok_values, run_world
from ..engine_cases import reference

ROOT = Path(__file__).resolve().parents[2]


def test_warm_up_then_cosine_linear_or_constant() -> None:
    lr = lambda step, **kw: learning_rate(step, lr=1.0, steps=11, warmup_steps=2, **kw)  # noqa: E731
    assert [lr(s) for s in (0, 1)] == [0.5, 1.0]  # linear warm-up from 0, reaching lr at its last step
    assert lr(2, schedule="cosine", min_lr=0.1) == pytest.approx(1.0)
    assert lr(10, schedule="cosine", min_lr=0.1) == pytest.approx(0.1)  # the last step is min_lr
    assert lr(6, schedule="cosine", min_lr=0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr(6, schedule="linear") == pytest.approx(0.5) and lr(10, schedule="linear") == pytest.approx(0.0)
    assert lr(7) == 1.0  # constant after warm-up
    with pytest.raises(ValueError, match="use one of constant, cosine, linear"):
        lr(3, schedule="step")


# --- the global norm over stages, TP shards, dp replicas and a tied embedding ---------------------------------------
PLAN = {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
        "stages": [{"backend": "cpu", "devices": 2, "layers": 3, "tp": 2, "sp": True},
                   {"backend": "cpu", "devices": 2, "layers": 1, "dp": 2}]}


def norm_body(rank: int, world: int, tied: bool, max_norm: float = 1e9) -> Any:
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.loop.optim_schedule import clip_global_norm
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    from ..engine_cases import MODEL, batch, model_config

    plan = parse_plan(PLAN)
    topology = Topology.from_plan(plan)
    groups = build_mesh(topology, current_world(), validate=False, tied_embeddings=tied)  # as hal train runs it
    engine = build_engine(model_config(tied), plan, groups, backend=current_world().backend, seed=0,
                            device=torch.device("cpu"))
    engine.step(batch(0, 0, plan.micro_batches, plan.micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size))
    skip = frozenset({"embed.weight"}) if engine.module.needs_tied_grad_sync and not engine.first else frozenset()
    norm = clip_global_norm(engine.module, max_norm, tp_rank=engine.coord.tp, dp_rank=engine.coord.dp, skip=skip)
    if max_norm == 1e9:
        return norm
    from hal.parallel.models.shards import gather_full_grads

    return norm, {n: g.tolist() for n, g in gather_full_grads(engine.module).items()}


@pytest.mark.parametrize("tied", [False, True])
def test_the_clipped_norm_is_the_single_process_models(tied: bool) -> None:
    want = math.sqrt(sum(float(g.double().square().sum()) for g in reference(PLAN, 1, 1e-3, tied=tied)["grads"].values()))
    values = ok_values(run_world("tests.ranks.test_train_loop", "norm_body", 4, deadline_s=180, tied=tied), 4)
    for rank, got in values.items():
        assert got == pytest.approx(want, rel=1e-6), (rank, got, want)


def test_a_clipped_step_is_the_single_process_models_clipped_step() -> None:
    """Clipping engaged (max_norm a quarter of the norm): every rank's gradients, gathered to full shape, are the
    single-process gradients scaled by max_norm / norm — the step the single process would take."""
    ref = reference(PLAN, 1, 1e-3)["grads"]
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in ref.values()))
    values = ok_values(run_world("tests.ranks.test_train_loop", "norm_body", 4, deadline_s=180, tied=False,
                                 max_norm=norm / 4), 4)
    seen = set()
    for got_norm, grads in values.values():
        assert got_norm == pytest.approx(norm, rel=1e-6)
        for name, grad in grads.items():
            want = ref[name] * (norm / 4) / (got_norm + 1e-6)
            torch.testing.assert_close(torch.tensor(grad), want, rtol=1e-5, atol=1e-8, msg=name)
            seen.add(name)
    assert seen == set(ref)


# --- hal train: the log shows lr and grad_norm; norms and vectors are not decayed --------------------------------------
def test_hal_train_warms_up_decays_and_clips(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "examples" / "hetero_cpu.yaml").read_text())
    config["train"].update({"steps": 6, "lr": 1e-2, "warmup_steps": 2, "lr_schedule": "cosine", "min_lr": 1e-3,
                            "grad_clip": 0.5, "weight_decay": 0.1, "checkpoint_every": None})
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_hal("train", str(path), "--run-dir", str(tmp_path / "run"), "--json", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(glob.glob(str(tmp_path / "run" / "*.jsonl"))[0], encoding="utf-8")]
    want = [learning_rate(s, lr=1e-2, steps=6, warmup_steps=2, schedule="cosine", min_lr=1e-3) for s in range(6)]
    assert [r["lr"] for r in records] == pytest.approx(want)
    assert all(r["grad_norm"] > 0 for r in records)


def test_bad_loop_options_are_one_line(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "examples" / "hetero_cpu.yaml").read_text())
    for change, words in (({"min_lr": 1.0, "lr": 0.1}, "is above train.lr"),
                          ({"warmup_steps": 50, "steps": 10, "lr_schedule": "cosine"}, "lower warmup_steps")):
        bad = json.loads(json.dumps(config))
        bad["train"].update(change)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        done = run_hal("plan", str(path), timeout=120)
        assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1, done.stderr


# --- evaluation: forward only, the same loss as the training step, no gradients ------------------------------------
def eval_body(rank: int, world: int, schedule: str) -> dict[str, Any]:
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    from ..engine_cases import MODEL, batch

    plan = parse_plan({**PLAN, "schedule": schedule})
    topology = Topology.from_plan(plan)
    groups = build_mesh(topology, current_world(), validate=False)  # as hal train runs it
    engine = build_engine(MODEL, plan, groups, backend=current_world().backend, seed=0, device=torch.device("cpu"))
    tokens = batch(0, 3, plan.micro_batches, plan.micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size)
    evaluated = engine.evaluate(tokens)
    no_grads = all(p.grad is None for p in engine.module.parameters())
    trained = engine.step(tokens)
    return {"eval": None if evaluated is None else float(evaluated), "step": trained, "no_grads": no_grads}


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_evaluation_is_the_steps_loss_without_gradients(schedule: str) -> None:
    values = ok_values(run_world("tests.ranks.test_train_loop", "eval_body", 4, deadline_s=180, schedule=schedule), 4)
    last = [v for v in values.values() if v["step"] is not None]
    assert len(last) == 2 and all(v["no_grads"] for v in values.values())
    for v in last:
        assert v["eval"] == v["step"]  # the same forwards, bit for bit
