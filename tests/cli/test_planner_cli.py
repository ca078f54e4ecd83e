"""hal profile and hal plan --search as a user runs them: a written plan that hal train runs as is; bad input exit 2."""
from __future__ import annotations

import json

import yaml

from ..conftest import run_hal

CONFIG = """backend: cpu
precision: fp32
model: {vocab_size: 256, hidden_size: 32, num_layers: 4, num_heads: 2, num_kv_heads: 2, ffn_hidden_size: 64, max_seq_len: 16}
parallel: {micro_batches: 4, micro_batch_size: 2, stages: [{backend: cpu, devices: 1, layers: 4}]}
train: {steps: 2, data: synthetic}
cluster:
  groups: [{backend: cpu, device: cpu-generic, count: 2, cores: 2}]
"""


def test_profile_search_write_train(tmp_path) -> None:
    config, written = tmp_path / "run.yaml", tmp_path / "plan.yaml"
    profile = tmp_path / "new" / "deeper" / "p.json"  # a missing folder is made
    config.write_text(CONFIG)
    out = run_hal("profile", "--config", str(config), "--out", str(profile), "--quick")
    assert out.returncode == 0, out.stderr
    assert [p.name for p in profile.parent.iterdir()] == ["p.json"]  # written whole: no temporary file beside it
    assert "cpu-generic (cpu): measured" in out.stdout and "hal profile: cpu-generic: one layer" in out.stderr
    assert "in a run on a shared node (occupancy → slowdown): 0.50 → 1.00×; " in out.stdout  # 1 of 2 cores: one rank alone
    out = run_hal("plan", "--search", "--config", str(config), "--profile", str(profile), "--top", "2", "--write", str(written))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tokens/s") == 2 and "compute (estimated" not in out.stdout  # the cpu was measured
    assert "cpu-generic link (2 GB/s, documented default)" in out.stdout  # --quick measured no link: said so
    assert "without calibration" not in out.stdout  # hal profile calibrated the shared node
    uncalibrated = run_hal("plan", "--search", "--config", str(config), "--top", "1")
    assert uncalibrated.returncode == 0 and "without calibration" in uncalibrated.stdout, uncalibrated.stdout
    plan = yaml.safe_load(written.read_text())["parallel"]
    assert sum(s["devices"] for s in plan["stages"]) == 2 and plan["micro_batches"] * plan["micro_batch_size"] == 8
    out = run_hal("train", str(written), "--steps", "2", "--json", "--profile", "--run-dir", str(tmp_path / "run"), timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["last_step"] == 2
    # the picture puts the planner's own timeline above the simulator's and the measured ranks
    timeline = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert timeline["planned"]["step_s"] == yaml.safe_load(written.read_text())["planned"]["step_s"]
    assert "planned and predicted against measured" in out.stderr and (tmp_path / "run" / "timeline.png").is_file()
    out = run_hal("plan", "--config", str(written), "--timeline", str(tmp_path / "planned.png"))
    assert out.returncode == 0 and "the planner's predicted timeline" in out.stderr, out.stderr
    assert (tmp_path / "planned.png").read_bytes()[:4] == b"\x89PNG"
    # a damaged planned: section is refused before any rank starts, in one line
    damaged = tmp_path / "damaged.yaml"
    damaged.write_text(written.read_text().replace("    forward_s:", "    forward_s: oops\n    old_forward_s:"))
    out = run_hal("train", str(damaged), "--steps", "1", "--run-dir", str(tmp_path / "damaged-run"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "planned.simulate" in out.stderr and not (tmp_path / "damaged-run").exists()
    # an edited plan trains, says its prediction no longer applies, and draws none
    edited = tmp_path / "edited.yaml"
    edited.write_text(written.read_text().replace("fused_head: false", "fused_head: true"))
    out = run_hal("train", str(edited), "--steps", "1", "--profile", "--run-dir", str(tmp_path / "edited-run"), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "planned: was written for another parallel: section" in out.stderr
    assert "planned" not in json.loads((tmp_path / "edited-run" / "timeline.json").read_text())
    out = run_hal("plan", "--config", str(edited), "--timeline", str(tmp_path / "edited.png"))
    assert out.returncode == 0 and "planned: was written for another parallel: section" in out.stderr, out.stderr
    # --search draws plan #1's predicted timeline; --write never replaces a file the search reads
    out = run_hal("plan", "--search", "--config", str(config), "--profile", str(profile), "--top", "1",
                  "--timeline", str(tmp_path / "searched.png"))
    assert out.returncode == 0 and "the planner's predicted timeline of plan #1" in out.stderr, out.stderr
    assert (tmp_path / "searched.png").read_bytes()[:4] == b"\x89PNG"
    before = config.read_text()
    out = run_hal("plan", "--search", "--config", str(config), "--profile", str(profile), "--write", str(config))
    assert out.returncode == 2 and "is the --config file this search reads" in out.stderr, out.stderr
    assert config.read_text() == before
    # the profile of another model is refused in one line
    other = tmp_path / "other.yaml"
    other.write_text(CONFIG.replace("hidden_size: 32", "hidden_size: 64"))
    out = run_hal("plan", "--search", "--config", str(other), "--profile", str(profile))
    assert out.returncode == 2 and "measured for another model (differs in hidden_size)" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_bad_cluster_and_what_if_through_the_command(tmp_path) -> None:
    config, cluster = tmp_path / "run.yaml", tmp_path / "c.yaml"
    config.write_text(CONFIG)
    cluster.write_text("cluster:\n  groups: [{backend: ascend, device: huawei-ascend-91b, count: 8}]\n")
    out = run_hal("plan", "--search", "--config", str(config), "--cluster", str(cluster))
    assert out.returncode == 2 and "did you mean 'huawei-ascend-910b'?" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    cluster.write_text("cluster:\n  groups:\n"
                       "    - {backend: cuda, device: nvidia-h100-sxm, count: 8, node: 0}\n"
                       "    - {backend: ascend, device: huawei-ascend-910b, count: 8, node: 1, peak_tflops: {fp32: 80},"
                       " memory_gb: 64, memory_bandwidth_gbps: 1600}\n")
    out = run_hal("plan", "--search", "--config", str(config), "--cluster", str(cluster), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert sorted(report["profile_estimated"]) == ["huawei-ascend-910b", "nvidia-h100-sxm"]
    assert all(p["prediction"]["estimated"] for p in report["plans"])
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("cluster:\n  groups: [{backend: cuda, device: nvidia-v100-sxm2-16gb, count: 1}]\n")
    big = tmp_path / "big.yaml"
    big.write_text(CONFIG.replace("hidden_size: 32", "hidden_size: 8192").replace("ffn_hidden_size: 64", "ffn_hidden_size: 32768"))
    out = run_hal("plan", "--search", "--config", str(big), "--cluster", str(tiny))
    assert out.returncode == 2 and "cannot" not in out.stdout and "needs at least" in out.stderr


def test_unwritable_outputs_are_refused_before_any_measuring(tmp_path) -> None:
    config, blocker = tmp_path / "run.yaml", tmp_path / "a-file"
    config.write_text(CONFIG)
    blocker.write_text("not a folder\n")
    for args, flag in ((("profile", "--config", str(config), "--out", str(tmp_path)), "--out"),  # a directory
                       (("profile", "--config", str(config), "--out", str(blocker / "p.json")), "--out"),
                       (("plan", "--search", "--config", str(config), "--write", str(blocker / "plan.yaml")), "--write")):
        out = run_hal(*args)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith(f"hal: error: {flag}") and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "one layer" not in out.stderr  # refused before measuring anything
    # (a missing folder made and the file written whole: test_profile_search_write_train, whose profile does it)



MOE_TIGHT = """backend: cpu
precision: fp32
model: {vocab_size: 256, hidden_size: 64, num_layers: 1, num_heads: 1, num_kv_heads: 1, ffn_hidden_size: 64,
        max_seq_len: 16, moe_num_experts: 16, moe_top_k: 2, moe_ffn_hidden_size: 512}
parallel: {micro_batches: 2, micro_batch_size: 2, stages: [{backend: cpu, devices: 2, layers: 1, dp: 2}]}
train: {steps: 1, data: synthetic}
cluster:
  groups: [{backend: cpu, device: cpu-generic, count: 2, cores: 2, memory_gb: MEMORY}]
"""


def test_search_shards_the_experts_where_a_copy_a_rank_does_not_fit(tmp_path) -> None:
    """One MoE layer of 1.6M expert parameters (25 MB of training state a copy) on two cpu ranks sharing a node:
    a copy each (ep 1) needs about 53 MB of the node with activations (40 with ZeRO-1 and recompute), sharded (ep 2)
    about 28. With 35 MB only ep 2 fits; with plenty the search ranks both, and says what it does not model."""
    tight, roomy = tmp_path / "tight.yaml", tmp_path / "roomy.yaml"
    tight.write_text(MOE_TIGHT.replace("MEMORY", "0.035"))
    roomy.write_text(MOE_TIGHT.replace("MEMORY", "8"))
    out = run_hal("plan", "--search", "--json", "--top", "20", "--config", str(tight))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    eps = {s["ep"] for p in data["plans"] for s in p["plan"]["stages"]}
    assert eps == {2}, [p["plan"]["stages"] for p in data["plans"]]
    assert any(n.startswith("MoE model: ep is searched") for n in data["notes"]), data["notes"]
    out = run_hal("plan", "--search", "--json", "--top", "50", "--config", str(roomy))
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    by_ep = {p["plan"]["stages"][0]["ep"]: p for p in plans if p["plan"]["stages"][0]["dp"] == 2
             and not p["plan"]["zero1"] and not p["plan"]["stages"][0]["checkpoint"]}
    assert set(by_ep) == {1, 2}, [p["plan"] for p in plans]
    one, two = (by_ep[e]["prediction"] for e in (1, 2))
    assert two["stages"][0]["weights_bytes"] < one["stages"][0]["weights_bytes"]  # half the experts a rank
    assert two["stages"][0]["expert_exchange_s"] > 0 == one["stages"][0]["expert_exchange_s"]  # tokens cross ranks
    # the exchange is part of its forward (whether the half-sized expert compute makes up for it is the host's timing)
    assert two["stages"][0]["forward_s"] >= two["stages"][0]["expert_exchange_s"]
    dense = run_hal("plan", "--search", "--json", "--top", "1", "examples/tiny_cpu.yaml")
    assert dense.returncode == 0 and not any("MoE" in n for n in json.loads(dense.stdout)["notes"]), dense.stdout
