"""The ``hal`` command as a new user meets it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import REPO, has_cuda, run_hal

UNAVAILABLE_REASONS = {
    "cuda": "no CUDA support",
    "rocm": "no ROCm/HIP support",
    "ascend": "torch_npu is not installed",
    "cambricon": "torch_mlu is not installed",
}


@pytest.mark.skipif(has_cuda(), reason="this machine has a GPU")
def test_devices_lists_cpu_available_and_vendors_unavailable_with_reasons() -> None:
    result = run_hal("devices")
    assert result.returncode == 0, result.stderr
    blocks = {b.split()[0]: b for b in result.stdout.split("\n\n")[1:] if b.strip()}
    assert "available" in blocks["cpu"].split("\n")[0] and "unavailable" not in blocks["cpu"].split("\n")[0]
    for name, reason in UNAVAILABLE_REASONS.items():
        assert "unavailable" in blocks[name].split("\n")[0], blocks[name]
        assert reason in blocks[name]
        verified = "H100" if name == "cuda" else "not verified on hardware"
        line = next(line for line in blocks[name].splitlines() if line.strip().startswith("verified "))
        assert verified in line, line


def test_devices_json_is_valid_and_complete() -> None:
    result = run_hal("devices", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {b["name"]: b for b in report["backends"]}
    assert set(UNAVAILABLE_REASONS) | {"cpu"} <= set(by_name)
    cpu = by_name["cpu"]
    assert cpu["available"] and cpu["device_count"] == 1 and cpu["ccl"] == "gloo"
    device = cpu["devices"][0]
    assert device["memory_total_bytes"] > 0 and device["dtypes"]["fp32"] == "native"
    for name in ("ascend", "cambricon", "rocm"):
        assert by_name[name]["verified_on_hardware"] is False
        assert by_name[name]["verification"] == "not verified on hardware"
    if not has_cuda():
        for name, reason in UNAVAILABLE_REASONS.items():
            assert not by_name[name]["available"] and reason in by_name[name]["reason"]
    assert report["auto"]["backend"] in by_name


@pytest.mark.parametrize("command", [[], ["devices"], ["config"], ["ops"], ["run"]])
def test_help_on_every_command(command) -> None:
    result = run_hal(*command, "--help")
    assert result.returncode == 0 and "usage: hal" in result.stdout


def test_console_script_and_module_agree() -> None:
    """``python -m hal`` exists for people without the console script on PATH."""
    result = subprocess.run([sys.executable, "-m", "hal", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0 and "devices" in result.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["bogus"], "unknown command 'bogus'"),
        (["devics"], "unknown command 'devics'; did you mean 'devices'?"),
        (["devices", "--jsn"], "unrecognized argument: --jsn; did you mean '--json'? (see 'hal devices --help')"),
        (["conformance", "run", "--sute", "ops"], "did you mean '--suite'? (see 'hal conformance run --help')"),
        (["ops", "--backend", "cdua"], "did you mean 'cuda'"),
        (["run", "--backend", "cpu", "missing_script.py"], "script 'missing_script.py' not found"),
        (["run", "--backend", "cuda", "examples/cuda_train.py"], "backend 'cuda' is not available"),
        ([], "give a command: devices, config, ops, run, launch, bench, profile, plan, train, export, conformance, data"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args, needle) -> None:
    if "cuda" in args and has_cuda():
        pytest.skip("cuda is available here")
    result = run_hal(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error:") and needle in lines[0], result.stderr
    assert not lines[0].startswith("hal: error: hal"), "doubled prefix"


def test_plan_and_config_take_the_config_as_train_does() -> None:
    """`hal plan F`, `hal plan --config F` and `hal config F` all work; two different files are one line."""
    positional, flag = run_hal("plan", "examples/hetero_cpu.yaml"), run_hal("plan", "--config", "examples/hetero_cpu.yaml")
    assert positional.returncode == flag.returncode == 0 and positional.stdout == flag.stdout
    assert "from examples/hetero_cpu.yaml" in run_hal("config", "examples/hetero_cpu.yaml").stdout
    both = run_hal("plan", "--config", "a.yaml", "b.yaml")
    assert both.returncode == 2 and "two configs given (b.yaml and --config a.yaml)" in both.stderr
    missing = run_hal("train", "nosuch.yaml")
    assert missing.returncode == 2 and "nosuch.yaml: config file not found; check the path" in missing.stderr
    assert "--config" not in missing.stderr  # hal train takes the file as its first argument


def test_the_auto_selection_reason_is_one_short_line() -> None:
    from hal.selection import choose_backend

    _backend, reason = choose_backend("auto")
    assert len(reason) < 200 and "\n" not in reason, reason


def test_readme_main_job_matches_the_cpu_twin() -> None:
    """`hal run --backend cpu examples/cuda_train.py` (the README's migration example) equals the CPU twin."""
    migrated = run_hal("run", "--backend", "cpu", "examples/cuda_train.py", "--steps", "4")
    assert migrated.returncode == 0, migrated.stderr
    twin = subprocess.run([sys.executable, "examples/cpu_train_twin.py", "--steps", "4"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert twin.returncode == 0, twin.stderr
    losses = lambda out: [json.loads(line)["loss"] for line in out.splitlines() if line.startswith('{"step"')]
    assert len(losses(migrated.stdout)) == 4 and losses(migrated.stdout) == losses(twin.stdout)
    assert "hal run: backend cpu" in migrated.stderr
