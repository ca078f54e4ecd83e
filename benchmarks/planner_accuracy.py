"""The planner's accuracy: predicted against measured steady-state step time (and memory) for 9 plans of 4 ranks
(13 for an MoE model: 4 with expert parallelism).

One profile of this host (``hal profile``'s measurement: one layer at a few row counts, recompute off
and on, embedding, head, AdamW; on the cpu also the links and the node's calibration pipelines), one
cluster (4 ranks of ``--backend``: cpu ranks sharing this host's cores, or 4 GPUs), then for each plan:
the cost model's prediction and a short ``hal train --json`` run (the median step after the first), and
the error. On GPUs each stage's predicted memory is compared with its allocator peak; on the cpu it is
not (the ranks' RSS is mostly torch itself on a model this small). Last, the choice: how the plan the
model ranks first measures against the fastest measured one. ``--recheck``: the first plan is trained
again at the end, and how far its two measurements are apart is reported — the noise floor of the
"measured" side, against which the errors are read. Around the profile and every run a tiny torch op is
timed on the host (``host_op_us``): the "host op" column says how much slower or faster the host ran a plan
than when it was profiled — the drift a host-bound prediction cannot follow.

    python benchmarks/planner_accuracy.py [--backend cpu|cuda] [--model NAME] [--steps 10] [--json] [--only 1,3] [--recheck]
                                          [--cpu-binding none|cores] [--compile inductor|aot_eager] [--phases]
                                          [--save-profile P | --profile P]

Bad input (a flag's value, a --profile that cannot be used, a --save-profile path that cannot be written) is
refused in one line on stderr with exit status 2, before anything is profiled or trained.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {
    # cpu: small enough for 4 ranks on 2 cores
    "cpu-small": {"vocab_size": 256, "hidden_size": 256, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                  "ffn_hidden_size": 704, "max_seq_len": 64},
    # the same with every layer's MLP an MoE block of 4 experts, top-2: the plans add expert parallelism
    "cpu-moe": {"vocab_size": 256, "hidden_size": 256, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                "ffn_hidden_size": 704, "max_seq_len": 64, "moe_num_experts": 4, "moe_top_k": 2,
                "moe_ffn_hidden_size": 704},
    # TinyLlama's layer shape, 8 layers, seq 1024: on the 4 x H200 hosts lent here every plan is host-bound
    # (a layer's forward enqueues in 1.1-2.5 ms, the device runs it in 0.5 ms), so the host's own speed sets it
    "tinyllama": {"vocab_size": 32000, "hidden_size": 2048, "num_layers": 8, "num_heads": 16, "num_kv_heads": 4,
                  "ffn_hidden_size": 5632, "max_seq_len": 1024},
    # Llama 3 8B's layer shape (8 of its 32 layers, a 32k vocabulary), seq 2048: the device runs a layer's
    # forward at 2 rows longer than its host takes to enqueue it (an H200: 3.2 against about 2 ms), as in training
    "llama3-8b-layers": {"vocab_size": 32000, "hidden_size": 4096, "num_layers": 8, "num_heads": 32, "num_kv_heads": 8,
                         "ffn_hidden_size": 14336, "max_seq_len": 2048},
    # shapes the planner was never tuned on (issue 35): the plans below scale their layer counts by num_layers / 8
    # wide and shallow: 3.1B in 8 layers of hidden 6144 (big matmuls, few of them)
    "wide-shallow": {"vocab_size": 32000, "hidden_size": 6144, "num_layers": 8, "num_heads": 48, "num_kv_heads": 8,
                     "ffn_hidden_size": 16384, "max_seq_len": 2048},
    # narrow and deep: 32 layers of hidden 1024 (many small layers: host time per layer matters)
    "narrow-deep": {"vocab_size": 32000, "hidden_size": 1024, "num_layers": 32, "num_heads": 16, "num_kv_heads": 4,
                    "ffn_hidden_size": 2816, "max_seq_len": 2048},
    # Llama-3.2-1B's shape: embeddings tied across the first and last stage, a 128k vocabulary (the head is the
    # biggest single op), GQA 32/8
    "tied-128k-vocab": {"vocab_size": 128256, "hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                        "ffn_hidden_size": 8192, "max_seq_len": 2048, "tie_embeddings": True},
}
DEFAULT_MODEL = {"cpu": "cpu-small", "cuda": "llama3-8b-layers"}
PRECISION = {"cpu": "fp32", "cuda": "bf16-mixed"}


def plans(backend: str, model: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The measured plans: 4 ranks in every tp/dp/stage split, schedule, micro-batching and recompute tried; for an
    MoE model (``model``), expert parallelism too. Written for 8 layers; a model of 8·k layers gets k times each
    stage's layers (the same splits)."""
    scale = MODELS[model]["num_layers"] // 8 if model else 1
    return [(name, _scaled(raw, scale)) for name, raw in _plans_of_8_layers(backend, model)]


