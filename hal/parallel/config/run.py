"""The run config: the whole YAML file of a training run — hal's keys plus ``model:``, ``parallel:`` and ``train:``.

``hal.config`` reads the file and checks the top level; the sections are parsed here with the same
schema machinery (``hal.config.schema``): ``model:`` by ``ModelConfig``, ``parallel:`` by ``parse_parallel``
(``parallel.config.replicas``: listed replicas, or one plan as the set of one, each plan checked against the
model), and ``train:`` declared below. Every problem is one ``ConfigError`` line, before any process starts.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from hal.config import HalConfig, limits
from hal.config.schema import Choice, Custom, Flag, NonNegativeInt, Nullable, Number, PathStr, PositiveInt, did_you_mean, key, parse_section
from hal.errors import ConfigError
from hal.parallel.config.hf_config import model_keys_from_hf
from hal.parallel.config.model import ModelConfig, weights_source
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.planned import Planned, read_planned
from hal.parallel.config.replicas import ReplicatedPlan, parse_parallel, validate_replicated

DATA_SOURCES: tuple[str, ...] = ("synthetic", "corpus")  # built in; any path ending in .bin is a token file
MAX_VALIDATION = 0.5
LR_SCHEDULES = ("constant", "cosine", "linear")  # after warm-up (``loop.optim_schedule``)


def _data_source(origin: str, key: str, value: Any) -> str:
    """A built-in source, or a token file: a path ending in ``.bin`` (read and checked by check_training)."""
    if isinstance(value, str) and (value in DATA_SOURCES or (value.endswith(".bin") and len(value) > len(".bin"))):
        return value
    hint = did_you_mean(value, DATA_SOURCES) if isinstance(value, str) else ""
    raise ConfigError(f"{origin}: key '{key}': {value!r} is not allowed{hint}; use one of {', '.join(DATA_SOURCES)}, "
                      "or a token file path ending in .bin (see hal data prepare)")


def _fraction(origin: str, key: str, value: Any) -> float:
    """A share of the token file held out for validation: 0 ≤ value < 0.5 (training keeps the larger part)."""
    number: float = Number(positive=False).check(origin, key, value, "validation: 0.05")
    if number >= MAX_VALIDATION:
        raise ConfigError(f"{origin}: key '{key}' is {number}, not below {MAX_VALIDATION}: training must keep most of the "
                          "tokens; e.g. validation: 0.05")
    return number


@dataclass(frozen=True)
class TrainConfig:
    """The ``train:`` section: how long, how fast, on what data, and where results go."""

    steps: int = key(PositiveInt(limits.STEPS), 20)
    lr: float = key(Number(positive=True), 1e-3)
    seed: int = key(NonNegativeInt(limits.SEED), 0)
    weight_decay: float = key(Number(positive=False), 0.0)  # AdamW's, on matrices only (not norms, not biases)
    warmup_steps: int = key(NonNegativeInt(limits.STEPS), 0)  # linear lr warm-up from 0 (parallel.loop.optim_schedule)
    lr_schedule: str = key(Choice(LR_SCHEDULES), "constant")  # after warm-up: constant | cosine | linear decay
    min_lr: float = key(Number(positive=False), 0.0)  # where cosine / linear decay ends, at the last step
    grad_clip: float | None = key(Nullable(Number(positive=True)), None, example="grad_clip: 1.0")  # global norm
    # synthetic | corpus (the byte-level text shipped with the repository) | PATH.bin (a token file: hal data prepare)
    data: str = key(Custom(_data_source), "synthetic")
    # the last fraction of a token file's tokens, held out for validation (training never draws from it)
    validation: float = key(Custom(_fraction), 0.0, example="validation: 0.05")
    # evaluate on the validation part every N steps (loss and perplexity in the log); None: never
    eval_every: int | None = key(Nullable(PositiveInt(limits.STEPS)), None, example="eval_every: 50")
    eval_batches: int = key(PositiveInt(limits.MICRO_BATCHES), 1, example="eval_batches: 4")  # global batches per evaluation
    seq_len: int | None = key(Nullable(PositiveInt(limits.SEQUENCE)), None, example="seq_len: 64")  # tokens per row; None means model.max_seq_len
    log_file: str | None = key(Nullable(PathStr()), None)  # per-step JSON lines (default: <run dir>/train.jsonl)
    # the step lines' scalars also as a TensorBoard event file in <run dir>/tensorboard (needs the tensorboard package)
    tensorboard: bool = key(Flag(), False)
    checkpoint_dir: str | None = key(Nullable(PathStr()), None)  # device-agnostic checkpoints (default: <run dir>/checkpoints)
    # save every N steps as well as at the end (None: at the end only)
    checkpoint_every: int | None = key(Nullable(PositiveInt(limits.STEPS)), None, example="checkpoint_every: 10")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_train(raw: Any, origin: str = "config") -> TrainConfig:
    """The ``train:`` section (absent means the defaults)."""
    if raw is None:
        return TrainConfig()
    train: TrainConfig = parse_section(origin, "train", raw, TrainConfig)
    return train


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs from its YAML file, parsed and validated."""

    origin: str
    hal: HalConfig  # backend, devices, precision, fallback (and the raw sections)
    model: ModelConfig
    replicas: ReplicatedPlan  # the ``parallel:`` section: listed replicas, or a plain plan as the set of one
    train: TrainConfig
    init_from: str | None = None  # a Hugging Face checkpoint directory the weights come from (model.weights / --init-from)
    planned: Planned | None = None  # the planner's prediction a written plan keeps (``planner.planned``)

    @property
    def plan(self) -> ParallelPlan:
        """The plan of a run of one replica (``ReplicatedPlan.plan``: several replicas have several)."""
        return self.replicas.plan

    @property
    def world_size(self) -> int:
        """Ranks of the whole run: every replica's."""
        return self.replicas.world_size

    def plans(self) -> list[tuple[str, ParallelPlan]]:
        """Each plan of the run with the config section naming it: ("parallel", plan), or one per replica."""
        return [(r.where, r.plan) for r in self.replicas.replicas]


