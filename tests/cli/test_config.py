"""Config loading: precedence, and a table of malformed configs that each give one clear line and exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hal.config import load_config, read_config_file
from hal.errors import ConfigError

from ..conftest import REPO, has_cuda, run_hal

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
    ("over-1-MiB", b"#" * ((1 << 20) + 1), [], {}, ["is too large for a config file"]),
    # the run sections are checked too, as hal plan and hal train check them
    ("run-sections", b"backend: cpu\nmodel: {num_layers: -5}\nparallel: {stages: 7}\ntrain: {steps: -1}\n", [], {},
     ["model.num_layers", "-5"]),
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


def test_a_whole_run_config_is_checked_and_says_so() -> None:
    result = run_hal("config", "--config", "examples/hetero_cpu.yaml")
    assert result.returncode == 0 and "-> model, parallel, train: checked" in result.stdout, result.stderr


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
        assert report["backend"] == "cpu" and "passed over cuda" in report["reason"]
    assert report["config"]["origins"]["precision"] == str(path)


# --- hostile input: bounded before anything is built --------------------------------------------------------

HOSTILE_YAML = {
    "billion laughs": ("a: &a [x,x,x,x,x,x,x,x,x,x]\n"
                       + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 10) + "]\n" for i in range(9)),
                       "expands to more than 100000 values"),
    "recursive anchor": ("a: &x [1, *x]\n", "a recursive alias (line 1) refers to itself"),
    "deep nesting": ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    "nesting past the limit": ("a: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 32 levels"),
    "repeated key behind an alias": ("base: &b {tp: 2, tp: 4}\nother: *b\n", "key 'tp' appears twice"),
}


@pytest.mark.timeout(60)  # the unbounded walk took hours on the billion laughs: a regression fails, not hangs
@pytest.mark.parametrize("case", HOSTILE_YAML)
def test_hostile_yaml_is_one_line_before_anything_is_built(case: str, tmp_path: Path) -> None:
    from hal.config import read_config_file

    text, needle = HOSTILE_YAML[case]
    path = tmp_path / "hostile.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        read_config_file(path)
    assert needle in str(caught.value), str(caught.value)


ABSURD = {
    "devices 1e9": (("parallel", "stages", 1), {"devices": 10**9, "dp": 10**9}, "is 1000000000, above the limit 4096"),
    "micro_batches 1e12": (("parallel",), {"micro_batches": 10**12}, "above the limit 65536 (micro-batches in one step)"),
    "hidden_size 2**34": (("model",), {"hidden_size": 2**34}, "above the limit 65536 (hidden width)"),
    "seed 2**70": (("train",), {"seed": 2**70}, "torch generators take a 64-bit seed"),
    "norm_eps nan": (("model",), {"norm_eps": float("nan")}, "'model.norm_eps' must be a positive number, got nan"),
    "rope_theta inf": (("model",), {"rope_theta": float("inf")}, "'model.rope_theta' must be a positive number, got inf"),
}


@pytest.mark.parametrize("case", ABSURD)
def test_absurd_values_are_refused_naming_the_limit(case: str, tmp_path: Path) -> None:
    import yaml

    from hal.parallel.config.run import load_run_config

    where, change, needle = ABSURD[case]
    raw = yaml.safe_load((REPO / "examples/hetero_cpu.yaml").read_text(encoding="utf-8"))
    target = raw
    for part in where:
        target = target[part]
    target.update(change)
    path = tmp_path / "absurd.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_run_config(str(path))
    assert needle in str(caught.value), str(caught.value)


def test_local_rank_counts_are_bounded_before_anything_starts() -> None:
    from hal.config.limits import LOCAL_RANKS, check_local_ranks

    check_local_ranks(LOCAL_RANKS.maximum, "--nproc")
    with pytest.raises(ConfigError, match=f"--nproc {LOCAL_RANKS.maximum + 1} is above the limit {LOCAL_RANKS.maximum}"):
        check_local_ranks(LOCAL_RANKS.maximum + 1, "--nproc")
    result = run_hal("launch", "--nproc", "100000", "--backend", "cpu", "examples/cuda_train.py")
    assert result.returncode == 2 and "--nproc 100000 is above the limit" in result.stderr


@pytest.mark.parametrize("command", [["config", "--config"], ["profile", "--quick", "--out", "{out}", "--config"],
                                     ["plan", "--search", "--config"]])
def test_every_command_that_reads_a_run_comes_through_the_preflight(command: list[str], tmp_path: Path) -> None:
    """hal config, hal profile and hal plan --search run the preflight's checks (here its 'environment' check, which
    their own loading never made): one line, exit 2, nothing measured or written."""
    out = tmp_path / "profile.json"
    args = [a.replace("{out}", str(out)) for a in command]
    result = run_hal(*args, str(REPO / "examples" / "hetero_cpu.yaml"), env={"HAL_DUMP_STACKS_AFTER_S": "soon"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "hal: error: HAL_DUMP_STACKS_AFTER_S='soon' is not a positive number of seconds; e.g. 60"]
    assert not out.exists()
