"""Small, exactly repeatable training runs of the reference model, on the backend or as the reference.

The model is ``parallel.models.stage.full_model`` (the Llama-style decoder the engine trains) at a toy size;
the data are byte windows of the shipped corpus (``parallel.data.batches.global_batch``), a pure function of
(seed, step); the optimizer is AdamW. Weights depend only on (seed, parameter name), so every run
starts identical whatever device or dtype it runs in.

References never go through the backend's registered operators: ``reference_ops_only`` pins every
hal op to its plain-PyTorch reference implementation for the duration of the reference run, so a
faulty CPU kernel registered in ``hal.ops.registry`` cannot hide by being in the reference too.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

import torch

from hal.backend import Backend
from hal.parallel.config.model import ModelConfig
from hal.precision import MODES, autocast_dtype

MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, max_seq_len=32)
# The modes these runs cover, with their autocast dtype from the one map (hal.precision.MODES).
PRECISIONS: dict[str, torch.dtype | None] = {mode: autocast_dtype(mode) for mode in ("fp32", "bf16-mixed", "fp16-mixed")}


@dataclass(frozen=True)
class Settings:
    """What every run of one suite shares: the model, steps, optimizer and data."""

    model: ModelConfig = MODEL
    steps: int = 12
    lr: float = 3e-3
    batch: int = 4
    seed: int = 0
    data: str = "corpus"
    data_seed: int | None = None  # the data order's seed (None: ``seed``); parity varies ``seed`` with the data fixed

    @property
    def seq(self) -> int:
        return self.model.max_seq_len


@dataclass
class RunResult:
    losses: list[float]
    grads: dict[str, torch.Tensor]  # step-1 gradients (before any update), float64 on the host
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # final parameters, as trained (host)
    skipped: tuple[int, ...] = ()  # steps (0-based) whose update the loss scaler skipped (inf/NaN gradients)
    grad_norms: list[float] = field(default_factory=list)  # every step's total gradient norm (unscaled)
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> parameters before its update


def batch(settings: Settings, step: int) -> torch.Tensor:
    """Step ``step``'s token ids (batch, seq + 1), int64 on the host."""
    from hal.parallel.data.batches import global_batch

    m = settings.model
    seed = settings.seed if settings.data_seed is None else settings.data_seed
    return global_batch(settings.data, seed, step, 1, settings.batch, settings.seq, m.vocab_size)[0]


@contextlib.contextmanager
def reference_ops_only() -> Iterator[None]:
    """Every hal op resolves to its reference implementation inside the block (restored after).

    It takes the other implementations out of the registry for the block's duration, so ops
    dispatched from another thread meanwhile would see the reference too (the runner is sequential).
    """
    from hal.ops import registry
    from hal.ops.registry import REFERENCE

    removed = []
    for name in registry.names():
        for impl in registry.implementations(name):
            if impl.name != REFERENCE:
                registry.unregister(name, impl.name)
                removed.append(impl)
    try:
        yield
    finally:
        for impl in removed:
            registry.register(
                impl.op, impl.name, backends=impl.backends or (), dtypes=impl.dtypes, priority=impl.priority,
                requires=impl.requires, source=impl.source,
            )(impl.fn)


@contextlib.contextmanager
def plain_fp32_matmul(backend: Backend) -> Iterator[None]:
    """TF32/HF32 off for an fp32 run (restored after): fp32 means fp32."""
    previous = backend.reduced_precision_matmul_enabled()
    if previous:
        backend.set_reduced_precision_matmul(False)
    try:
        yield
    finally:
        if previous:
            backend.set_reduced_precision_matmul(True)


