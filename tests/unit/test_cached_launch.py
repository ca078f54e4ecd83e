"""CachedLauncher (hal.kernels.triton.launch): a compiled kernel is reused only for arguments Triton would
specialise alike, so its key must tell apart everything Triton's own specialisation does. The checks run in
processes of their own: Triton decides at import whether it compiles or interprets, and only a compiling
Triton keeps the parameter list the key is built from."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from ..conftest import REPO

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (pip install 'hetero-hal[kernels]')")]


def _python(code: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *code], env={**clean, **env}, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_the_key_tells_apart_what_triton_specialises_on_and_nothing_else() -> None:
    out = _python(["-m", "tests.cached_launch_checks"])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_environment_switch_turns_cached_launches_off() -> None:
    code = ("from hal.kernels.triton import moe_exchange; from hal.kernels.triton.launch import DIRECT_LAUNCH; "
            "print(DIRECT_LAUNCH, moe_exchange.launch_problem())")
    out = _python(["-c", code], HAL_TRITON_CACHED_LAUNCH="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False ") and "HAL_TRITON_CACHED_LAUNCH=0" in out.stdout, out.stdout
