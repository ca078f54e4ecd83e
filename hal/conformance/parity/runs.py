"""What a parity run trains, and one run of it on a backend: every step's loss and gradient norm, and the weights at
the steps the per-layer check looks at.

The default is the tiny example's Llama shape (``examples/tiny_cpu.yaml``: hidden 128, 4 layers, 4 heads / 2 KV heads,
FFN 384, 64 tokens, 16 rows a step) on byte windows of the shipped corpus (256 ids: no tokenizer step), AdamW at
3e-3 for 300 steps. ``--config`` takes another hal config: its model, train.steps, train.lr, train.data (a token file)
and the rows of a step (parallel.micro_batches × micro_batch_size). A run's seed sets the weights; the data order has
its own seed, the same in every run, so the reference band measures what the seed moves and nothing else.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hal.conformance.suites import training_run as T
from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig

TINY = ModelConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=384,
                   max_seq_len=64)
DATA_SEED = 0


@dataclass(frozen=True)
class ParityConfig:
    """One parity's training: the model, steps, learning rate, rows a step, data and precision."""

    model: ModelConfig = TINY
    steps: int = 300
    lr: float = 3e-3
    batch: int = 16
    data: str = "corpus"
    precision: str = "fp32"
    source: str = "the tiny example's Llama shape on the shipped corpus (bytes)"

    @property
    def warmup(self) -> int:
        """Steps left out of the band checks: where every run still falls from ln(vocab) (5 %, at least 5)."""
        return max(5, self.steps // 20)

    @property
    def layer_steps(self) -> tuple[int, ...]:
        """The steps whose weights the per-layer gradient check takes: the first, the middle and the last."""
        return tuple(sorted({0, self.steps // 2, self.steps - 1}))

    def settings(self, seed: int, *, lr_scale: float = 1.0, data_seed: int = DATA_SEED) -> T.Settings:
        return T.Settings(model=self.model, steps=self.steps, lr=self.lr * lr_scale, batch=self.batch, seed=seed,
                          data=self.data, data_seed=data_seed)

    def key(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "steps": self.steps, "lr": self.lr, "batch": self.batch,
                "data": self.data, "precision": self.precision, "data_seed": DATA_SEED}


def from_file(path: str, steps: int | None = None) -> ParityConfig:
    """A ParityConfig from a hal config file (its model, train and parallel sections); ConfigError in one line."""
    from hal.config import load_config
    from hal.parallel.data.batches import is_token_file

    config = load_config(path)
    try:
        model = ModelConfig(**dict(config.model)) if config.model else TINY
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: its model section does not make a model ({exc})") from None
    train = dict(config.train or {})
    parallel = dict(config.parallel or {})
    data = str(train.get("data") or "corpus")
    if data not in ("corpus", "synthetic") and not is_token_file(data):
        raise ConfigError(f"{path}: train.data {data!r} is not a token file (.bin with its .idx.json); run "
                          "`hal data prepare` first, or leave it out to train on the shipped corpus")
    if data == "corpus" and model.vocab_size < 256:
        raise ConfigError(f"{path}: model.vocab_size {model.vocab_size} is below the corpus's 256 byte ids; give 256 or more")
    precision = str(config.precision or "fp32")
    if precision not in T.PRECISIONS:
        raise ConfigError(f"{path}: precision {precision!r}: parity trains in {', '.join(T.PRECISIONS)}")
    rows = int(parallel.get("micro_batches", 1)) * int(parallel.get("micro_batch_size", 16))
    return ParityConfig(model=model, steps=int(steps or train.get("steps", 300)), lr=float(train.get("lr", 3e-3)),
                        batch=rows, data=data, precision=precision, source=str(path))


@dataclass
class Curve:
    """One run: its seed, every step's loss and gradient norm, and the per-layer check at the chosen steps."""

    seed: int
    losses: list[float]
    grad_norms: list[float]
    layers: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # step -> layer_parity rows

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Candidate:
    """How the candidate trains differently from the reference (nothing, unless a fault is planted)."""

    lr_scale: float = 1.0
    data_seed: int = DATA_SEED
    tamper: Callable[[torch.nn.Module], None] | None = None
    fault: str | None = None


def train_run(config: ParityConfig, seed: int, backend: Any, device: torch.device, *, candidate: Candidate = Candidate(),
              layer_check: bool = False, on_step: Callable[[int], None] | None = None) -> Curve:
    """One run of ``config`` with ``seed`` on ``device``; with ``layer_check``, every parameter's gradient at the
    chosen steps' weights against the float64 CPU reference at the same weights (``training_run.layer_parity``)."""
    settings = config.settings(seed, lr_scale=candidate.lr_scale, data_seed=candidate.data_seed)
    keep = config.layer_steps if layer_check else ()
    run = T.train(settings, backend, device, precision=config.precision, threads=None, tamper=candidate.tamper,
                  keep_at=keep, on_step=on_step)
    curve = Curve(seed, run.losses, run.grad_norms)
    for step in keep:
        params = run.snapshots[step]
        _, got = T.gradient_at(settings, backend, device, params, precision=config.precision, tamper=candidate.tamper,
                               step=step)
        _, want = T.reference_gradient_at(settings, params, step=step)
        curve.layers[step] = T.layer_parity(got, want)
    return curve