@contextlib.contextmanager
def host_threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` intra-op host threads (None: leave as is); restored after.

    The toy model's ops are microseconds long: on a shared, busy host two spinning OpenMP threads
    made a 0.1 s run take 3 s, while one thread stays at 0.1 s — and a fixed thread count keeps the
    host's summation order fixed too.
    """
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train(settings: Settings, backend: Backend, device: torch.device, *, precision: str = "fp32",
          param_dtype: torch.dtype = torch.float32, steps: int | None = None, keep_params: bool = False,
          threads: int | None = 1, skip_steps: Collection[int] = (),
          tamper: Callable[[torch.nn.Module], None] | None = None, keep_at: Collection[int] = (),
          on_step: Callable[[int], None] | None = None) -> RunResult:
    """``steps`` AdamW steps on ``device``; losses per step, step-1 gradients (unscaled) and optionally final weights.

    ``precision``: fp32 (plain, reduced-precision matmul off), bf16-mixed (autocast bf16) or
    fp16-mixed (autocast fp16 + the backend's GradScaler). Parameters stay in ``param_dtype``.
    ``threads``: host intra-op threads for the run (``host_threads``; None keeps the process's).
    ``skip_steps``: steps whose optimizer update is left out, as a loss scaler leaves out an overflowing one.
    ``tamper``: called with the model before training (tests plant a broken layer with it).
    ``keep_at``: steps whose parameters (before that step's update) are kept in ``snapshots``.
    ``on_step``: called after every step with its index (progress).
    """
    with host_threads(threads):
        return _train(settings, backend, device, precision, param_dtype, steps, keep_params, frozenset(skip_steps), tamper,
                      frozenset(keep_at), on_step)


def _train(settings: Settings, backend: Backend, device: torch.device, precision: str, param_dtype: torch.dtype,
           steps: int | None, keep_params: bool, skip_steps: frozenset[int],
           tamper: Callable[[torch.nn.Module], None] | None = None, keep_at: frozenset[int] = frozenset(),
           on_step: Callable[[int], None] | None = None) -> RunResult:
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import full_model

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown here; use one of {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    backend.manual_seed(settings.seed)  # nothing in the model draws random numbers; seeded anyway
    model = full_model(settings.model, settings.seed).to(device=device, dtype=param_dtype)
    if tamper is not None:
        tamper(model)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    scaler = backend.grad_scaler(enabled=MODES[precision].loss_scaling)
    losses: list[float] = []
    skipped: list[int] = []
    grads: dict[str, torch.Tensor] = {}
    norms: list[float] = []
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    context = plain_fp32_matmul(backend) if dtype is None else contextlib.nullcontext()
    with context:
        for step in range(settings.steps if steps is None else steps):
            if step in keep_at:
                snapshots[step] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
            tokens = batch(settings, step).to(device)
            opt.zero_grad(set_to_none=True)
            with backend.autocast(dtype) if dtype is not None else contextlib.nullcontext():
                loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], None)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if step == 0:
                grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in model.named_parameters() if p.grad is not None}
            norms.append(float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in model.parameters() if p.grad is not None]))))
            if step not in skip_steps:
                scale = scaler.get_scale() if scaler.is_enabled() else None
                scaler.step(opt)
                scaler.update()
                if scale is not None and scaler.get_scale() < scale:  # the scaler backed off: this update was skipped
                    skipped.append(step)
            losses.append(float(loss.detach().float().cpu()))
            if on_step is not None:
                on_step(step)
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()} if keep_params else {}
    return RunResult(losses, grads, params, tuple(skipped), norms, snapshots)


def reference_curve(settings: Settings, skip_steps: Collection[int] = ()) -> list[float]:
    """The fp32 CPU reference loss curve (reference operators only); ``skip_steps``: the updates a loss
    scaler skipped in the run under test, left out here too, so both curves are the same training."""
    from hal.backend_registry import get_backend

    with reference_ops_only():
        return train(settings, get_backend("cpu"), torch.device("cpu"), skip_steps=skip_steps).losses


def reference_grads(settings: Settings) -> dict[str, torch.Tensor]:
    """Step-1 gradients of the float64 CPU model (reference operators only)."""
    from hal.backend_registry import get_backend

    with reference_ops_only():
        return train(settings, get_backend("cpu"), torch.device("cpu"), param_dtype=torch.float64, steps=1).grads


def gradient_at(settings: Settings, backend: Backend, device: torch.device, params: dict[str, torch.Tensor], *,
                precision: str = "fp32", param_dtype: torch.dtype = torch.float32,
                tamper: Callable[[torch.nn.Module], None] | None = None,
                step: int | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and every parameter's gradient (float64 on the host, unscaled) of the model at ``params`` on step
    ``step``'s batch (default: the batch after the run's last step), in ``precision`` on ``device``: the state N steps
    of training reached."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import full_model

    dtype = PRECISIONS[precision]
    model = full_model(settings.model, settings.seed).to(device=device, dtype=param_dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name].to(device=device, dtype=param_dtype))
    if tamper is not None:
        tamper(model)
    tokens = batch(settings, settings.steps if step is None else step).to(device)
    context = plain_fp32_matmul(backend) if dtype is None else contextlib.nullcontext()
    with context, host_threads(1):
        with backend.autocast(dtype) if dtype is not None else contextlib.nullcontext():
            loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], None)
        loss.backward()  # no loss scaling: one backward of an O(1) loss stays in range in every precision
    grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach().double().cpu()), grads


def reference_gradient_at(settings: Settings, params: dict[str, torch.Tensor],
                          step: int | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """``gradient_at`` in float64 on the CPU with the reference operators: what the backend's should be."""
    from hal.backend_registry import get_backend

    with reference_ops_only():
        return gradient_at(settings, get_backend("cpu"), torch.device("cpu"), params, param_dtype=torch.float64, step=step)


def _cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    """Cosine of two float64 vectors; two zero vectors agree (1), one zero vector does not (0)."""
    ng, nw = float(got.norm()), float(want.norm())
    return float((got * want).sum()) / (ng * nw) if ng > 0 and nw > 0 else (1.0 if ng == nw else 0.0)


def layer_parity(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per parameter tensor (its layer in ``layer``, ``layer_of``): the gradient's cosine and norm ratio against
    ``expected``. Why per tensor, not a layer's tensors as one vector: one weight's gradient 1 % too large moved its
    layer's norm by 0.1 % (the other tensors dilute it), exactly fp32's bound; alone it is 1 %."""
    rows = []
    for name in expected:
        if name not in actual:
            rows.append({"param": name, "layer": layer_of(name), "cosine": 0.0, "norm_ratio": 0.0, "missing": True})
            continue
        got, want = actual[name].double().reshape(-1), expected[name].double().reshape(-1)
        ng, nw = float(got.norm()), float(want.norm())
        cosine = _cosine(got, want)
        ratio = ng / nw if nw > 0 else (1.0 if ng == 0 else float("inf"))
        if not bool(torch.isfinite(got).all()):
            cosine, ratio = 0.0, float("inf")
        rows.append({"param": name, "layer": layer_of(name), "cosine": cosine, "norm_ratio": ratio, "missing": False})
    return rows


def layer_of(param: str) -> str:
    """``layers.3.attn.qkv.weight`` → ``layers.3``; ``embed.weight`` → ``embed``."""
    parts = param.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def grad_agreement(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per parameter tensor: rel_l2 and cosine of ``actual`` against ``expected`` (float64), in model order."""
    rows = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            rows.append({"param": name, "layer": layer_of(name), "rel_l2": float("inf"), "cosine": 0.0, "missing": True})
            continue
        got, want = got.double().reshape(-1), want.double().reshape(-1)
        norm = float(want.norm())
        rel = float((got - want).norm()) / norm if norm > 0 else float((got - want).norm())
        cosine = _cosine(got, want)
        if not (torch.isfinite(got).all()):
            rel, cosine = float("inf"), 0.0
        rows.append({"param": name, "layer": layer_of(name), "rel_l2": rel, "cosine": cosine, "missing": False})
    return rows
