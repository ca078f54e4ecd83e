"""The one config schema: every section is declared once (dataclass fields with rules) and one validator
gives the same kind of line for the same kind of problem in every section."""
from __future__ import annotations

import pytest

from hal.config import KEYS, SECTIONS, HalConfig
from hal.config.schema import parse_section, section_specs
from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.config.run import TrainConfig

STAGE = {"backend": "cpu", "devices": 1, "layers": 4}


def test_every_section_is_declared_once_with_its_keys() -> None:
    assert KEYS == ("backend", "devices", "precision", "fallback") and SECTIONS == ("model", "parallel", "train", "cluster", "planned")
    assert list(section_specs(HalConfig)) == [*KEYS, *SECTIONS]  # origins is bookkeeping, not a key
    assert list(section_specs(ParallelPlan)) == ["stages", "schedule", "micro_batches", "micro_batch_size", "zero1",
                                                 "compile", "compile_backend", "fused_head", "virtual_stages", "order"]
    assert list(section_specs(StagePlan)) == ["backend", "devices", "layers", "tp", "dp", "sp", "checkpoint", "compile",
                                              "precision", "ep"]
    assert list(section_specs(TrainConfig)) == ["steps", "lr", "seed", "weight_decay", "warmup_steps", "lr_schedule", "min_lr",
                                                "grad_clip", "data", "validation", "eval_every", "eval_batches", "seq_len", "log_file",
                                                "tensorboard", "checkpoint_dir", "checkpoint_every"]
    assert [n for n, s in section_specs(StagePlan).items() if s.required] == ["backend", "devices", "layers"]


@pytest.mark.parametrize("cls, where, raw, needle", [
    (ModelConfig, "model", {"hiden_size": 64}, "unknown key 'model.hiden_size' (did you mean 'hidden_size'?); allowed keys in model:"),
    (TrainConfig, "train", {"stpes": 3}, "unknown key 'train.stpes' (did you mean 'steps'?); allowed keys in train:"),
    (ParallelPlan, "parallel", {"stages": [STAGE], "zero": True}, "unknown key 'parallel.zero' (did you mean 'zero1'?)"),
    (ModelConfig, "model", {"num_heads": 0}, "key 'model.num_heads' must be a positive integer, got 0; e.g. num_heads: 4"),
    (TrainConfig, "train", {"steps": True}, "key 'train.steps' must be a positive integer, got True; e.g. steps: 20"),
    (ParallelPlan, "parallel", {"stages": [{**STAGE, "tp": "2"}]}, "key 'parallel.stages[0].tp' must be a positive integer, got '2'; e.g. tp: 2"),
    (ModelConfig, "model", {"tie_embeddings": 1}, "key 'model.tie_embeddings' must be true or false, got 1"),
    (ParallelPlan, "parallel", {"stages": [STAGE], "schedule": 1}, "key 'parallel.schedule' must be a string, got int 1; use one of"),
    (ParallelPlan, "parallel", {"stages": [{"backend": "cpu", "layers": 4}]}, "'parallel.stages[0]' is missing key 'devices'"),
    (TrainConfig, "train", {"lr": -1}, "key 'train.lr' must be a positive number, got -1"),
])
def test_one_wording_per_kind_of_problem(cls: type, where: str, raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_section("f.yaml", where, raw, cls)
    assert str(info.value).startswith("f.yaml: ") and needle in str(info.value), str(info.value)


def test_defaults_and_derived_defaults_come_from_the_declaration() -> None:
    plan = parse_section("f.yaml", "parallel", {"stages": [STAGE, {**STAGE, "devices": 2, "dp": 2}]}, ParallelPlan)
    assert (plan.schedule.name, plan.micro_batches, plan.micro_batch_size, plan.zero1) == ("1f1b", 2, 2, False)
    assert parse_section("f.yaml", "model", {"rope_theta": "1e4"}, ModelConfig).rope_theta == 1e4  # YAML 1.1 reads 1e4 as text
    assert parse_section("f.yaml", "train", {}, TrainConfig) == TrainConfig()
