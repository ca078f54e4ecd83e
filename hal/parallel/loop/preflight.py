"""One preflight: every check a run passes before anything starts, in order, each one line on failure.

Every command that reads a run config comes through this one door: it names the checks it runs (``TRAIN``,
``PLAN``, ``CONFIG``, ``PROFILE``, ``SEARCH``) and ``preflight`` runs them in this module's one order over one
``Preflight`` -- the request (the config file and the command's flags) and what the checks have found so far (the
run config, each stage's backend and precision plan, the resume point, the weights, the paths). ``hal train`` turns
the result into the job file (``job``); ``hal plan`` runs the same checks but those about flags only hal train has,
so what it passes, hal train passes. A new feature adds one ``Check`` to ``CHECKS`` and its name to the commands
that need it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hal.backend_registry import get_backend
from hal.config.limits import check_local_ranks
from hal.cpu_binding import MODES as CPU_BINDINGS
from hal.cpu_binding import allowed_cpus, numa_groups, rank_blocks
from hal.errors import ConfigError
from hal.parallel.config.job import Job
from hal.parallel.config.replicas import section
from hal.parallel.config.run import RunConfig
from hal.run_dirs import check_creatable_dir, check_creatable_file, new_run_dir

if TYPE_CHECKING:
    from hal.backend import Backend
    from hal.parallel.config.plan import ParallelPlan, StagePlan
    from hal.precision import PrecisionPlan


@dataclass
class Request:
    """What a command asks for: the config and the flags that change what is checked."""

    config: str
    steps: int | None = None  # --steps (None: train.steps)
    resume: str | None = None  # --resume
    run_dir: str | None = None  # --run-dir (None: runs/<config>-<time> for hal train; hal plan writes nothing)
    init_from: str | None = None  # --init-from
    cpu_binding: str = "none"  # --cpu-binding
    profile: bool = False  # --profile
    local: bool = True  # the ranks run on this host (False: --print-multinode; backends are the nodes')
    writes: bool = True  # a run directory will be made (hal train); False: nothing is written (hal plan)
    backend: str | None = None  # --backend: every stage on this backend, whatever the file names


@dataclass(frozen=True)
class StageView:
    """One stage of the run (of any replica) with its backend, resolved once by the 'config' check."""

    where: str  # the config section of its plan: "parallel" or "parallel.replicas[i]"
    plan: ParallelPlan
    index: int  # within its plan
    stage: StagePlan
    backend: Backend


@dataclass
class Preflight:
    """The request and what the checks found: the state every check reads and the job is made of."""

    request: Request
    run: RunConfig | None = None
    stages: list[StageView] = field(default_factory=list)  # every plan's stages in order (replica 0's first)
    precision: list[PrecisionPlan | None] = field(default_factory=list)  # one per entry of ``stages``
    checkpoint: Path | None = None  # the checkpoint resumed from
    start: int = 0  # steps already done (from the checkpoint)
    weights: Path | None = None  # the Hugging Face checkpoint the ranks slice their weights from
    run_dir: Path | None = None
    log_file: Path | None = None
    checkpoint_dir: Path | None = None

    @property
    def loaded(self) -> RunConfig:
        assert self.run is not None, "the 'config' check runs first"
        return self.run

    @property
    def fallback(self) -> str:
        """The downgrade policy the checks apply (this host's verdict only for a local run)."""
        return self.loaded.hal.fallback if self.request.local else "allow"

    @property
    def steps(self) -> int:
        return self.request.steps or self.loaded.train.steps


@dataclass(frozen=True)
class Check:
    """One check: its name (what commands list) and what it does, one line on the first problem."""

    name: str
    run: Callable[[Preflight], None]


def _steps(p: Preflight) -> None:
    if p.request.steps is not None and p.request.steps < 1:
        raise ConfigError(f"--steps {p.request.steps} is not a step count; give 1 or more")


def _config(p: Preflight) -> None:
    """The file's hal keys and model / parallel / train sections (``config.run``), and the plan against the world."""
    from hal.parallel.config.run import load_run_config

    p.run = load_run_config(p.request.config, check_backends=p.request.local, init_from=p.request.init_from,
                            backend=p.request.backend)
    _resolve_stages(p)


def _resolve_stages(p: Preflight) -> None:
    """Each stage's backend, resolved from its name once; every later check asks ``p.stages``."""
    p.stages = [StageView(where, plan, index, stage, get_backend(stage.backend))
                for where, plan in p.loaded.plans() for index, stage in enumerate(plan.stages)]


def _environment(p: Preflight) -> None:
    """The HAL_* variables the ranks read, checked here so a bad one is one line before any rank starts."""
    from hal.collectives.process_groups import stacks_after_s_from_env

    stacks_after_s_from_env()


def _islands(p: Preflight) -> None:
    """HAL_ISLANDS against the plan's world (the ranks read it; a bad one failed every rank after the start)."""
    from hal.collectives.process_groups import islands_from_env

    islands_from_env(p.loaded.world_size)


def _local_ranks(p: Preflight) -> None:
    if p.request.local:  # a local run: every rank is a process on this host
        check_local_ranks(p.loaded.world_size, f"{p.loaded.origin}: the plan's world size")


def _cpu_binding(p: Preflight) -> None:
    binding = p.request.cpu_binding
    if binding not in CPU_BINDINGS:
        raise ConfigError(f"--cpu-binding {binding}: use one of {', '.join(CPU_BINDINGS)}")
    if binding != "none" and p.request.local:
        rank_blocks(p.loaded.world_size, numa_groups(allowed_cpus()))  # more ranks than cores: refused


def _backend(p: Preflight) -> None:
    """A top-level backend the stages contradict (hal train would not use it)."""
    run = p.loaded
    stage_backends = sorted({stage.backend for _, plan in run.plans() for stage in plan.stages})
    if run.hal.backend != "auto" and stage_backends != [run.hal.backend]:
        where = run.hal.origins.get("backend", "config")
        raise ConfigError(f"{where}: backend {run.hal.backend!r} is not used by hal train: each stage names its own "
                          f"({', '.join(stage_backends)}); remove the top-level backend or make it match")


def _precision(p: Preflight) -> None:
    p.precision = _stage_precision(p.loaded, p.stages, p.fallback)


def _tensorboard(p: Preflight) -> None:
    if p.loaded.train.tensorboard:  # the writer rank opens the event file: the package must be there first
        from hal.parallel.observe.tensorboard import check_available

        check_available(f"{p.loaded.origin}: train.tensorboard")


def _corpus(p: Preflight) -> None:
    from hal.parallel.data.batches import check_corpus

    run = p.loaded
    if run.train.data == "corpus":
        check_corpus(run.train.seq_len or run.model.max_seq_len)


def _data_path(p: Preflight) -> None:
    """A token file as an absolute path: ranks may start elsewhere (another cwd, --print-multinode)."""
    from hal.parallel.data.token_file import is_token_file

    run = p.loaded
    if is_token_file(run.train.data):
        p.run = replace(run, train=replace(run.train, data=str(Path(run.train.data).resolve())))


def _resume(p: Preflight) -> None:
    """--resume: the checkpoint against the model and the step count."""
    from hal.parallel.state.checkpoint import check_compatible, read_meta, resolve

    if p.request.resume is None:
        return
    checkpoint = resolve(p.request.resume)
    meta = read_meta(checkpoint)
    check_compatible(meta, checkpoint, p.loaded.model, p.steps)
    p.checkpoint, p.start = checkpoint.resolve(), int(meta["step"])


def _weights(p: Preflight) -> None:
    """The Hugging Face checkpoint the ranks slice their weights from, its files checked against the model
    (unless resuming, when the ranks load the training checkpoint, or when the files are other nodes')."""
    from hal.parallel.state.hf_checks import check_weights

    run = p.loaded
    if run.init_from is None:
        return
    p.weights = Path(run.init_from).expanduser().resolve()  # ranks may start in another cwd
    if p.checkpoint is None and p.request.local:
        init_from = p.request.init_from
        check_weights(p.weights, run.model, f"--init-from {init_from}" if init_from is not None
                      else f"{run.origin}: model.hf {run.init_from}")


def _paths(p: Preflight) -> None:
    """Where the run writes can be written: the run directory, the log file and the checkpoint directory. Without a
    run directory to make (hal plan), only the places the config names are checked."""
    run, request = p.loaded, p.request
    train = run.train
    if request.writes:
        p.run_dir = Path(request.run_dir) if request.run_dir else new_run_dir(Path(request.config).stem)
        check_creatable_dir(p.run_dir, "--run-dir" if request.run_dir else "run directory")
    if train.log_file or p.run_dir is not None:
        p.log_file = Path(train.log_file) if train.log_file else p.run_dir / "train.jsonl"  # type: ignore[operator]
        check_creatable_file(p.log_file, f"{run.origin}: train.log_file" if train.log_file else "log file")
    if train.checkpoint_dir or p.run_dir is not None:
        p.checkpoint_dir = Path(train.checkpoint_dir) if train.checkpoint_dir else p.run_dir / "checkpoints"  # type: ignore[operator]
        check_creatable_dir(p.checkpoint_dir, f"{run.origin}: train.checkpoint_dir" if train.checkpoint_dir
                            else "checkpoint directory")


def _moe_compile(p: Preflight) -> None:
    """A compiled MoE stage whose experts will run eagerly between its graphs — anywhere but one rank's experts on
    CUDA with bf16 matmuls (the grouped matmul traced, ``compile_stage.compile_layers``) — records a downgrade:
    ``fallback: error`` refuses it here, before any rank starts."""
    import torch

    from hal.parallel.models.moe import experts_outside_the_graph

    run = p.loaded
    if p.fallback != "error" or not run.model.moe_num_experts:
        return
    for flat, view in enumerate(p.stages):
        precision = p.precision[flat] if flat < len(p.precision) else None  # None: the 'precision' check did not run
        k, plan = view.index, view.plan
        if not (plan.stage_compiles(k) and run.model.moe_layers(plan.stage_layers(k))):
            continue
        why = experts_outside_the_graph(view.stage.ep, view.backend.device_type,
                                        matmul=None if precision is None else (precision.autocast_dtype or torch.float32))
        if why:
            raise ConfigError(f"{run.origin}: stage {k} ({view.where}.stages[{k}]) compiles MoE layers, but {why}: a "
                              "downgrade, which fallback: error refuses; set fallback: warn, or compile: false on that stage")


def _token_file(p: Preflight) -> None:
    """A token file in train.data: exists, whole ids, index agrees, every id in the vocabulary, a row fits."""
    from hal.parallel.data.token_file import check_token_file, is_token_file

    run = p.loaded
    if is_token_file(run.train.data):
        check_token_file(run.train.data, seq_len=run.train.seq_len or run.model.max_seq_len,
                         vocab_size=run.model.vocab_size, validation=run.train.validation, where=f"{run.origin}: train.data")


def _loop(p: Preflight) -> None:
    """The loop's options against the plan: what the trainer could not do right is refused here, in one line."""
    run = p.loaded
    train = run.train
    if train.eval_every is not None and not (train.data.endswith(".bin") and train.validation > 0):
        raise ConfigError(f"{run.origin}: train.eval_every needs a validation part: train.data a token file (.bin, see "
                          f"hal data prepare) and train.validation > 0 (got data {train.data!r}, validation "
                          f"{train.validation}); set both or drop eval_every")
    if train.grad_clip is not None and any(plan.zero1 and any(s.dp > 1 for s in plan.stages) for _, plan in run.plans()):
        raise ConfigError(f"{run.origin}: train.grad_clip with parallel.zero1: ZeRO-1 sums the gradients inside its "
                          "step, after the norm would be taken; drop one of them")
    every = run.replicas.sync.every  # local SGD when > 1 (one replica: always 1)
    if train.grad_clip is not None and every > 1:
        raise ConfigError(f"{run.origin}: train.grad_clip with local SGD (parallel.replica_sync.every > 1): each "
                          "replica steps on its own gradients, whose norms differ; drop grad_clip or set every: 1")
    if every > 1 and p.steps % every:
        said, fix = ((f"--steps {p.steps}", "--steps") if p.request.steps is not None
                     else (f"{run.origin}: train.steps {p.steps}", "steps:"))
        raise ConfigError(f"{said} is not a multiple of parallel.replica_sync.every {every}: the run must end at a "
                          f"meeting of the replicas; use {fix} {every * max(1, p.steps // every)}")
    if train.warmup_steps >= train.steps and train.lr_schedule != "constant":
        raise ConfigError(f"{run.origin}: train.warmup_steps {train.warmup_steps} leaves no step of the "
                          f"{train.lr_schedule} decay before train.steps {train.steps}; lower warmup_steps")
    if train.min_lr > train.lr:
        raise ConfigError(f"{run.origin}: train.min_lr {train.min_lr} is above train.lr {train.lr}; decay ends below "
                          "where it starts — lower min_lr")


def _memory(p: Preflight) -> None:
    """The training state's lower bound against each available stage's memory (hal.parallel.config.memory)."""
    from hal.parallel.config.memory import MemoryPool, check_memory

    run = p.loaded
    for where, plan in run.plans():
        pools: dict[int, MemoryPool | None] = {}
        for view in (v for v in p.stages if v.plan is plan):
            backend = view.backend
            if not backend.is_available():
                pools[view.index] = None
            elif backend.device_type == "cpu":
                pools[view.index] = MemoryPool("host", backend.mem_get_info()[1])
            else:
                memory = backend.capabilities().memory_bytes
                pools[view.index] = None if memory is None else MemoryPool(backend.name, memory)
        check_memory(run.model, plan, pools, section(run.origin, where))


def _stage_precision(run: RunConfig, stages: list[StageView], fallback: str) -> list[PrecisionPlan | None]:
    """Each stage's precision plan, resolved once here (None where the backend is not available on this host); with
    replicas, every replica's stages in order.

    A stage runs its own ``precision:`` or else the run's, resolved against its own device by the
    policy (downgrades recorded). fp16-mixed on any stage (asked for, or bf16 turned into fp16 on a
    device without native bf16) turns on the pipeline's one dynamic loss scale for the whole step
    (``parallel.loop.loss_scale``). fp8-mixed runs the decoder layers' forward matmuls in fp8 where the
    device has native fp8 (``parallel.models.linear``) and is refused elsewhere by the policy, in one line.
    """
    from hal.errors import UnsupportedError
    from hal.precision import resolve_precision

    plans: list[PrecisionPlan | None] = []
    for view in stages:
        stage, index = view.stage, view.index
        precision = stage.precision or run.hal.precision  # the schema allows only precisions hal train runs
        where = (f"{run.origin}: {view.where}.stages[{index}].precision" if stage.precision
                 else f"{run.hal.origins.get('precision', 'config')}: precision")
        if precision == "fp8-mixed" and view.plan.schedule.splits_backward:
            raise ConfigError(f"{where} fp8-mixed: its fp8 linears compute both gradients at once, which schedule "
                              f"{view.plan.schedule} needs split; use schedule: 1f1b or bf16-mixed on that stage")
        backend = view.backend
        if not backend.is_available():
            plans.append(None)  # the plan check reports unavailable backends with their reason
            continue
        try:
            plans.append(resolve_precision(precision, backend, backend.capabilities(), fallback))  # type: ignore[arg-type]
        except UnsupportedError as exc:
            raise UnsupportedError(f"{where}: stage {index} ({stage.backend}): {exc}") from None
    return plans


# The one order. Each command runs the checks it names, in this order.
CHECKS: tuple[Check, ...] = (
    Check("steps", _steps),
    Check("config", _config),
    Check("environment", _environment),
    Check("islands", _islands),
    Check("local ranks", _local_ranks),
    Check("cpu binding", _cpu_binding),
    Check("backend", _backend),
    Check("precision", _precision),
    Check("moe compile", _moe_compile),
    Check("loop", _loop),
    Check("tensorboard", _tensorboard),
    Check("token file", _token_file),
    Check("memory", _memory),
    Check("corpus", _corpus),
    Check("data path", _data_path),
    Check("resume", _resume),
    Check("weights", _weights),
    Check("paths", _paths),
)
TRAIN = tuple(c.name for c in CHECKS)  # hal train: everything
PLAN = ("config", "environment", "islands", "local ranks", "backend", "precision", "moe compile", "loop", "tensorboard", "token file", "memory",
        "corpus", "weights", "paths")  # hal plan: all but the flags only hal train has
LOADED = ("backend", "precision", "moe compile", "loop", "tensorboard", "token file", "memory")  # over a loaded run
CONFIG = ("config", "environment", "backend", "loop")  # hal config: what the file says, on whatever host will run it
PROFILE = ("config", "environment")  # hal profile: the model and plan it measures for (the host's devices are measured)
SEARCH = ("config", "environment")  # hal plan --search: the model, train section and cluster it plans for


def preflight(request: Request, names: tuple[str, ...], run: RunConfig | None = None) -> Preflight:
    """Run the checks ``names`` in the one order; the first problem raises its one line. ``run``: an already
    loaded run config (then 'config' is not among ``names``)."""
    unknown = sorted(set(names) - {c.name for c in CHECKS})
    if unknown:
        raise ValueError(f"no preflight check is called {', '.join(unknown)}")
    state = Preflight(request, run)
    if run is not None:
        _resolve_stages(state)
    for check in CHECKS:
        if check.name in names:
            check.run(state)
    return state


def check_training(run: RunConfig, fallback: str) -> list[PrecisionPlan | None]:
    """The checks of a loaded run (``LOADED``) under ``fallback``; each stage's precision plan."""
    loaded = replace(run, hal=replace(run.hal, fallback=fallback))
    return preflight(Request(run.origin, writes=False), LOADED, loaded).precision


def job(p: Preflight) -> Job:
    """The job file's contents from a full preflight (``TRAIN``)."""
    run, local = p.loaded, p.request.local
    assert p.run_dir is not None and p.log_file is not None and p.checkpoint_dir is not None, "'paths' ran"
    stage_precision = tuple(plan.to_dict() if plan is not None and local else None for plan in p.precision)
    hal = {k: v for k, v in run.hal.to_dict().items() if k != "origins"}
    return Job(run.origin, hal, run.model, run.replicas, run.train, stage_precision, p.steps, p.start, p.run_dir,
               p.log_file, p.checkpoint_dir, p.checkpoint, p.request.profile, p.weights, p.request.cpu_binding,
               run.planned)


__all__ = ["CHECKS", "CONFIG", "LOADED", "PLAN", "PROFILE", "SEARCH", "TRAIN", "Check", "Preflight", "Request", "StageView",
           "check_training", "job", "preflight"]
