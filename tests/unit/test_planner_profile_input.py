"""A damaged or hostile --profile file is refused in one ConfigError line naming the key, before it can crash or
mislead the cost model; a file that is not a small regular file is refused before it is read."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.cluster import parse_cluster, resolve
from hal.parallel.planner.device_profile import LinkProfile
from hal.parallel.planner.make_profile import make_profile
from hal.parallel.planner.profile_store import MAX_PROFILE_BYTES, load_profile

from ..conftest import run_hal

MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, max_seq_len=32)
CPU = "cpu-generic"


@pytest.fixture(scope="module")
def written() -> dict[str, Any]:
    """A profile as hal profile writes it for a shared cpu node: measured layers, calibration tables, measured links."""
    cluster = resolve(parse_cluster({"groups": [{"backend": "cpu", "device": CPU, "count": 2, "cores": 2}]}))
    prof = make_profile(cluster, MODEL, "fp32", 32, quick=True, links=False)
    prof.devices[CPU] = dataclasses.replace(prof.devices[CPU], contention=((0.5, 1.0, 0.0), (0.86, 4.1, 2e-5)),
                                            tp_all_reduce=((0.5, 0.0, 0.0), (1.0, 0.0033, 0.0006)))
    prof.links = {"cpu-island": LinkProfile("island", "cpu", 5.0, 20.0, "measured", "broadcast",
                                            {"all_reduce": (1e-4, 1e-2)}, (4 << 10, 16 << 20)),
                  "cpu-bridge": LinkProfile("bridge", "cpu", 2.0, 50.0, "measured", "broadcast")}
    return json.loads(json.dumps(prof.to_dict()))  # as read back: lists, not tuples


def _load(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return load_profile(path, MODEL, "fp32")


def _set(*keys: Any) -> Callable[[dict[str, Any], Any], None]:
    """A damage: the value at ``keys`` (dict keys and list indexes, from the top) replaced."""
    def damage(data: dict[str, Any], value: Any) -> None:
        for k in keys[:-1]:
            data = data[k]
        data[keys[-1]] = value
    return damage


def _drop(key: str) -> Callable[[dict[str, Any], Any], None]:
    return lambda data, _: data.pop(key)


DEV = ("devices", CPU)
DAMAGES = [  # (damage, value, what the refusal says)
    (_drop("model_key"), None, r"model_key: missing"),
    (_drop("precision"), None, r"precision: missing"),
    (_drop("devices"), None, r"devices: missing"),
    (_set("model"), [], r"model: must be an object \(got \[\]\)"),
    (_set("model_key"), 7, r"model_key: must be a string \(got 7\)"),
    (_set("meta"), [], r"meta: must be an object \(got \[\]\)"),
    (_set("links"), [], r"links: must be an object"),
    (_set("devices"), [], r"devices: must be an object"),
    (_set("seq"), "x", r"seq: must be an integer >= 1 .*\(got 'x'\)"),
    (_set("seq"), 0, r"seq: must be an integer >= 1"),
    (_set(*DEV), [], rf"devices.{CPU}: must be an object"),
    (_set(*DEV, "layers", 3, "forward_s"), "fast",
     rf"devices.{CPU}.layers\[3\].forward_s: must be a finite number of seconds >= 0 .*\(got 'fast'\); run hal profile again"),
    (_set(*DEV, "layers", 0, "forward_s"), -1.0, r"layers\[0\].forward_s: must be a finite number of seconds >= 0"),
    (_set(*DEV, "layers", 0, "backward_s"), 1e300, r"layers\[0\].backward_s: .*<= 86400"),
    (_set(*DEV, "layers", 0, "forward_s"), True, r"layers\[0\].forward_s: .*\(got True\)"),
    (_set(*DEV, "layers", 0, "activation_bytes"), -8, r"layers\[0\].activation_bytes: must be an integer >= 0"),
    (_set(*DEV, "layers", 0, "activation_bytes"), 1.5, r"layers\[0\].activation_bytes: must be an integer"),
    (_set(*DEV, "layers", 0, "rows"), 0, r"layers\[0\].rows: must be an integer >= 1"),
    (_set(*DEV, "layers", 0, "rows"), 2.0, r"layers\[0\].rows: must be an integer >= 1"),
    (_set(*DEV, "layers", 0, "rows"), 10**30, r"layers\[0\].rows: must be an integer >= 1 and <= 1048576"),
    (_set(*DEV, "layers", 0, "seq"), 0, r"layers\[0\].seq: must be an integer >= 1"),
    (_set(*DEV, "layers", 0, "tp"), 0, r"layers\[0\].tp: must be an integer >= 1"),
    (_set(*DEV, "layers", 0, "recompute"), "no", r"layers\[0\].recompute: must be true or false"),
    (_set(*DEV, "layers", 0, "sp"), 1, r"layers\[0\].sp: must be true or false"),
    (_set(*DEV, "layers", 0, "host_forward_s"), 0.001, r"layers\[0\]: host_forward_s, .* must be all numbers or all null"),
    (_set(*DEV, "layers", 0, "host_forward_s"), "x", r"layers\[0\].host_forward_s: .* or null \(got 'x'\)"),
    (_set(*DEV, "layers"), {}, rf"devices.{CPU}.layers: must be a list"),
    (_set(*DEV, "layers"), [[1]] * 5000, rf"devices.{CPU}.layers: 5000 entries, more than the 4096"),
    (_set(*DEV, "layers", 0), [], r"layers\[0\]: must be an object"),
    (_set(*DEV, "embedding"), 3, rf"devices.{CPU}.embedding: must be an object"),
    (_set(*DEV, "head", "forward_s"), 1e300, rf"devices.{CPU}.head.forward_s: must be a finite number"),
    (_set(*DEV, "head", "transient_bytes"), -1, r"head.transient_bytes: must be an integer >= 0"),
    (_set(*DEV, "optimizer_s_per_param"), -1e-9, r"optimizer_s_per_param: must be a finite number of seconds >= 0"),
    (_set(*DEV, "threads"), 0, rf"devices.{CPU}.threads: must be an integer >= 1 .* or null \(got 0\)"),
    (_set(*DEV, "achieved_tflops"), -1, r"achieved_tflops: must be a finite number >= 0"),
    (_set(*DEV, "efficiency"), "high", r"efficiency: must be a finite number >= 0"),
    (_set(*DEV, "action_host_s"), -1, r"action_host_s: must be a finite number of seconds >= 0"),
    (_set(*DEV, "source"), "guessed", r"source: must be 'measured' or 'estimated'"),
    (_set(*DEV, "basis"), None, r"basis: must be a string"),
    (_set(*DEV, "device"), "nvidia-h100-sxm", rf"devices.{CPU}.device: names 'nvidia-h100-sxm', not the device type '{CPU}'"),
    (_set(*DEV, "contention"), [[1]], rf"devices.{CPU}.contention\[0\]: must be a list of 2 or 3 numbers \(got \[1\]\)"),
    (_set(*DEV, "contention"), [[0, 0, 0]], rf"devices.{CPU}.contention\[0\]\[1\]: must be a finite number > 0"),
    (_set(*DEV, "contention"), [[0.5, 1.0, -1.0]], r"contention\[0\]\[2\]: must be a finite number of seconds >= 0"),
    (_set(*DEV, "contention"), [[-0.5, 1.0]], r"contention\[0\]\[0\]: must be a finite number >= 0"),
    (_set(*DEV, "contention"), "x", r"contention: must be a list"),
    (_set(*DEV, "tp_all_reduce"), [[1]], r"tp_all_reduce\[0\]: must be a list of 2 or 3 numbers"),
    (_set(*DEV, "tp_all_reduce"), [[0.5, "x"]], r"tp_all_reduce\[0\]\[1\]: must be a finite number of seconds"),
    (_set("links", "cpu-island", "bandwidth_gbps"), 0, r"links.cpu-island.bandwidth_gbps: must be a finite number > 0"),
    (_set("links", "cpu-island", "latency_us"), -1, r"links.cpu-island.latency_us: must be a finite number >= 0"),
    (_set("links", "cpu-island"), [], r"links.cpu-island: must be an object"),
    (_set("links", "cpu-island", "loaded_collectives"), {"all_reduce": [1]},
     r"loaded_collectives.all_reduce: must be a list of 2 numbers"),
    (_set("links", "cpu-island", "loaded_collectives"), {"all_reduce": [1e-4, "x"]}, r"loaded_collectives.all_reduce\[1\]: must be"),
    (_set("links", "cpu-island", "loaded_collectives"), [], r"loaded_collectives: must be an object"),
    (_set("links", "cpu-island", "loaded_sizes"), [4096], r"loaded_sizes: must be a list of 2 integers"),
    (_set("links", "cpu-island", "loaded_sizes"), [4096, -1], r"loaded_sizes\[1\]: must be an integer >= 0"),
    (_set("devices", "x" * 300), {}, r"devices: a key of 300 characters \('xxx.*more than the 200"),
    (_set("precision"), "p" * 10_000, r"measured at precision 'p{12}\.\.\.p{13}', the config trains fp32"),
    (_set(*DEV, "layers", 0, "color"), "red", r"a damaged profile \(TypeError: devices.cpu-generic.layers\[0\]: .*color"),
    (_set(*DEV, "colour"), "red", rf"a damaged profile \(TypeError: devices.{CPU}: .*colour"),
    (_set("links", "cpu-island", "colour"), "red", r"a damaged profile \(TypeError: links.cpu-island: .*colour"),
]


@pytest.mark.parametrize(("damage", "value", "says"), DAMAGES, ids=[d[2][:50] for d in DAMAGES])
def test_a_damaged_value_is_refused_in_one_line_naming_its_key(written, tmp_path, damage, value, says) -> None:
    data = copy.deepcopy(written)
    damage(data, value)
    with pytest.raises(ConfigError, match=says) as err:
        _load(tmp_path, data)
    assert str(err.value).startswith(f"--profile {tmp_path / 'p.json'}: ") and "\n" not in str(err.value)
    assert str(err.value).endswith(("run hal profile again", "run hal profile with this config"))


def test_what_hal_profile_writes_still_loads_with_nulls_and_older_fields_absent(written, tmp_path) -> None:
    back = _load(tmp_path, written)
    assert json.loads(json.dumps(back.to_dict())) == written and back.devices[CPU].stretch(0.86) == pytest.approx(4.1)
    assert back.links["cpu-island"].collective_s("all_reduce", 1 << 20, 2) is not None
    old = copy.deepcopy(written)  # a profile from before the later fields: each has its default
    for key in ("seq", "meta", "links"):
        del old[key]
    dev = old["devices"][CPU]
    for key in ("threads", "achieved_tflops", "efficiency", "action_host_s"):
        dev[key] = None
    del dev["action_host_s"]
    dev["contention"] = [p[:2] for p in dev["contention"]]
    dev["tp_all_reduce"] = [p[:2] for p in dev["tp_all_reduce"]]
    for p in dev["layers"]:
        for key in ("host_forward_s", "host_backward_s", "device_forward_s", "device_backward_s", "sp"):
            p.pop(key)
    dev["head"].pop("transient_bytes")
    back = _load(tmp_path, old)
    assert back.seq == 0 and back.links == {} and back.devices[CPU].action_wait_s(0.9) == 0.0
    assert back.devices[CPU].threads_or_one() == 1 and back.devices[CPU].layer(1, 2, 32, False)[0] > 0
    clocked = copy.deepcopy(written)  # an accelerator's two clocks, all four numbers
    clocked["devices"][CPU]["layers"][0].update(host_forward_s=1e-4, host_backward_s=2e-4, device_forward_s=1e-3, device_backward_s=2e-3)
    _load(tmp_path, clocked)


@pytest.mark.parametrize(("text", "says"), [
    ('{"schema": 1, "x": NaN}', r"not a profile \(NaN is not a JSON number\)"),
    ('{"schema": 1, "x": -Infinity}', r"not a profile \(-Infinity is not a JSON number\)"),
    ("[" * 200_000 + "]" * 200_000, r"not a profile \(JSON nested too deeply\)"),
    ('{"schema": 1, "x": ' + "9" * 5000 + "}", r"not a profile \(a number of too many digits\)"),
    ('{"schema": true}', r"not a hal profile of schema 1"),
    ('{"schema": 1.0}', r"not a hal profile of schema 1"),
])
def test_text_that_is_not_a_profile_is_refused(tmp_path, text, says) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        load_profile(path, MODEL, "fp32")


def test_nan_in_a_written_profile_is_refused(written, tmp_path) -> None:
    data = copy.deepcopy(written)
    data["devices"][CPU]["layers"][0]["forward_s"] = float("nan")  # json.dumps writes NaN; json.load would read it
    with pytest.raises(ConfigError, match=r"not a profile \(NaN is not a JSON number\); run hal profile again"):
        _load(tmp_path, data)
    text = json.dumps(written).replace('"backward_s": ', '"backward_s": 1e999, "x": ', 1)  # read as inf, not a constant
    (tmp_path / "inf.json").write_text(text)
    with pytest.raises(ConfigError, match=r"backward_s: must be a finite number"):
        load_profile(tmp_path / "inf.json", MODEL, "fp32")


def test_bytes_that_are_not_utf8_are_refused(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b'{"schema": 1, "x": "\xff"}')
    with pytest.raises(ConfigError, match=r"not a profile \(not UTF-8 text at byte 20\)"):
        load_profile(path, MODEL, "fp32")


def test_a_large_or_special_file_is_refused_before_it_is_read(tmp_path, monkeypatch) -> None:
    sparse = tmp_path / "sparse.json"
    with open(sparse, "wb") as f:
        f.truncate(MAX_PROFILE_BYTES + 1)  # no disk used; read whole, it would be 16 MiB of memory
    opened: list[Any] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    with pytest.raises(ConfigError, match=r"larger than 16 MiB, the most a profile may be"):
        load_profile(sparse, MODEL, "fp32")
    for special in ("/dev/zero", str(tmp_path)):
        with pytest.raises(ConfigError, match=r"not a regular file; give the JSON file hal profile --out wrote"):
            load_profile(special, MODEL, "fp32")
    assert opened == []  # refused from the stat alone
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would wait for a writer forever
    with pytest.raises(ConfigError, match=r"not a regular file"):
        load_profile(fifo, MODEL, "fp32")
    with pytest.raises(ConfigError, match=r"cannot read it \(No such file or directory\); run hal profile --config F"):
        load_profile(tmp_path / "absent.json", MODEL, "fp32")


@pytest.mark.multiprocess  # hal plan in a fresh process
def test_hal_plan_refuses_a_damaged_profile_in_one_line(written, tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("backend: cpu\nprecision: fp32\n"
                      f"model: {json.dumps(dataclasses.asdict(MODEL))}\n"
                      "parallel: {micro_batches: 2, micro_batch_size: 2, stages: [{backend: cpu, devices: 1, layers: 4}]}\n"
                      "train: {steps: 1, seq_len: 32, data: synthetic}\n"
                      "cluster:\n  groups: [{backend: cpu, device: cpu-generic, count: 2, cores: 2}]\n")
    data = copy.deepcopy(written)
    data["devices"][CPU]["layers"][0]["rows"] = 0  # was a ZeroDivisionError traceback in the cost model
    (tmp_path / "p.json").write_text(json.dumps(data))
    out = run_hal("plan", "--search", "--config", str(config), "--profile", str(tmp_path / "p.json"))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"hal: error: --profile {tmp_path / 'p.json'}: devices.{CPU}.layers[0].rows: must be an integer >= 1 and <= 1048576 "
        "(got 0); run hal profile again"], out.stderr
