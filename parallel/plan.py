"""The parallel plan: which stage runs which layers, on which backend, with which intra-op grid.

The ``parallel:`` and ``train:`` sections of the hal config (``hal.config`` keeps them as plain
dicts) are parsed here into frozen dataclasses, and ``validate_plan`` checks a plan against the
model *before any process starts* — every problem is one ``ConfigError`` line naming the stage or
key, the value and the fix, so a bad plan never turns into a hang or a shape error on rank 5.

    parallel:
      schedule: 1f1b            # gpipe | 1f1b                      (default 1f1b)
      micro_batches: 8          # micro-batches per step           (default: number of stages)
      micro_batch_size: 4       # rows per micro-batch             (default: lcm of the stages' dp)
      zero1: false              # ZeRO-1 optimizer-state sharding inside each stage's dp group
      stages:                   # stage k owns the next `devices` global ranks (see parallel/topology.py)
        - {backend: cpu, devices: 2, layers: 3, tp: 2, sp: true}
        - {backend: cpu, devices: 2, layers: 1, dp: 2, checkpoint: true}

Meaning of the degrees (the engine relies on these):
- ``devices`` must equal ``tp * dp``: a stage's grid is exactly its devices, nothing idle.
- ``dp`` splits every micro-batch: each dp replica of a stage gets ``micro_batch_size / dp`` rows,
  so ``dp`` must divide ``micro_batch_size``. Stages may use different dp; boundary resharding
  moves rows between them.
- ``tp`` splits heads, kv-heads, hidden, FFN and vocab (Megatron column/row/vocab parallel), so it
  must divide each of them.
- ``sp`` (Megatron sequence parallelism) shards the sequence over the TP group outside attention
  and MLP; it needs ``tp >= 2`` (with tp 1 there is nothing to shard over, so asking for it is a
  mistake we report) and a sequence length divisible by ``tp``.
- ``1f1b`` needs ``micro_batches >= number of stages``: with fewer, the warm-up never fills the
  pipeline and the schedule degenerates; use ``gpipe`` for that.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from hal.config import HalConfig
from hal.errors import ConfigError

from .model_config import ModelConfig
from .schedules import schedule_names

DATA_SOURCES: tuple[str, ...] = ("synthetic", "corpus")
PARALLEL_KEYS: tuple[str, ...] = ("stages", "schedule", "micro_batches", "micro_batch_size", "zero1")
STAGE_KEYS: tuple[str, ...] = ("backend", "devices", "layers", "tp", "dp", "sp", "checkpoint")
STAGE_REQUIRED: tuple[str, ...] = ("backend", "devices", "layers")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its backend, its devices (= tp × dp ranks) and its share of the layers."""

    backend: str
    devices: int
    layers: int
    tp: int = 1
    dp: int = 1
    sp: bool = False
    checkpoint: bool = False  # activation checkpointing for this stage's layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ParallelPlan:
    """The whole hybrid strategy: stages in pipeline order, the schedule and the micro-batching."""

    stages: tuple[StagePlan, ...]
    schedule: str
    micro_batches: int
    micro_batch_size: int
    zero1: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: one per device of every stage."""
        return sum(s.devices for s in self.stages)

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step."""
        return self.micro_batches * self.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": [s.to_dict() for s in self.stages],
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "zero1": self.zero1,
        }


@dataclass(frozen=True)
class TrainConfig:
    """The ``train:`` section: how long, how fast, on what data, and where results go."""

    steps: int = 20
    lr: float = 1e-3
    seed: int = 0
    weight_decay: float = 0.0
    data: str = "synthetic"  # synthetic | corpus (the byte-level text shipped with the repository)
    seq_len: int | None = None  # tokens per row; None means model.max_seq_len
    log_file: str | None = None  # per-step JSON lines (default: <run dir>/train.jsonl)
    checkpoint_dir: str | None = None  # device-agnostic checkpoints (default: <run dir>/checkpoints)
    checkpoint_every: int | None = None  # save every N steps as well as at the end (None: at the end only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- one-line errors -----------------------------------------------------------------------------


def _did_you_mean(value: str, choices: Sequence[str]) -> str:
    hint = difflib.get_close_matches(value, list(choices), n=1)
    return f" (did you mean '{hint[0]}'?)" if hint else ""


def _reject_unknown(origin: str, where: str, raw: Mapping[str, Any], allowed: Sequence[str]) -> None:
    for key in raw:
        if key not in allowed:
            maybe = _did_you_mean(str(key), allowed)
            raise ConfigError(f"{origin}: unknown key '{where}.{key}'{maybe}; allowed keys in {where}: {', '.join(allowed)}")