def _scaled(raw: dict[str, Any], scale: int) -> dict[str, Any]:
    return {**raw, "stages": [{**s, "layers": s["layers"] * scale} for s in raw["stages"]]}


def _plans_of_8_layers(backend: str, model: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    one = {"backend": backend, "devices": 1}
    two = {"backend": backend, "devices": 2}
    four = {"backend": backend, "devices": 4, "dp": 4, "layers": 8}
    moe = [
        ("dp2 ep2 | dp2 ep2 1f1b M8", {"schedule": "1f1b", "micro_batches": 8, "micro_batch_size": 2,
                                       "stages": [{**two, "dp": 2, "ep": 2, "layers": 4}] * 2}),
        ("dp4 one stage M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4, "stages": [four]}),
        ("dp4 ep2 one stage M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                                  "stages": [{**four, "ep": 2}]}),
        ("dp4 ep4 one stage M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                                  "stages": [{**four, "ep": 4}]}),
    ] if model and MODELS[model].get("moe_num_experts") else []
    return [
        ("4 stages 1f1b M8", {"schedule": "1f1b", "micro_batches": 8, "micro_batch_size": 2, "stages": [{**one, "layers": 2}] * 4}),
        ("4 stages zero-bubble M8", {"schedule": "zero-bubble", "micro_batches": 8, "micro_batch_size": 2,
                                     "stages": [{**one, "layers": 2}] * 4}),
        ("4 stages interleaved V2 M8", {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 8,
                                        "micro_batch_size": 2, "stages": [{**one, "layers": 2}] * 4}),
        ("4 stages 1f1b M4 recompute", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                                        "stages": [{**one, "layers": 2, "checkpoint": True}] * 4}),
        ("tp2 | tp2 1f1b M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4, "stages": [{**two, "tp": 2, "layers": 4}] * 2}),
        ("dp2 | dp2 1f1b M8", {"schedule": "1f1b", "micro_batches": 8, "micro_batch_size": 2, "stages": [{**two, "dp": 2, "layers": 4}] * 2}),
        ("tp2+sp rc | dp2 5/3 M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                                    "stages": [{**two, "tp": 2, "sp": True, "layers": 5, "checkpoint": True},
                                               {**two, "dp": 2, "layers": 3}]}),
        ("dp2 zero1 | dp2 6/2 M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4, "zero1": True,
                                    "stages": [{**two, "dp": 2, "layers": 6}, {**two, "dp": 2, "layers": 2}]}),
        ("tp2 dp2 one stage M2", {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 8,
                                  "stages": [{"backend": backend, "devices": 4, "tp": 2, "dp": 2, "layers": 8}]}),
    ] + moe


PLANS = plans("cpu")


def cluster_group(backend: str) -> dict[str, Any]:
    """4 ranks of ``backend`` on this host, as a cluster group (cuda: the catalog model of device 0)."""
    if backend == "cpu":
        return {"backend": "cpu", "device": "cpu-generic", "count": 4, "cores": os.cpu_count() or 1}
    from hal.backend_registry import get_backend
    from hal.errors import ConfigError

    device = get_backend(backend).capabilities(0).catalog_id
    if device is None:
        raise ConfigError(f"device 0 of {backend} is not in the catalog; it cannot be planned for (add it to the catalog)")
    return {"backend": backend, "device": device, "count": 4}


def config_text(parallel: dict[str, Any], steps: int, backend: str = "cpu", checkpoint_dir: str | None = None,
                model: str | None = None) -> str:
    import yaml

    train: dict[str, Any] = {"steps": steps, "lr": 1e-3, "data": "synthetic"}
    if checkpoint_dir:
        train["checkpoint_dir"] = checkpoint_dir
    return yaml.safe_dump({"backend": backend, "precision": PRECISION[backend], "fallback": "warn",
                           "model": MODELS[model or DEFAULT_MODEL[backend]],
                           "parallel": parallel, "train": train, "cluster": {"groups": [cluster_group(backend)]}}, sort_keys=False)


def given_profile(path: str, run: Any, compile_backend: str | None) -> Any:
    """The profile at ``path``, refused in one ConfigError line where it cannot be read, was made for another model
    or precision, has layers compiled differently from what this run's plans do, or a ``meta.host_op_us`` that is not
    two positive times — checked here, before any plan runs, not when the first row divides by it."""
    from hal.errors import ConfigError
    from hal.parallel.planner.profile_store import load_profile

    profile = load_profile(path, run.model, run.hal.precision)
    if not isinstance(profile.meta, dict):
        raise ConfigError(f"--profile {path}: its meta is not a mapping; measure the profile again (--save-profile)")
    if profile.meta.get("compiled_layers") != compile_backend:
        def how(backend: str | None) -> str:
            return f"compiled with {backend}" if backend else "eager"

        raise ConfigError(f"--profile {path} timed its layers {how(profile.meta.get('compiled_layers'))}, "
                          f"these plans run them {how(compile_backend)}; measure a profile with the same --compile")
    host = profile.meta.get("host_op_us")
    if host is not None and not (isinstance(host, list) and len(host) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in host)):
        raise ConfigError(f"--profile {path}: meta.host_op_us is {json.dumps(host)[:80]}, not two positive microsecond "
                          "times (before and after the profile); remove the key, or measure the profile again (--save-profile)")
    return profile


