"""``hal conformance survey`` end to end: the CPU survey's files and digest, a tampered results.json caught by
``verify``, and planted faults on the Ascend stand-in — a slightly wrong kernel, a silent trip to the host, a
fallback the runtime warns about — each caught and named, and read side by side with the CPU's by ``compare``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hal.conformance.reports.provenance import seal

from ..conftest import run_hal
from ..plain_client import run_plain, shared

REPO = Path(__file__).resolve().parents[2]
OPS = "ex[p],tan[h],sigmoi[d],mu[l]"  # globs: exactly these four ops of op_db


def test_a_cpu_survey_writes_its_tables_and_verify_catches_an_edited_result(tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    done = run_hal("conformance", "survey", "--backend", "cpu", "-k", OPS, "--dtypes", "float32,bfloat16,int64",
                   "--jobs", "2", "--report", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "strict rate 100.0 % (4 of 4 tested ops)" in done.stdout and "of which golden" in done.stdout
    assert "survey: " in done.stderr and "(op, dtype) pairs" in done.stderr  # progress
    doc = json.loads((out / "results.json").read_text())
    assert {f["op"] for f in doc["findings"]} == {"exp", "tanh", "sigmoid", "mul"}
    assert all(f["status"] == "pass" and f["samples"] >= 1 for f in doc["findings"] if f["dtype"] != "int64" or f["op"] == "mul")
    assert doc["findings"][0]["backward"] is True
    prov = doc["provenance"]
    assert prov["versions"]["torch"] and prov["device"]["count"] >= 1 and prov["standin"] is None
    assert prov["host_fallbacks"] == 0 and ("commit" in prov["revision"] or prov["revision"]["hal_version"])
    assert doc["digest"] in (out / "report.html").read_text() and doc["digest"].startswith("sha256:")

    intact = run_hal("conformance", "verify", str(out))
    assert intact.returncode == 0 and "intact" in intact.stdout, intact.stdout + intact.stderr
    doc["findings"][0]["status"] = "failed"
    (out / "results.json").write_text(json.dumps(doc))
    edited = run_hal("conformance", "verify", str(out / "results.json"))
    assert edited.returncode == 1 and "CHANGED" in edited.stdout, edited.stdout
    (out / "results.json").write_text(json.dumps(seal(doc)))  # the digest recomputed: report.html still shows the old one
    resealed = run_hal("conformance", "verify", str(out), "--json")
    assert resealed.returncode == 1 and json.loads(resealed.stdout)["ok"] is False

    again = run_hal("conformance", "survey", "--backend", "cpu", "-k", OPS, "--report", str(out))
    assert again.returncode == 2 and "already holds" in again.stderr and again.stderr.count("\n") == 1
    for bad, words in ((["--dtypes", "float8"], "not a survey dtype"), (["--samples", "0"], "give 1 to 64"),
                       (["-k", "no_such_op_anywhere"], "matches no op")):
        refused = run_hal("conformance", "survey", "--backend", "cpu", *bad, "--report", str(tmp_path / "x"))
        assert refused.returncode == 2 and words in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
        assert not (tmp_path / "x").exists()  # refused before anything was written
    (tmp_path / "x").mkdir()
    unreadable = run_hal("conformance", "verify", str(tmp_path / "x"))
    assert unreadable.returncode == 2 and "holds no results.json" in unreadable.stderr


PLANTED = """
    import sys, warnings, torch
    from hal.backends.standins import host_device

    def exp_slightly_wrong(x, *args, **kwargs):  # a kernel 2^-9 off: inside bf16's tolerance, far outside fp32's
        return torch.exp(x) * (1 + 2 ** -9)

    def tanh_on_the_host(x, *args, **kwargs):  # silently: copy to the host, compute there, copy back
        return torch.tanh(x.cpu()).to(x.device)

    def sigmoid_said_to_fall_back(x, *args, **kwargs):  # the runtime's own words, as torch_npu's fallback prints them
        warnings.warn("CAUTION: The operator 'aten::sigmoid' is not currently supported on the NPU backend and will "
                      "fall back to run on the CPU. This may have performance implications.")
        return torch.sigmoid(x)

    host_device.DEVICE_KERNELS.update(exp=exp_slightly_wrong, tanh=tanh_on_the_host, sigmoid=sigmoid_said_to_fall_back)
    from hal.cli import main
    sys.exit(main(["conformance", "survey", "--backend", "ascend", "--standin", "ascend", "-k", OPS,
                   "--dtypes", "float32,bfloat16,int64", "--jobs", "1", "--report", OUT]))
"""


def test_planted_faults_on_the_standin_are_caught_and_compare_names_them(tmp_path: Path) -> None:
    out = tmp_path / "npu"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HAL_")}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = textwrap.dedent(PLANTED).replace("OPS", repr(OPS)).replace("OUT", repr(str(out)))
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    else:
        done = run_plain(shared(), ["-c", code], env, REPO, 300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]  # 1: a wrong answer was found
    doc = json.loads((out / "results.json").read_text())
    found = {(f["op"], f["dtype"]): f for f in doc["findings"]}
    assert found[("exp", "float32")]["status"] == "failed"
    assert "outside the tolerance" in found[("exp", "float32")]["detail"] and found[("exp", "float32")]["sample"]
    assert found[("exp", "bfloat16")]["status"] == "pass"  # 2^-9 is within one bf16 rounding: BASIC would need fp32
    assert found[("tanh", "float32")]["status"] == "fallback"
    assert "copied from the device to the host" in found[("tanh", "float32")]["detail"]
    assert found[("sigmoid", "float32")]["status"] == "fallback" and "aten::sigmoid" in found[("sigmoid", "float32")]["detail"]
    assert all(f["status"] == "pass" for f in doc["findings"] if f["op"] == "mul")
    assert doc["standin"] and doc["provenance"]["standin"] and doc["provenance"]["runtime"].get("torch_npu")
    assert doc["provenance"]["host_fallbacks"] == sum(1 for f in doc["findings"] if f["status"] == "fallback")
    assert "FAILED" in done.stdout and "exp float32" in done.stdout

    cpu = tmp_path / "cpu"
    base = run_hal("conformance", "survey", "--backend", "cpu", "-k", OPS, "--dtypes", "float32,bfloat16,int64",
                   "--jobs", "1", "--report", str(cpu))
    assert base.returncode == 0, base.stderr[-2000:]
    cmp = run_hal("conformance", "compare", str(cpu / "results.json"), str(out / "results.json"), "--json")
    assert cmp.returncode == 1, cmp.stderr
    result = json.loads(cmp.stdout)
    worse = {(w["op"], w["dtype"]): (w["a"], w["b"]) for w in result["worse"]}
    assert worse[("exp", "float32")] == ("pass", "failed") and worse[("tanh", "float32")] == ("pass", "fallback")
    assert result["same_cohort"] is True and not result["better"]
