"""``train.tensorboard: true``: each step line's scalars also as a TensorBoard event file.

Why beside the JSON lines and not instead: the JSON log is the record tests and tools read; the
event file is for people watching curves (``tensorboard --logdir RUN_DIR``). Only the writer rank
(the one that writes the step log) opens it, under ``RUN_DIR/tensorboard/``, through
``torch.utils.tensorboard.SummaryWriter``. The ``tensorboard`` package is optional
(``pip install 'hetero-hal[tensorboard]'``): ``check_available`` refuses a run that asks for it
without the package, in one line, before any rank starts — never a run that silently logs less.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from hal.errors import ConfigError

INSTALL_HINT = "pip install 'hetero-hal[tensorboard]'"
SUBDIR = "tensorboard"  # under the run directory

# step line key -> TensorBoard tag (train/ and eval/ group the charts); keys absent or null in a line are skipped
TAGS: dict[str, str] = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
    "step_s": "train/step_s", "loss_scale": "train/loss_scale", "eval_loss": "eval/loss", "eval_ppl": "eval/ppl",
}


def check_available(where: str) -> None:
    """``torch.utils.tensorboard`` imports (it needs the ``tensorboard`` package); one ConfigError line otherwise."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:  # torch's module raises ImportError when tensorboard is absent or too old
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where}: true needs the 'tensorboard' package, which is not importable ({reason}); "
                          f"{INSTALL_HINT} (or pip install tensorboard), or set tensorboard: false") from None


def log_dir(run_dir: str | Path) -> Path:
    """Where a run's event file goes."""
    return Path(run_dir) / SUBDIR


class TensorBoardLog:
    """One SummaryWriter for the run; ``write`` adds one step line's scalars and flushes (a crash keeps them)."""

    def __init__(self, directory: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(directory)
        self._writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for name, tag in TAGS.items():
            value = record.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


__all__ = ["INSTALL_HINT", "SUBDIR", "TAGS", "TensorBoardLog", "check_available", "log_dir"]