def _positive_int(origin: str, key: str, value: Any, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{origin}: key '{key}' must be a positive integer, got {value!r}; e.g. {example}")
    return value


def _flag(origin: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{origin}: key '{key}' must be true or false, got {value!r}")
    return value


def _choice(origin: str, key: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        maybe = _did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ConfigError(f"{origin}: key '{key}': {value!r} is not allowed{maybe}; use one of {', '.join(choices)}")
    return value


def _number(origin: str, key: str, value: Any, *, positive: bool) -> float:
    # PyYAML reads ``1e-3`` (no dot) as a string (YAML 1.1); a number written that way is still a number.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        bound = "a positive number" if positive else "a number ≥ 0"
        raise ConfigError(f"{origin}: key '{key}' must be {bound}, got {value!r}")
    return float(value)


def _optional_path(origin: str, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{origin}: key '{key}' must be a path (a non-empty string) or null, got {value!r}")
    return value


# --- parsing ------------------------------------------------------------------------------------


def _parse_backend(origin: str, key: str, value: Any) -> str:
    """A stage names a registered backend explicitly: 'auto' would make the topology depend on the host."""
    from hal.backend_registry import backend_names

    names = backend_names()
    if value == "auto":
        raise ConfigError(f"{origin}: key '{key}': 'auto' is not allowed for a stage; name its backend, one of {', '.join(names)}")
    return _choice(origin, key, value, names)


def _parse_stage(origin: str, index: int, raw: Any) -> StagePlan:
    where = f"parallel.stages[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{origin}: '{where}' must be a mapping like {{backend: cpu, devices: 2, layers: 2, tp: 2}}, got {raw!r}"
        )
    _reject_unknown(origin, where, raw, STAGE_KEYS)
    missing = [k for k in STAGE_REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{origin}: '{where}' is missing key '{missing[0]}'; every stage needs {', '.join(STAGE_REQUIRED)}")
    return StagePlan(
        backend=_parse_backend(origin, f"{where}.backend", raw["backend"]),
        devices=_positive_int(origin, f"{where}.devices", raw["devices"], "devices: 2"),
        layers=_positive_int(origin, f"{where}.layers", raw["layers"], "layers: 2"),
        tp=_positive_int(origin, f"{where}.tp", raw.get("tp", 1), "tp: 2"),
        dp=_positive_int(origin, f"{where}.dp", raw.get("dp", 1), "dp: 2"),
        sp=_flag(origin, f"{where}.sp", raw.get("sp", False)),
        checkpoint=_flag(origin, f"{where}.checkpoint", raw.get("checkpoint", False)),
    )


def _parse_stages(origin: str, raw: Any) -> tuple[StagePlan, ...]:
    if raw is None:
        raise ConfigError(f"{origin}: 'parallel' has no 'stages'; add a list, e.g. stages: [{{backend: cpu, devices: 1, layers: 4}}]")
    if not isinstance(raw, list):
        raise ConfigError(f"{origin}: key 'parallel.stages' must be a list of stages, got {type(raw).__name__} {raw!r}")
    if not raw:
        raise ConfigError(f"{origin}: key 'parallel.stages' is empty; give at least one stage, e.g. [{{backend: cpu, devices: 1, layers: 4}}]")
    return tuple(_parse_stage(origin, i, s) for i, s in enumerate(raw))


def parse_plan(raw: Any, origin: str = "config") -> ParallelPlan:
    """The ``parallel:`` section as a ParallelPlan: keys, types and choices (no model checks yet).

    Defaults: ``schedule`` 1f1b; ``micro_batches`` the number of stages (the fewest that fill a
    1F1B pipeline); ``micro_batch_size`` the lcm of the stages' dp (the fewest rows every stage
    can split evenly). ``hal plan`` shows the values in effect.
    """
    if not isinstance(raw, Mapping):
        got = "nothing" if raw is None else type(raw).__name__
        raise ConfigError(f"{origin}: section 'parallel' must be a mapping with a 'stages' list, got {got}")
    _reject_unknown(origin, "parallel", raw, PARALLEL_KEYS)
    stages = _parse_stages(origin, raw.get("stages"))
    default_mbs = math.lcm(*(s.dp for s in stages))
    return ParallelPlan(
        stages=stages,
        schedule=_choice(origin, "parallel.schedule", raw.get("schedule", "1f1b"), schedule_names()),
        micro_batches=_positive_int(origin, "parallel.micro_batches", raw.get("micro_batches", len(stages)), "micro_batches: 8"),
        micro_batch_size=_positive_int(origin, "parallel.micro_batch_size", raw.get("micro_batch_size", default_mbs), "micro_batch_size: 4"),
        zero1=_flag(origin, "parallel.zero1", raw.get("zero1", False)),
    )


def parse_train(raw: Any, origin: str = "config") -> TrainConfig:
    """The ``train:`` section (absent or empty means the defaults)."""
    if raw is None:
        return TrainConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{origin}: section 'train' must be a mapping of keys, got {type(raw).__name__}")
    allowed = tuple(f.name for f in fields(TrainConfig))
    _reject_unknown(origin, "train", raw, allowed)
    d = TrainConfig()
    seed = raw.get("seed", d.seed)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{origin}: key 'train.seed' must be an integer ≥ 0, got {seed!r}")
    seq_len = raw.get("seq_len")
    return TrainConfig(
        steps=_positive_int(origin, "train.steps", raw.get("steps", d.steps), "steps: 20"),
        lr=_number(origin, "train.lr", raw.get("lr", d.lr), positive=True),
        seed=seed,
        weight_decay=_number(origin, "train.weight_decay", raw.get("weight_decay", d.weight_decay), positive=False),
        data=_choice(origin, "train.data", raw.get("data", d.data), DATA_SOURCES),
        seq_len=None if seq_len is None else _positive_int(origin, "train.seq_len", seq_len, "seq_len: 64"),
        log_file=_optional_path(origin, "train.log_file", raw.get("log_file")),
        checkpoint_dir=_optional_path(origin, "train.checkpoint_dir", raw.get("checkpoint_dir")),
        checkpoint_every=None if raw.get("checkpoint_every") is None
        else _positive_int(origin, "train.checkpoint_every", raw["checkpoint_every"], "checkpoint_every: 10"),
    )


# --- validation against the model, the world and the backends -------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_tp(origin: str, k: int, stage: StagePlan, model: ModelConfig) -> None:
    dims = {
        "num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads, "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size, "vocab_size": model.vocab_size,
    }  # fmt: skip
    for name, size in dims.items():
        if size % stage.tp:
            allowed = ", ".join(map(str, _divisors(math.gcd(*dims.values()))))
            raise ConfigError(
                f"{origin}: stage {k} (parallel.stages[{k}].tp): tp {stage.tp} does not divide model.{name} {size}; "
                f"tp must divide heads, kv-heads, hidden, ffn and vocab — use tp in {{{allowed}}} or change the model"
            )


def _check_stage(origin: str, k: int, stage: StagePlan, plan: ParallelPlan, model: ModelConfig,
                 seq_len: int, seq_from: str) -> None:
    """Everything about one stage that the model and the micro-batching decide."""
    where = f"stage {k} (parallel.stages[{k}]"
    if stage.devices != stage.tp * stage.dp:
        raise ConfigError(
            f"{origin}: {where}): devices {stage.devices} but tp {stage.tp} × dp {stage.dp} = {stage.tp * stage.dp}; "
            f"set devices: {stage.tp * stage.dp} or choose tp and dp with tp × dp = {stage.devices}"
        )
    if stage.sp and stage.tp < 2:
        raise ConfigError(
            f"{origin}: {where}.sp): sp needs tp ≥ 2 (it shards the sequence over the TP group), got tp {stage.tp}; "
            "set tp ≥ 2 or drop sp"
        )
    _check_tp(origin, k, stage, model)
    if plan.micro_batch_size % stage.dp:
        raise ConfigError(
            f"{origin}: {where}.dp): dp {stage.dp} does not divide parallel.micro_batch_size {plan.micro_batch_size} "
            f"(each dp replica gets micro_batch_size/dp rows); set micro_batch_size to a multiple of {stage.dp}, "
            f"e.g. {math.lcm(plan.micro_batch_size, stage.dp)}"
        )
    if stage.sp and seq_len % stage.tp:
        raise ConfigError(
            f"{origin}: {where}.sp): sp with tp {stage.tp} needs the sequence length divisible by {stage.tp}, "
            f"got {seq_from} {seq_len}; use a multiple of {stage.tp}"
        )


def _check_pipeline(origin: str, plan: ParallelPlan, model: ModelConfig) -> None:
    """Layer split and schedule: properties of the stage list as a whole."""
    total = sum(s.layers for s in plan.stages)
    if total != model.num_layers:
        parts = " + ".join(str(s.layers) for s in plan.stages)
        raise ConfigError(
            f"{origin}: parallel.stages layers add up to {total} ({parts}) but model.num_layers is {model.num_layers}; "
            f"make the stages' layers sum to {model.num_layers}"
        )
    if plan.schedule == "1f1b" and plan.micro_batches < plan.num_stages:
        raise ConfigError(
            f"{origin}: parallel.micro_batches {plan.micro_batches} is fewer than the {plan.num_stages} stages, which "
            f"schedule 1f1b needs to fill the pipeline; set micro_batches ≥ {plan.num_stages} or use schedule: gpipe"
        )


def _check_world(origin: str, plan: ParallelPlan, world_size: int) -> None:
    if plan.world_size != world_size:
        parts = " + ".join(str(s.devices) for s in plan.stages)
        raise ConfigError(
            f"{origin}: the stages use {plan.world_size} devices ({parts}) but the world has {world_size} ranks; "
            f"launch {plan.world_size} ranks or make the stages' devices add up to {world_size}"
        )


def _check_backends(origin: str, plan: ParallelPlan, single_host: bool) -> None:
    """Every stage's backend is available; on one host, enough devices for its stages (one rank each)."""
    from hal.backend_registry import get_backend

    for name in dict.fromkeys(s.backend for s in plan.stages):
        ks = [k for k, s in enumerate(plan.stages) if s.backend == name]
        backend = get_backend(name)
        status = backend.availability()
        if not status.available:
            raise ConfigError(
                f"{origin}: stage {ks[0]} (parallel.stages[{ks[0]}].backend): backend '{name}' is not available: "
                f"{status.reason}; pick an available backend (see 'hal devices')"
            )
        if not single_host or backend.device_type == "cpu":  # cpu ranks share the host: any number fits
            continue
        wanted, have = sum(plan.stages[k].devices for k in ks), backend.device_count()
        if wanted > have:
            which = ", ".join(map(str, ks))
            raise ConfigError(
                f"{origin}: stage(s) {which} put {wanted} ranks on backend '{name}' (one device each) but this host has "
                f"{have} {name} device(s); lower their devices to {have} in total or move a stage to another backend"
            )


def validate_plan(
    plan: ParallelPlan,
    model: ModelConfig,
    *,
    world_size: int | None,
    check_backends: bool = True,
    seq_len: int | None = None,
    single_host: bool = True,
    origin: str = "config",
) -> None:
    """Raise one ConfigError line for the first problem of ``plan`` with ``model``; return None if it can run.

    ``world_size`` (when known) must equal the plan's device total. ``seq_len`` defaults to
    ``model.max_seq_len``. ``check_backends`` probes every stage's backend; ``single_host``
    also checks that each accelerator backend has enough local devices (turn it off when the
    stages span several nodes, where each node checks its own).
    """
    seq_from = "model.max_seq_len" if seq_len is None else "train.seq_len"
    seq = model.max_seq_len if seq_len is None else seq_len
    for k, stage in enumerate(plan.stages):
        _check_stage(origin, k, stage, plan, model, seq, seq_from)
    _check_pipeline(origin, plan, model)
    if world_size is not None:
        _check_world(origin, plan, world_size)
    if check_backends:
        _check_backends(origin, plan, single_host)


# --- the whole run config from one file -----------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs from its YAML file, parsed and validated."""

    origin: str
    hal: HalConfig  # backend, devices, precision, fallback (and the raw sections)
    model: ModelConfig
    plan: ParallelPlan
    train: TrainConfig


def load_run_config(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    check_backends: bool = True,
    single_host: bool = True,
    env: Mapping[str, str] | None = None,
) -> RunConfig:
    """Read ``path`` (hal keys + model/parallel/train) and validate it; one ConfigError line otherwise."""
    from hal.config import load_config

    origin = str(path)
    config = load_config(path, env=env)
    if config.parallel is None:
        raise ConfigError(f"{origin}: no 'parallel' section; add one with a list of stages (see examples/hetero_cpu.yaml)")
    model = ModelConfig.from_mapping(config.model or {}, origin)
    plan = parse_plan(config.parallel, origin)
    train = parse_train(config.train, origin)
    if train.seq_len is not None and train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"{origin}: train.seq_len {train.seq_len} exceeds model.max_seq_len {model.max_seq_len}; "
            f"lower seq_len or raise max_seq_len"
        )
    _check_data(origin, train, model)
    validate_plan(plan, model, world_size=world_size, check_backends=check_backends, seq_len=train.seq_len,
                  single_host=single_host, origin=origin)
    return RunConfig(origin, config, model, plan, train)


def _check_data(origin: str, train: TrainConfig, model: ModelConfig) -> None:
    """The corpus is byte-level text: exactly 256 token ids, so the model's vocabulary must be 256."""
    if train.data == "corpus" and model.vocab_size != 256:
        raise ConfigError(
            f"{origin}: train.data 'corpus' is byte-level text (token ids 0..255) but model.vocab_size is "
            f"{model.vocab_size}; set model.vocab_size: 256 or use data: synthetic"
        )