PHASES = ("compute_s", "p2p_s", "bubble_s", "grad_sync_s", "optimizer_s")


def host_op_us(bursts: int = 5, ops: int = 400) -> float:
    """Microseconds a tiny torch op takes on this host thread (median of ``bursts``): the dispatcher path a
    host-bound rank pays for every kernel it enqueues.

    Why: taken around the profile and around every run, it shows whether the host's own speed moved between
    the profile the prediction comes from and the run it is compared with — on a shared VM it does (one layer's
    enqueue time measured 2.26 ms in one profile and 1.15 ms in the next, on one 4 x H200 machine)."""
    import time

    import torch

    x = torch.zeros(8)
    samples = []
    for i in range(bursts + 1):  # the first burst warms the dispatcher up
        start = time.perf_counter()
        for _ in range(ops):
            x = x.add(1.0)
        if i:
            samples.append((time.perf_counter() - start) / ops * 1e6)
    return statistics.median(samples)


def measured(path: Path, run_dir: Path, steps: int, cpu_binding: str = "none",
             phases: bool = False) -> tuple[float, list[int | None], list[float], dict[str, Any]]:
    """Median seconds a step of ``hal train`` after the first (warm-up) step, each stage's peak memory, the steps' times,
    and the median of each phase the log holds (per stage; None where hal train did not measure it: an accelerator
    times its phases only with ``--profile``, which ``phases`` passes).

    The median: on a shared 2-core host single steps swing by ±20 % (other processes, the scheduler);
    a mean over a few steps moves the "measured" side of the comparison by ±10 % from run to run."""
    out = subprocess.run([sys.executable, "-m", "hal", "train", str(path), "--steps", str(steps), "--json",
                          "--run-dir", str(run_dir), "--cpu-binding", cpu_binding, *(["--profile"] if phases else [])],
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"hal train {path} failed:\n{out.stderr[-2000:]}")
    summary = json.loads(out.stdout)
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    steady = [r for r in records if "step_s" in r][1:]

    def median(values: list[Any]) -> float | None:
        return statistics.median(values) if values and None not in values else None

    split = {"schedule_s": median([r.get("schedule_s") for r in steady]),
             "stages": [{k: median([r["stages"][s].get(k) for r in steady]) for k in PHASES}
                        for s in range(len(summary["stages"]))]}
    return (statistics.median([r["step_s"] for r in steady]), [st.get("peak_memory_bytes") for st in summary["stages"]],
            [r["step_s"] for r in steady], split)