def check_same_model(directory: str | os.PathLike[str], model: ModelConfig, where: str) -> None:
    """``--init-from DIR``: DIR's config.json describes this run's model (any sequence length): one line naming a difference."""
    theirs = ModelConfig.from_mapping({**model_keys_from_hf(str(directory), where), "max_seq_len": model.max_seq_len}, where)
    mine, other = model.to_dict(), theirs.to_dict()
    for name, value in mine.items():
        if other[name] != value:
            raise ConfigError(f"{where}: its config.json gives model.{name} {other[name]!r} but the run's model has {value!r}; "
                              "use model: {hf: DIR, weights: true} or make the model section match")


def every_stage_on(parallel: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """The ``parallel:`` section with every stage (of the plan, or of each replica) on ``backend``."""
    def plan(body: Any) -> Any:
        if not isinstance(body, Mapping) or not isinstance(body.get("stages"), list):
            return body  # the section's own checks name what is wrong with it
        return {**body, "stages": [{**s, "backend": backend} if isinstance(s, Mapping) else s for s in body["stages"]]}

    out = plan(dict(parallel))
    if isinstance(out.get("replicas"), list):
        out["replicas"] = [plan(r) for r in out["replicas"]]
    return out


def load_run_config(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    check_backends: bool = True,
    single_host: bool = True,
    env: Mapping[str, str] | None = None,
    init_from: str | None = None,
    backend: str | None = None,
) -> RunConfig:
    """Read ``path`` (hal keys + model/parallel/train) and validate it; one ConfigError line otherwise.

    ``backend`` (``hal train --backend X``): every stage of every replica runs on X, whatever the file names — the
    model migrated by one flag; the stages keep their devices, grids and layers.

    ``init_from`` (``hal train --init-from DIR``) means ``model: {hf: DIR, weights: true}``: DIR's
    config.json must describe the section's model. The weight files are checked by ``hal train``.
    """
    from hal.config import load_config

    origin = str(path)
    config = load_config(path, env=env, overrides={"backend": backend} if backend else None)
    if backend == "auto":  # the best backend available here, as hal run and hal launch pick it
        from hal.selection import choose_backend

        backend = choose_backend("auto")[0].name
        config = replace(config, backend=backend)
    if config.parallel is None:
        raise ConfigError(f"{origin}: no 'parallel' section; add one with a list of stages (see examples/hetero_cpu.yaml)")
    if backend:
        config = replace(config, parallel=every_stage_on(config.parallel, backend))
    model = ModelConfig.from_mapping(config.model or {}, origin)
    weights = weights_source(config.model, origin)
    if init_from is not None:
        check_same_model(init_from, model, f"--init-from {init_from}")
        weights = init_from
    replicas = parse_parallel(config.parallel, origin)
    train = parse_train(config.train, origin)
    if train.seq_len is not None and train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"{origin}: train.seq_len {train.seq_len} exceeds model.max_seq_len {model.max_seq_len}; "
            f"lower seq_len or raise max_seq_len"
        )
    _check_data(origin, train, model)
    validate_replicated(replicas, model, world_size=world_size, check_backends=check_backends, seq_len=train.seq_len,
                        single_host=single_host, origin=origin, precision=config.precision)
    _check_replica_loop(origin, replicas, train)
    if replicas.several and config.planned is not None:
        raise ConfigError(f"{origin}: a 'planned:' section records the planner's prediction for one plan, and this "
                          "file lists replicas; remove it")
    planned = None if replicas.several else read_planned(config.planned, replicas.plan, origin)
    return RunConfig(origin, config, model, replicas, train, weights, planned)


def _check_replica_loop(origin: str, replicas: ReplicatedPlan, train: TrainConfig) -> None:
    """What the replicated loop cannot do right, one line each: local SGD checkpoints only where the replicas agree
    (that the run ends at a meeting depends on --steps: the preflight's 'loop' check)."""
    every = replicas.sync.every
    if every > 1 and train.checkpoint_every and train.checkpoint_every % every:
        raise ConfigError(f"{origin}: train.checkpoint_every {train.checkpoint_every} is not a multiple of "
                          f"parallel.replica_sync.every {every}: between meetings the replicas differ; checkpoint every "
                          f"{every * max(1, train.checkpoint_every // every)} steps")


def _check_data(origin: str, train: TrainConfig, model: ModelConfig) -> None:
    """The corpus is byte-level text: exactly 256 token ids, so the model's vocabulary must be 256; only a
    token file has a part to hold out. (A token file itself is read and checked by check_training.)"""
    if train.validation and not train.data.endswith(".bin"):
        raise ConfigError(f"{origin}: train.validation {train.validation} holds out the end of a token file, but "
                          f"train.data is {train.data!r}; set validation: 0 or train on a .bin token file")
    if train.data == "corpus" and model.vocab_size != 256:
        raise ConfigError(
            f"{origin}: train.data 'corpus' is byte-level text (token ids 0..255) but model.vocab_size is "
            f"{model.vocab_size}; set model.vocab_size: 256 or use data: synthetic"
        )
