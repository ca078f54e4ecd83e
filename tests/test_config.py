"""Config loading: precedence, and a table of malformed configs that each give one clear line and exit 2."""
from __future__ import annotations

import json

import pytest

from hal.config import load_config, read_config_file
from hal.errors import ConfigError

from .conftest import has_cuda, run_hal

# (id, file bytes, extra CLI args, extra env, words the one-line error must contain)
MALFORMED = [
    ("unknown-key", b"backnd: cpu\n", [], {}, ["unknown key 'backnd'", "did you mean 'backend'"]),
    ("backend-wrong-type", b"backend: 3\n", [], {}, ["'backend' must be a string", "int"]),
    ("backend-unknown", b"backend: tpu\n", [], {}, ["'tpu' is not allowed", "cpu, cuda, rocm"]),
    ("precision-unknown", b"precision: bf8\n", [], {}, ["'precision'", "'bf8'", "fp32, tf32, bf16-mixed"]),
    ("fallback-unknown", b"fallback: maybe\n", [], {}, ["'fallback'", "'maybe'", "error, warn, allow"]),
    ("devices-negative", b"devices: -1\n", [], {}, ["'devices'", "-1", "not a device index"]),
    ("devices-word", b"devices: two\n", [], {}, ["'devices'", "'two'", "'all'"]),
    ("devices-bool", b"devices: true\n", [], {}, ["'devices'", "True"]),
    ("devices-empty", b"devices: []\n", [], {}, ["'devices'", "non-empty"]),
    ("devices-repeated", b"devices: [0, 0]\n", [], {}, ["lists a device twice"]),
    ("devices-out-of-range", b"backend: cpu\ndevices: [3]\n", [], {}, ["asks for [3]", "1 device(s)"]),
    ("top-level-list", b"- backend: cpu\n", [], {}, ["top level must be a mapping", "list"]),
    ("yaml-syntax", b"backend: [cpu\n", [], {}, ["not valid YAML", "line"]),
    ("not-utf8", b"backend: cpu\nprecision: \xff\xfe\n", [], {}, ["not UTF-8", "0xff", "save the file as UTF-8"]),
    ("python-tag", b"backend: !!python/object/apply:os.system ['echo pwned']\n", [], {}, ["not valid YAML"]),
    ("duplicate-key", b"backend: cpu\nbackend: cuda\n", [], {}, ["'backend' appears twice", "line 2"]),
    ("backend-unavailable", b"backend: cuda\n", [], {}, ["backend 'cuda' is not available", "no CUDA support"]),
    ("fp8-on-cpu", b"backend: cpu\nprecision: fp8-mixed\n", [], {}, ["fp8-mixed needs native fp8", "use bf16-mixed"]),
    ("fallback-error-refuses", b"backend: cpu\nprecision: tf32\nfallback: error\n", [], {}, ["tf32 -> fp32", "fallback is 'error'"]),
    ("env-backend-typo", b"precision: fp32\n", [], {"HAL_BACKEND": "cdua"}, ["environment HAL_BACKEND", "did you mean 'cuda'"]),
    ("flag-precision", b"backend: cpu\n", ["--precision", "fp64"], {}, ["--precision", "'fp64'"]),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_config_gives_one_line_and_exit_2(tmp_path, case) -> None:
    name, content, args, env, needles = case
    if name == "backend-unavailable" and has_cuda():
        pytest.skip("cuda is available on this machine")
    path = tmp_path / "hal.yaml"
    path.write_bytes(content)
    result = run_hal("config", "--config", str(path), *args, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("hal: error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    assert result.stdout == ""


def test_missing_config_file(tmp_path) -> None:
    result = run_hal("config", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "config file not found" in result.stderr


def test_python_tag_is_never_executed(tmp_path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "hal.yaml"
    path.write_text(f"backend: !!python/object/apply:os.system ['touch {marker}']\n")
    assert run_hal("config", "--config", str(path)).returncode == 2
    assert not marker.exists()


def test_precedence_default_file_env_flag(tmp_path) -> None:
    path = tmp_path / "hal.yaml"
    path.write_text("backend: cpu\nprecision: bf16-mixed\nfallback: allow\n")
    assert load_config(env={}).precision == "fp32"
    cfg = load_config(path, env={})
    assert (cfg.precision, cfg.origins["precision"]) == ("bf16-mixed", str(path))
    cfg = load_config(path, env={"HAL_PRECISION": "fp16-mixed"})
    assert (cfg.precision, cfg.origins["precision"]) == ("fp16-mixed", "environment HAL_PRECISION")
    cfg = load_config(path, env={"HAL_PRECISION": "fp16-mixed"}, overrides={"precision": "fp32"})
    assert (cfg.precision, cfg.origins["precision"]) == ("fp32", "--precision")
    assert cfg.fallback == "allow" and cfg.origins["fallback"] == str(path)


def test_empty_file_means_defaults(tmp_path) -> None:
    path = tmp_path / "hal.yaml"
    path.write_text("# nothing set\n")
    assert read_config_file(path) == {}
    assert load_config(path, env={}).backend == "auto"


def test_devices_forms(tmp_path) -> None:
    assert load_config(overrides={"devices": 2}, env={}).devices == (2,)
    assert load_config(overrides={"devices": [1, 0]}, env={}).devices == (1, 0)
    with pytest.raises(ConfigError):
        load_config(overrides={"devices": [1.5]}, env={})


def test_config_command_reports_resolution_as_json(tmp_path) -> None:
    path = tmp_path / "hal.yaml"
    path.write_text("backend: auto\nprecision: bf16-mixed\n")
    result = run_hal("config", "--config", str(path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["reason"].startswith("auto:")
    if not has_cuda():
        assert report["backend"] == "cpu" and "cuda unavailable" in report["reason"]
    assert report["config"]["origins"]["precision"] == str(path)