def predicted_phases(pred: Any, micro_batches: int) -> dict[str, Any]:
    """The prediction split as the log splits a step: the schedule, and per stage its compute, dp sync and AdamW."""
    return {"schedule_s": pred.schedule_s,
            "stages": [{"compute_s": micro_batches * (st.forward_s + st.backward_s), "grad_sync_s": st.grad_sync_s,
                        "optimizer_s": st.optimizer_s} for st in pred.stages]}


def steps_count(text: str) -> int:
    """--steps: a whole number of 2 or more (the first step is warm-up; the median is over the others)."""
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give e.g. --steps 10") from None
    if steps < 2:
        raise argparse.ArgumentTypeError(f"{steps}: give 2 or more (the first step is warm-up, the rest are measured)")
    return steps


def plan_numbers(text: str) -> list[int]:
    """--only: comma-separated whole numbers (their range is checked once the plans are known)."""
    numbers = []
    for item in text.split(","):
        try:
            numbers.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a plan number; give comma-separated numbers "
                                             "from 1, e.g. --only 1,3") from None
    return numbers


def main(argv: list[str] | None = None) -> int:
    """Every user error (a HalError: bad flags, an unusable --profile or --save-profile) as one line, exit 2."""
    from hal.errors import HalError

    try:
        return benchmark(argv)
    except HalError as exc:
        print(f"planner_accuracy: error: {exc}", file=sys.stderr)
        return 2


