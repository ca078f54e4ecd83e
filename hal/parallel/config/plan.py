"""The parallel plan: which stage runs which layers, on which backend, with which intra-op grid.

The ``parallel:`` section of the hal config is declared here once, as the ``StagePlan`` and
``ParallelPlan`` dataclasses (``hal.config.schema`` rules on their fields; the whole file is
``run_config``), and ``validate_plan`` checks a plan against the model *before any process starts* — every problem is one ``ConfigError``
line naming the stage or
key, the value and the fix, so a bad plan never turns into a hang or a shape error on rank 5.

    parallel:
      schedule: 1f1b            # gpipe | 1f1b | interleaved-1f1b | zero-bubble | interleaved-zero-bubble | zbv | dualpipev
      virtual_stages: 1         # model chunks per stage (interleaved schedules: 2 or more; zbv, dualpipev: 2)
      micro_batches: 8          # micro-batches per step           (default: number of stages)
      micro_batch_size: 4       # rows per micro-batch             (default: lcm of the stages' dp)
      zero1: false              # ZeRO-1 optimizer-state sharding inside each stage's dp group
      compile: false            # torch.compile each decoder layer (regional); a stage may override it
      compile_backend: inductor # inductor | aot_eager | eager (the last two: no code generation, for tests)
      fused_head: false         # the LM head and the loss as one chunked op: full logits never in memory
      order: auto               # auto | unit | measured: a played schedule's order from measured stage times (hal train)
      stages:                   # stage k owns the next `devices` global ranks (see hal/parallel/config/topology.py)
        - {backend: cpu, devices: 2, layers: 3, tp: 2, sp: true}
        - {backend: cpu, devices: 2, layers: 1, dp: 2, checkpoint: true, compile: true, precision: bf16-mixed}

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
- ``interleaved-1f1b`` (``parallel.schedules.interleaved``) gives every stage ``virtual_stages`` V
  chunks of layers: a stage's ``layers`` is split evenly (it must be divisible by V) or listed per
  chunk (``layers: [3, 2]``); chunk v of stage k is virtual stage v*S + k, layers following that
  order. It needs at least 2 stages and micro_batches a multiple of the stage count.
  ``interleaved-zero-bubble`` is the same placement with zero-bubble's split backward.
- ``zero-bubble`` (ZB-H1, ``parallel.schedules.zero_bubble``) splits each backward into input and
  weight halves (a compiled layer runs its linears eagerly between its graphs to defer their weight halves).
- ``zbv`` (ZB-V, ``parallel.schedules.zbv``) splits backwards too, over exactly 2 chunks a stage
  placed in a V: stage k holds virtual stages k and 2S-1-k, so the first stage holds the embedding
  and the head (the loss is computed there) and every transfer is between neighbouring stages.
- ``dualpipev`` (DualPipeV, ``parallel.schedules.dualpipev``): ZB-V's V with DeepSeek's fixed phase order, a
  forward of one chunk paired with a backward of the other in its steady state; at least 2 x stages micro-batches.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hal.config import limits
from hal.config.schema import Choice, Custom, Flag, ListOf, Nullable, PositiveInt, check_choice, key, parse_section
from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.schedules import Schedule, get_schedule, schedule_names
from hal.precision import PRECISIONS


def _schedule(origin: str, key_name: str, value: Any) -> Schedule:
    """``parallel.schedule``: a registered name, parsed here once into the Schedule every later step asks."""
    return get_schedule(check_choice(origin, key_name, value, schedule_names()))


def _stage_backend(origin: str, name: str, value: Any) -> str:
    """A stage names a registered backend explicitly: 'auto' would make the topology depend on the host."""
    from hal.backend_registry import backend_names

    names = backend_names()
    if value == "auto":
        raise ConfigError(f"{origin}: key '{name}': 'auto' is not allowed for a stage; name its backend, one of {', '.join(names)}")
    return check_choice(origin, name, value, names)


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
ORDERS = ("auto", "unit", "measured")  # parallel.order: how a played schedule's order is found (parallel.loop.measured_order)
MAX_CHUNKS = limits.CHUNKS.maximum


def _stage_layers(origin: str, name: str, value: Any) -> int | tuple[int, ...]:
    """A stage's layers: a count, or one count per chunk (``virtual_stages``) such as ``[3, 2]``."""
    rule = PositiveInt(limits.LAYERS)
    if isinstance(value, list):
        if not 1 <= len(value) <= MAX_CHUNKS:
            raise ConfigError(f"{origin}: key '{name}' must list 1 to {MAX_CHUNKS} chunk layer counts, got {len(value)}; "
                              "e.g. layers: [3, 2]")
        return tuple(rule.check(origin, f"{name}[{i}]", v, "layers: [3, 2]") for i, v in enumerate(value))
    return rule.check(origin, name, value, "layers: 2")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its backend, its devices (= tp × dp ranks) and its share of the layers."""

    backend: str = key(Custom(_stage_backend), example="backend: cpu")
    devices: int = key(PositiveInt(limits.DEVICES), example="devices: 2")
    layers: int | tuple[int, ...] = key(Custom(_stage_layers), example="layers: 2")  # a list: per chunk (virtual_stages)
    tp: int = key(PositiveInt(limits.DEVICES), 1, example="tp: 2")
    dp: int = key(PositiveInt(limits.DEVICES), 1, example="dp: 2")
    sp: bool = key(Flag(), False)
    checkpoint: bool = key(Flag(), False)  # activation checkpointing for this stage's layers
    compile: bool | None = key(Nullable(Flag()), None)  # None: the plan's ``compile``
    precision: str | None = key(Nullable(Choice(PRECISIONS)), None)  # None: the run's ``precision``
    ep: int = key(PositiveInt(limits.DEVICES), 1, example="ep: 2")  # expert parallelism: experts sharded over ep of the dp ranks

    @property
    def layer_count(self) -> int:
        """Every layer the stage holds, over all its chunks."""
        return self.layers if isinstance(self.layers, int) else sum(self.layers)

    def chunk_layers(self, virtual_stages: int) -> tuple[int, ...]:
        """Layers of each of the stage's ``virtual_stages`` chunks (a count is split evenly; validate_plan checks it)."""
        if isinstance(self.layers, tuple):
            return self.layers
        return (self.layers // virtual_stages,) * virtual_stages

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = self.layers if isinstance(self.layers, int) else list(self.layers)
        return data


@dataclass(frozen=True)
class ParallelPlan:
    """The whole hybrid strategy: stages in pipeline order, the schedule and the micro-batching.

    YAML defaults: ``schedule`` 1f1b; ``micro_batches`` the number of stages (the fewest that fill
    a 1F1B pipeline); ``micro_batch_size`` the lcm of the stages' dp (the fewest rows every stage
    can split evenly). ``hal plan`` shows the values in effect.
    """

    stages: tuple[StagePlan, ...] = key(ListOf(StagePlan, "stage"), example="stages: [{backend: cpu, devices: 1, layers: 4}]")
    schedule: Schedule = key(Custom(_schedule), get_schedule("1f1b"), positional=True)  # a name in YAML and JSON
    micro_batches: int = key(PositiveInt(limits.MICRO_BATCHES), example="micro_batches: 8", derive=lambda v: len(v["stages"]))
    micro_batch_size: int = key(PositiveInt(limits.ROWS), example="micro_batch_size: 4",
                                derive=lambda v: math.lcm(*(s.dp for s in v["stages"])))
    zero1: bool = key(Flag(), False)
    compile: bool = key(Flag(), False)  # regional torch.compile of every decoder layer (stages may override)
    compile_backend: str = key(Choice(COMPILE_BACKENDS), "inductor")
    fused_head: bool = key(Flag(), False)  # last stage: head + cross-entropy chunked over tokens (parallel.models.fused_head)
    virtual_stages: int = key(PositiveInt(limits.CHUNKS), 1,
                              derive=lambda v: v["schedule"].chunks())  # model chunks a stage; YAML default: the schedule's
    # "measured": hal train re-plays a zero-bubble-family order from the stage times of a calibration step; "auto" (the
    # default): that, for a schedule whose order is played, and the fixed order of any other; "unit": never
    order: str = key(Choice(ORDERS), "auto")

    def __post_init__(self) -> None:
        if isinstance(self.schedule, str):  # built in code from a name (a job file, a test): parse it here, once
            object.__setattr__(self, "schedule", get_schedule(self.schedule))

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
            "schedule": self.schedule.name,
            "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "zero1": self.zero1,
            "compile": self.compile,
            "compile_backend": self.compile_backend,
            "fused_head": self.fused_head,
            "virtual_stages": self.virtual_stages,
            "order": self.order,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelPlan:
        """The inverse of ``to_dict`` for data this code wrote (a job file, a checkpoint): no re-validation."""
        stages = tuple(StagePlan(**{**s, "layers": s["layers"] if isinstance(s["layers"], int) else tuple(s["layers"])})
                       for s in data["stages"])
        return cls(stages, data["schedule"], data["micro_batches"],
                   data["micro_batch_size"], data["zero1"], data.get("compile", False), data.get("compile_backend", "inductor"),
                   data.get("fused_head", False), data.get("virtual_stages", 1), data.get("order", "auto"))

    @property
    def placement(self) -> str:
        """Where the schedule puts the chunks (``schedules.placement``): "loop", or "v" for zbv."""
        return self.schedule.placement

    @property
    def last_stage(self) -> int:
        """The stage holding the model's last layers, the head and the loss (the first one under zbv)."""
        return self.schedule.head_stage(self.num_stages)

    def layer_chunks(self) -> list[list[tuple[int, int]]]:
        """Per stage, the (first layer, end) of each of its chunks: the virtual stages take the layers in
        model order (virtual stage v·S + k is stage k's chunk v, or the V's map under zbv)."""
        from hal.parallel.schedules.placement import position

        V, S = self.virtual_stages, self.num_stages
        counts = [s.chunk_layers(V) for s in self.stages]
        chunks: list[list[tuple[int, int]]] = [[(0, 0)] * V for _ in self.stages]
        first = 0
        for j in range(S * V):
            k, v = position(j, S, V, self.placement)
            chunks[k][v] = (first, first + counts[k][v])
            first += counts[k][v]
        return chunks

    def stage_layers(self, index: int) -> list[int]:
        """Every layer stage ``index`` holds, in chunk order."""
        return [i for a, b in self.layer_chunks()[index] for i in range(a, b)]

    def stage_compiles(self, index: int) -> bool:
        """Whether stage ``index`` compiles its layers: its own ``compile``, else the plan's."""
        own = self.stages[index].compile
        return self.compile if own is None else own


def parse_plan(raw: Any, origin: str = "config", where: str = "parallel") -> ParallelPlan:
    """The ``parallel:`` section (or one replica's body, ``where``) as a ParallelPlan: keys, types and choices (no
    model checks yet)."""
    plan: ParallelPlan = parse_section(origin, where, raw, ParallelPlan)
    return plan


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


def _check_pipeline(origin: str, plan: ParallelPlan, model: ModelConfig, precision: str | None = None) -> None:
    """Layer split and schedule: properties of the stage list as a whole."""
    total = sum(s.layer_count for s in plan.stages)
    if total != model.num_layers:
        parts = " + ".join(str(s.layer_count) for s in plan.stages)
        raise ConfigError(
            f"{origin}: parallel.stages layers add up to {total} ({parts}) but model.num_layers is {model.num_layers}; "
            f"make the stages' layers sum to {model.num_layers}"
        )
    _check_chunks(origin, plan)
    if plan.order == "measured" and not plan.schedule.plays_times:
        raise ConfigError(
            f"{origin}: parallel.order: measured re-plays a schedule's order from measured stage times, and schedule "
            f"{plan.schedule} has a fixed order; use zero-bubble, interleaved-zero-bubble or zbv, or set order: auto"
        )
    _check_moe(origin, plan, model, precision)


def moe_stages(plan: ParallelPlan, model: ModelConfig) -> list[int]:
    """The stages holding at least one MoE layer."""
    if not model.moe_num_experts:
        return []
    return [k for k in range(plan.num_stages) if model.moe_layers(plan.stage_layers(k))]


def _check_moe(origin: str, plan: ParallelPlan, model: ModelConfig, precision: str | None = None) -> None:
    """What a stage holding MoE layers cannot run yet: one line each, naming the stage and the way out.
    ``precision``: the run's precision (a stage's own ``precision:`` overrides it)."""
    holding = moe_stages(plan, model)
    for k, stage in enumerate(plan.stages):
        if stage.ep == 1:
            continue
        where = f"stage {k} (parallel.stages[{k}].ep)"
        if k not in holding:
            raise ConfigError(f"{origin}: {where}: ep {stage.ep} but the stage holds no MoE layer; drop ep there "
                              f"(MoE layers: {model.moe_layers() or 'none'})")
        if stage.dp % stage.ep:
            raise ConfigError(f"{origin}: {where}: ep {stage.ep} does not divide the stage's dp {stage.dp}; the expert-"
                              f"parallel groups are carved out of the dp ranks — choose ep dividing {stage.dp}")
        if model.moe_num_experts % stage.ep:
            raise ConfigError(f"{origin}: {where}: ep {stage.ep} does not divide model.moe_num_experts "
                              f"{model.moe_num_experts}; each ep rank holds an equal share of the experts")
    for k in holding:
        stage = plan.stages[k]
        where = f"stage {k} (parallel.stages[{k}])"
        widths = {"model.moe_ffn_hidden_size": model.moe_ffn_hidden_size or model.ffn_hidden_size,
                  "model.moe_shared_ffn_size": model.moe_shared_ffn_size}
        for name, width in widths.items():
            if width % stage.tp:
                raise ConfigError(f"{origin}: {where}: tp {stage.tp} does not divide {name} {width}; each TP rank holds "
                                  f"an equal slice of every expert — choose tp dividing {width}")
        if (stage.precision or precision) == "fp8-mixed":
            raise ConfigError(f"{origin}: {where} holds MoE layers under fp8-mixed; the experts' grouped matmuls "
                              "have no fp8 path — give that stage precision: bf16-mixed")


def _check_chunks(origin: str, plan: ParallelPlan) -> None:
    """The schedule's own rules on stages, micro-batches and chunks, then per-chunk layer lists that agree."""
    V = plan.virtual_stages
    problem = plan.schedule.problem(plan.num_stages, plan.micro_batches) or plan.schedule.chunk_problem(V)
    if problem:
        raise ConfigError(f"{origin}: {problem}")
    for k, stage in enumerate(plan.stages):
        where = f"stage {k} (parallel.stages[{k}].layers)"
        if isinstance(stage.layers, tuple) and len(stage.layers) != V:
            raise ConfigError(f"{origin}: {where}: {list(stage.layers)} lists {len(stage.layers)} chunk(s) but "
                              f"parallel.virtual_stages is {V}; give one layer count per chunk")
        if isinstance(stage.layers, int) and stage.layers % V:
            raise ConfigError(f"{origin}: {where}: {stage.layers} layers do not split into {V} equal chunks "
                              f"(virtual_stages); use a multiple of {V} or a list per chunk such as "
                              f"{[stage.layers // V + (i < stage.layers % V) for i in range(V)]}")


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
    precision: str | None = None,
) -> None:
    """Raise one ConfigError line for the first problem of ``plan`` with ``model``; return None if it can run.

    ``world_size`` (when known) must equal the plan's device total. ``seq_len`` defaults to
    ``model.max_seq_len``. ``check_backends`` probes every stage's backend; ``single_host``
    also checks that each accelerator backend has enough local devices (turn it off when the
    stages span several nodes, where each node checks its own). ``precision``: the run's (a stage's
    own ``precision:`` overrides it), for what a stage's precision cannot run.
    """
    seq_from = "model.max_seq_len" if seq_len is None else "train.seq_len"
    seq = model.max_seq_len if seq_len is None else seq_len
    for k, stage in enumerate(plan.stages):
        _check_stage(origin, k, stage, plan, model, seq, seq_from)
    _check_pipeline(origin, plan, model, precision)
    if world_size is not None:
        _check_world(origin, plan, world_size)
    if check_backends:
        _check_backends(origin, plan, single_host)