def benchmark(argv: list[str] | None = None) -> int:
    from hal.cli.common import Parser  # argparse errors as one HalError line, not usage + error
    from hal.errors import ConfigError

    parser = Parser(prog="planner_accuracy.py", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=sorted(PRECISION), help="the 4 ranks' backend (cuda: 4 GPUs)")
    parser.add_argument("--model", choices=sorted(MODELS),
                        help="the decoder's shape (default: cpu-small on the cpu, llama3-8b-layers on cuda)")
    parser.add_argument("--steps", type=steps_count, default=10,
                        help="hal train steps per plan, 2 or more (the first is warm-up; the median of the rest is measured)")
    parser.add_argument("--only", type=plan_numbers, help="comma-separated plan numbers (1-based)")
    parser.add_argument("--recheck", action="store_true", help="train the first plan again at the end: the noise floor")
    parser.add_argument("--cpu-binding", choices=("none", "cores"), default="none",
                        help="hal train's --cpu-binding for every measured run (cores: each rank on cores of its own)")
    parser.add_argument("--compile", metavar="BACKEND", choices=("inductor", "aot_eager"),
                        help="every plan compiles its layers with BACKEND and the profile times them compiled (the "
                             "zero-bubble plan too: its linears run eagerly between the layers' graphs)")
    parser.add_argument("--phases", action="store_true",
                        help="hal train --profile: each phase measured on accelerators too (device events, one wait a step)")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--profile", metavar="PATH",
                        help="use this profile (from --save-profile or hal profile) instead of measuring one: plans "
                             "measured in several invocations are then predicted from one profile")
    given.add_argument("--save-profile", metavar="PATH", help="write the profile measured here to PATH")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = args.model or DEFAULT_MODEL[args.backend]
    if args.save_profile:  # before the profile is measured, not after (a directory, an unwritable place)
        from hal.run_dirs import check_creatable_file

        check_creatable_file(Path(args.save_profile), "--save-profile")

    from hal.launch import run_function
    from hal.parallel.config.run import load_run_config
    from hal.parallel.planner.cost import Placement
    from hal.parallel.planner.make_profile import make_profile
    from hal.parallel.planner.run_search import planning_cluster, planning_inputs

    todo = plans(args.backend, model)
    if args.compile:
        todo = [(name, {**parallel, "compile": True, "compile_backend": args.compile}) for name, parallel in todo]
    outside = [n for n in args.only or () if not 1 <= n <= len(todo)]
    if outside:  # 0 would be Python's index -1, the last plan
        raise ConfigError(f"--only {', '.join(map(str, outside))}: the plans{' with --compile' if args.compile else ''} "
                          f"are numbered 1 to {len(todo)}; give numbers in that range, e.g. --only 1,3")
    chosen = [n - 1 for n in args.only] if args.only else range(len(todo))
    rows = []
    gpu = args.backend != "cpu"
    with tempfile.TemporaryDirectory(prefix="planner-accuracy-") as tmp:
        first = Path(tmp, "base.yaml")
        first.write_text(config_text(todo[0][1], args.steps, args.backend, model=model))
        run = load_run_config(first)
        # the cluster alone: planning_inputs would first measure a quick profile, thrown away here (the profile used
        # is given or measured below)
        cluster = planning_cluster(run, None)
        if args.profile:
            profile = given_profile(args.profile, run, args.compile)
            host_at_profile = profile.meta.get("host_op_us")
        else:
            print(f"profiling this host's {args.backend} (hal profile's measurement) ...", file=sys.stderr, flush=True)
            host_at_profile = [host_op_us()]
            profile = make_profile(cluster, run.model, PRECISION[args.backend], run.model.max_seq_len, progress=lambda m: None,
                                   launch=run_function, compile_backend=args.compile)
            host_at_profile.append(host_op_us())
            profile.meta["host_op_us"] = host_at_profile  # read back by a later --profile run's "host op" column
            if args.save_profile:
                try:  # checked up front; a place that looked writable and is not (root on /proc) still gets one line
                    profile.save(args.save_profile)
                except OSError as exc:
                    raise ConfigError(f"--save-profile {args.save_profile}: cannot write it ({exc.strerror or exc}); "
                                      "give a writable file path") from None
        profile_path = Path(tmp, "profile.json")
        profile.save(profile_path)
        for i in chosen:
            name, parallel = todo[i]
            path = Path(tmp, f"plan{i + 1}.yaml")
            # the final checkpoint of a GPU-sized model (GBs) goes to memory where there is some: it is not timed
            shm = Path("/dev/shm")
            ckpt = str(Path(tempfile.mkdtemp(prefix="planner-accuracy-", dir=shm))) if gpu and shm.is_dir() else None
            path.write_text(config_text(parallel, args.steps, args.backend, ckpt, model))
            run = load_run_config(path)
            _, _, cost = planning_inputs(run, None, str(profile_path))
            kind = cluster.types[0]
            pred = cost.predict(run.plan, Placement.pack(run.plan, (kind,) * run.plan.num_stages), measured_order=True)
            host_around = [host_op_us()]
            try:
                step_s, memory, times, split = measured(path, Path(tmp, f"run{i + 1}"), args.steps, args.cpu_binding,
                                                        args.phases)
            finally:
                if ckpt:
                    shutil.rmtree(ckpt, ignore_errors=True)
            host_around.append(host_op_us())
            err = (pred.step_s - step_s) / step_s
            mem_err = [((st.memory_bytes - m) / m if m else None) for st, m in zip(pred.stages, memory)]
            rows.append({"plan": name, "predicted_s": pred.step_s, "measured_s": step_s, "error": err, "bound": pred.bound,
                         "predicted_memory": [st.memory_bytes for st in pred.stages], "measured_memory": memory,
                         "memory_error": mem_err, "step_times": times, "config": str(path), "checkpoint_dir": ckpt,
                         "measured_phases": split, "predicted_phases": predicted_phases(pred, run.plan.micro_batches),
                         "host_op_us": host_around,
                         "host_vs_profile": (statistics.mean(host_around) / statistics.mean(host_at_profile)
                                             if host_at_profile else None)})
            drift = rows[-1]["host_vs_profile"]
            print(f"{i + 1}. {name:<28} predicted {pred.step_s:7.3f} s  measured {step_s:7.3f} s  error {err:+6.1%}  "
                  + (f"host {drift:.2f}x its speed at the profile" if drift else "host speed at the profile unknown"),
                  file=sys.stderr, flush=True)
        recheck = None
        if args.recheck and rows:
            first = rows[0]
            try:
                again, _, times, _ = measured(Path(first["config"]), Path(tmp, "recheck"), args.steps, args.cpu_binding,
                                              args.phases)
            finally:
                if first["checkpoint_dir"]:
                    shutil.rmtree(first["checkpoint_dir"], ignore_errors=True)
            recheck = {"plan": first["plan"], "first_s": first["measured_s"], "again_s": again, "step_times": times,
                       "spread": abs(again - first["measured_s"]) / first["measured_s"]}
            print(f"recheck: {first['plan']} measured again {again:7.3f} s ({recheck['spread']:.1%} from the first)",
                  file=sys.stderr, flush=True)
    errors = [abs(r["error"]) for r in rows]
    pick = min(rows, key=lambda r: r["predicted_s"])
    fastest = min(rows, key=lambda r: r["measured_s"])
    measured_types = sorted(d for d, p in profile.devices.items() if not p.estimated)
    result = {"backend": args.backend, "model": model, "card": ", ".join(measured_types) or args.backend, "host": profile.meta.get("host"),
              "devices": [t.device for t in cluster.types],
              "rows": rows, "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
              "top_pick": pick["plan"], "fastest": fastest["plan"], "top_pick_over_fastest": pick["measured_s"] / fastest["measured_s"],
              "cores": os.cpu_count(), "profile": profile.to_dict(), "recheck": recheck,
              "cpu_binding": args.cpu_binding, "compiled": args.compile, "host_op_us_at_profile": host_at_profile,
              "profile_file": args.profile}
    if gpu:
        mem = [abs(e) for r in rows for e in r["memory_error"] if e is not None]
        result["memory_median_abs_error"] = statistics.median(mem) if mem else None
        result["memory_worst_abs_error"] = max(mem) if mem else None
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    gpu = result["backend"] != "cpu"
    lines = [f"{'plan':<30} {'predicted s':>11} {'measured s':>10} {'error':>7} {'host op':>7}"
             + ("  memory GiB pred/meas per stage" if gpu else "  bound")]
    for r in result["rows"]:
        tail = ("  " + " ".join(f"{p / 2**30:.1f}/{(m or 0) / 2**30:.1f}" for p, m in zip(r["predicted_memory"], r["measured_memory"]))
                if gpu else f"  {r['bound']}")
        drift = f"{r['host_vs_profile']:>6.2f}x" if r.get("host_vs_profile") else f"{'n/a':>7}"
        lines.append(f"{r['plan']:<30} {r['predicted_s']:>11.3f} {r['measured_s']:>10.3f} {r['error']:>+7.1%} {drift}{tail}")
    where = (f"{result.get('model', 'model')}, 4 {result['backend']} ranks ({', '.join(result['devices'])})"
             + ("" if gpu else f" on {result['cores']} cores"))
    where += ", each pinned to cores of its own" if result.get("cpu_binding") == "cores" else ""
    where += f", layers compiled ({result['compiled']})" if result.get("compiled") else ""
    lines.append(f"step time: median |error| {result['median_abs_error']:.1%}, worst {result['worst_abs_error']:.1%} "
                 f"({len(result['rows'])} plans, {where})")
    if gpu and result.get("memory_median_abs_error") is not None:
        lines.append(f"peak memory: median |error| {result['memory_median_abs_error']:.1%}, worst {result['memory_worst_abs_error']:.1%}")
    if result.get("recheck"):
        rc = result["recheck"]
        lines.append(f"noise floor: {rc['plan']} measured twice, {rc['first_s']:.3f} s and {rc['again_s']:.3f} s "
                     f"({rc['spread']:.1%} apart)")
    at = result["host_op_us_at_profile"]
    if at:
        lines.append(f"host op: a tiny torch op took {at[0]:.1f}/{at[1]:.1f} us before/after the profile; the column is "
                     "each run's time around it over that (above 1: the host was slower than when profiled)")
    if result.get("profile_file"):
        lines.append(f"profile: {result['profile_file']} (given, not measured in this run)")
    lines.append(f"choice: the planner's top pick ({result['top_pick']}) measures {result['top_pick_over_fastest']:.3f}× "
                 f"the fastest measured ({result['fastest']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
