"""Triton kernels against the eager reference and torch.compile of the reference, forward and forward+backward.

For each kernel'd op (rms_norm, add_rms_norm, rotary_embedding, swiglu, linear_cross_entropy) on the
shapes of a Llama-style 1.2B model (default: hidden 2048, 2048 tokens = batch 1 x seq 2048, 16 heads of
128 with 4 kv heads, SwiGLU 5632, vocab 32000, bf16), times three variants with the backend's device
events (median of --iters after --warmup; inputs rotate over enough copies to spill the L2 cache):

  * eager   — the reference in hal.ops, as the registry runs it without kernels;
  * compile — torch.compile of that reference (inductor; --no-compile skips it);
  * triton  — hal.kernels.triton_ops' wrapper (the registry's cuda implementation).

Printed per op and pass: each variant's kernel time (the device time of its kernels, from the profiler:
what a step pays when its host runs ahead of the device), the speed-ups triton/eager and triton/compile
on it and on wall time (events around each call: at small shapes that is the host's launch cost), the
triton kernel's GB/s over the fewest bytes the op must move, its share of the catalog's HBM bandwidth
for the card and (%cpy) of a device copy moving the same bytes — what one kernel of that size can reach
at all (TFLOP/s instead for linear_cross_entropy, whose matmuls dominate), the peak memory each
variant allocates beyond its inputs, and the max relative difference of triton's results from eager.

    python benchmarks/kernels.py [--backend cuda] [--hidden 2048] [--tokens 2048] [--vocab 32000]
        [--heads 16] [--kv-heads 4] [--ffn 5632] [--dtype bf16] [--iters 50] [--warmup 10]
        [--no-compile] [--only rms_norm,swiglu] [--breakdown] [--json]

Needs a GPU backend (cuda; rocm untested) and triton. ``--backend cpu`` runs only under
TRITON_INTERPRET=1, with tiny shapes, as a smoke test of this script: the interpreter times numpy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
L2_SPILL_BYTES = 256 * 2**20  # rotate input sets until they total this (H100 L2: 50 MB; H200: 60 MB)


@dataclass
class Case:
    """One op on one shape: how to make inputs, the three callables, and its minimal traffic."""

    op: str
    make: Callable[[], list[torch.Tensor]]  # fresh inputs (float leaves first), on the device
    grads: int  # how many leading inputs are differentiated
    reference: Callable[..., Any]
    triton: Callable[..., Any]
    bytes_fwd: int  # fewest bytes a forward must read + write
    bytes_bwd: int  # ... a backward (on top of the forward)
    flops_fwd: float = 0.0  # matmul FLOPs (linear_cross_entropy), else 0
    flops_bwd: float = 0.0


def _cases(a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[Case]:
    from hal import ops
    from hal.kernels import triton_ops as t

    e = torch.tensor([], dtype=dtype).element_size()
    T, H, V, F, hd = a.tokens, a.hidden, a.vocab, a.ffn, a.hidden // a.heads
    S = a.tokens  # batch 1
    qkv_width = (a.heads + 2 * a.kv_heads) * hd

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)

    def norm_inputs() -> list[torch.Tensor]:
        return [randn(T, H), randn(H, scale=0.1) + 1]

    def add_norm_inputs() -> list[torch.Tensor]:
        return [randn(T, H), randn(T, H), randn(H, scale=0.1) + 1]

    angles = torch.outer(torch.arange(S, device=device, dtype=torch.float32),
                         1.0 / 10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def rope_inputs() -> list[torch.Tensor]:
        # q exactly as the model makes it: a (1, heads, S, hd) view of the QKV projection's output
        qkv = randn(1, S, qkv_width)
        q = qkv[..., : a.heads * hd].view(1, S, a.heads, hd).transpose(1, 2)
        return [q, cos, sin]

    target = torch.randint(0, V, (T,), device=device)
    target[::7] = -100

    def ce_inputs() -> list[torch.Tensor]:
        return [randn(T, H), randn(V, H, scale=H ** -0.5), target]

    rms, rope_bytes = T * H * e, a.heads * S * hd * e
    return [
        Case("rms_norm", norm_inputs, 2, lambda x, w: ops._rms_norm(x, w, 1e-5), lambda x, w: t.triton_rms_norm(x, w, 1e-5),
             2 * rms + H * e, 3 * rms + 2 * H * e),
        Case("add_rms_norm", add_norm_inputs, 3, lambda x, r, w: ops._add_rms_norm(x, r, w, 1e-5),
             lambda x, r, w: t.triton_add_rms_norm(x, r, w, 1e-5), 4 * rms + H * e, 4 * rms + 2 * H * e),
        Case("rotary_embedding", rope_inputs, 1, ops._rotary_embedding, t.triton_rotary_embedding,
             2 * rope_bytes + 2 * S * hd * e, 2 * rope_bytes + 2 * S * hd * e),
        Case("swiglu", lambda: [randn(T, 2 * F)], 1, ops._swiglu, t.triton_swiglu, 3 * T * F * e, 5 * T * F * e),
        Case("linear_cross_entropy", ce_inputs, 2, ops._linear_cross_entropy, t.triton_linear_cross_entropy,
             (T * H + V * H) * e, (T * H + V * H) * e, 2.0 * T * H * V, 4.0 * T * H * V),
    ]


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _runner(fn: Callable[..., Any], sets: list[list[torch.Tensor]], n_grad: int, backward: bool,
            cotangents: dict[int, tuple[torch.Tensor, ...]]) -> Callable[[int], Any]:
    """Call i: fn on input set i mod len(sets); with ``backward``, also the gradients of its float leaves
    for ``cotangents`` (drawn by the first call, shared by every variant so their gradients compare)."""

    def run(i: int) -> Any:
        inputs = sets[i % len(sets)]
        if not backward:
            with torch.no_grad():
                return fn(*inputs)
        outs = _outputs(fn(*inputs))
        if 0 not in cotangents:  # one cotangent for every call: the same shapes in every input set
            cotangents[0] = tuple(torch.randn_like(o) for o in outs)
        return torch.autograd.grad(outs, inputs[:n_grad], cotangents[0])

    return run


def _time_ms(backend: Any, run: Callable[[int], Any], iters: int, warmup: int) -> float:
    """Wall time of one call (device events around each), median: what a host-bound caller sees."""
    for i in range(warmup):
        run(i)
    backend.synchronize()
    pairs = []
    for i in range(iters):
        start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
        start.record()
        run(i)
        end.record()
        pairs.append((start, end))
    backend.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def _device_events(backend: Any, run: Callable[[int], Any], iters: int) -> list[Any]:
    """The device activities (kernels, copies, fills) of ``iters`` calls after two warm-up calls, through the
    backend's profiler hook. Only device events: an aten op's own "device time" is the same kernels again."""
    from torch.autograd import DeviceType

    for i in range(2):
        run(i)
    backend.synchronize()
    with backend.profiler() as prof:
        for i in range(iters):
            run(i)
        backend.synchronize()
    return [e for e in prof.events() if e.device_type != DeviceType.CPU]


def _kernel_ms(backend: Any, run: Callable[[int], Any], iters: int) -> float:
    """Device time of one call's kernels (launch gaps excluded): what a training step whose host runs ahead of
    the device pays. At small shapes the wall time is the host's, not this."""
    return sum(e.time_range.elapsed_us() for e in _device_events(backend, run, iters)) / iters / 1e3


def _breakdown(backend: Any, run: Callable[[int], Any], iters: int, top: int = 8) -> list[tuple[str, float, int]]:
    """The device kernels one call runs, heaviest first: (name, microseconds a call, launches a call)."""
    totals: dict[str, list[float]] = {}
    for e in _device_events(backend, run, iters):
        slot = totals.setdefault(e.name, [0.0, 0])
        slot[0] += e.time_range.elapsed_us()
        slot[1] += 1
    rows = sorted(((n, us / iters, round(c / iters)) for n, (us, c) in totals.items()), key=lambda r: -r[1])
    return rows[:top]


def _copy_gbps(backend: Any, device: torch.device, moved: int = 2 * 2**30, iters: int = 10) -> float:
    """Measured ceiling: a device-to-device copy moving ``moved`` bytes (half read, half written), timed as
    the kernels are. At 1 GiB it is the card's; at an op's own traffic it is what one kernel of that size
    can reach (a few MB do not fill the GPU long enough to reach the card's rate)."""
    src = torch.empty(max(1, moved // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _kernel_ms(backend, lambda i: dst.copy_(src), iters)
    return 2 * src.numel() / ms / 1e6


def _peak_mib(backend: Any, run: Callable[[int], Any]) -> float:
    """Memory one call allocates beyond what is already held (its outputs and gradients included)."""
    backend.synchronize()
    before = backend.memory_allocated()
    backend.reset_peak_memory_stats()
    result = run(0)
    backend.synchronize()
    peak = backend.max_memory_allocated() - before
    del result
    return peak / 2**20


def _max_rel_diff(a: Any, b: Any) -> float:
    worst = 0.0
    for x, y in zip(_outputs(a), _outputs(b)):
        x, y = x.float(), y.float()
        worst = max(worst, float((x - y).norm() / y.norm().clamp(min=1e-30)))
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=2048, help="batch x sequence (batch 1)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument("--only", default="", help="comma-separated ops (default: all)")
    p.add_argument("--breakdown", action="store_true", help="also print each variant's device kernels, heaviest first")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    from hal import get_backend
    from hal.ops import registry

    backend = get_backend(a.backend)
    if backend.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("the Triton kernels need a GPU backend (on the CPU they run only under TRITON_INTERPRET=1: a smoke test)")
    backend.require_available()
    device, dtype = backend.device(0), DTYPES[a.dtype]
    backend.set_device(0)
    caps = backend.capabilities(0)
    hbm = caps.memory_bandwidth_gbps
    card = backend.device_name(0)
    only = {s for s in a.only.split(",") if s}
    copy_gbps = _copy_gbps(backend, device) if device.type != "cpu" else None
    rows: list[dict[str, Any]] = []
    for case in _cases(a, device, dtype):
        if only and case.op not in only:
            continue
        chosen = registry.choose(case.op, backend.name, dtype)
        one = case.make()
        size = sum(t.numel() * t.element_size() for t in one)
        sets = [one] + [case.make() for _ in range(max(0, min(15, L2_SPILL_BYTES // max(size, 1))))]
        for backward in (False, True):
            for s in sets:
                for t in s[: case.grads]:
                    t.requires_grad_(backward)
            variants: dict[str, Callable[..., Any]] = {"eager": case.reference, "triton": case.triton}
            if not a.no_compile:
                torch._dynamo.reset()
                variants["compile"] = torch.compile(case.reference, dynamic=False)
            cotangents: dict[int, tuple[torch.Tensor, ...]] = {}
            runs = {name: _runner(fn, sets, case.grads, backward, cotangents) for name, fn in variants.items()}
            check = _max_rel_diff(runs["triton"](0), runs["eager"](0))
            wall = {name: _time_ms(backend, run, a.iters, a.warmup) for name, run in runs.items()}
            ms = wall if backend.device_type == "cpu" else {name: _kernel_ms(backend, run, a.iters) for name, run in runs.items()}
            mem = {name: _peak_mib(backend, run) for name, run in runs.items()}
            moved = case.bytes_fwd + (case.bytes_bwd if backward else 0)
            flops = case.flops_fwd + (case.flops_bwd if backward else 0)
            row = {"op": case.op, "pass": "fwd+bwd" if backward else "fwd", "kernel_ms": ms, "wall_ms": wall,
                   "peak_mib": mem, "vs_eager": ms["eager"] / ms["triton"],
                   "vs_compile": ms["compile"] / ms["triton"] if "compile" in ms else None,
                   "wall_vs_eager": wall["eager"] / wall["triton"],
                   "wall_vs_compile": wall["compile"] / wall["triton"] if "compile" in wall else None,
                   "triton_gbps": moved / ms["triton"] / 1e6, "max_rel_diff": check, "registry_picks": chosen.impl.name}
            if a.breakdown and backend.device_type != "cpu":
                row["breakdown"] = {name: _breakdown(backend, run, a.iters) for name, run in runs.items()}
            row["hbm_share"] = row["triton_gbps"] / hbm if hbm else None
            if device.type != "cpu" and not flops:
                row["copy_gbps_same_bytes"] = _copy_gbps(backend, device, moved, a.iters)
                row["copy_share"] = row["triton_gbps"] / row["copy_gbps_same_bytes"]
            row["triton_tflops"] = flops / ms["triton"] / 1e9 if flops else None
            rows.append(row)
    result = {"card": card, "backend": backend.name, "dtype": a.dtype, "torch": torch.__version__,
              "triton": __import__("triton").__version__, "hbm_gbps": hbm, "copy_gbps": copy_gbps,
              "shape": {k: getattr(a, k) for k in ("hidden", "tokens", "vocab", "heads", "kv_heads", "ffn")}, "rows": rows}
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{card}, {a.dtype}, torch {torch.__version__}, triton {result['triton']}; shape {result['shape']}; "
          f"median of {a.iters} after {a.warmup}; kernel ms = device time of the call's kernels (profiler), "
          f"x = speed-up of triton over eager / compile on it (wall: on host-bound wall time); HBM {hbm} GB/s "
          f"(catalog), a 1 GiB copy measured {copy_gbps or 0:.0f} GB/s")
    print(f"{'op':22}{'pass':9}{'eager':>8}{'compile':>8}{'triton':>8}{'x eager':>8}{'x comp':>7}"
          f"{'GB/s':>7}{'%HBM':>5}{'%cpy':>5}{'TFLOP/s':>8}{'wall x e/c':>12}  {'peak MiB e/c/t':17}{'rel diff':>9}  picks")
    for r in rows:
        ms, mem = r["kernel_ms"], r["peak_mib"]
        comp = f"{ms['compile']:8.3f}" if "compile" in ms else f"{'-':>8}"
        vs_c = f"{r['vs_compile']:7.2f}" if r["vs_compile"] else f"{'-':>7}"
        share = f"{100 * r['hbm_share']:5.0f}" if r["hbm_share"] and not r["triton_tflops"] else f"{'-':>5}"
        tf = f"{r['triton_tflops']:8.0f}" if r["triton_tflops"] else f"{'-':>8}"
        copy = f"{100 * r['copy_share']:5.0f}" if r.get("copy_share") else f"{'-':>5}"
        wall = f"{r['wall_vs_eager']:.2f}/" + (f"{r['wall_vs_compile']:.2f}" if r["wall_vs_compile"] else "-")
        peaks = "/".join(f"{mem[k]:.0f}" if k in mem else "-" for k in ("eager", "compile", "triton"))
        print(f"{r['op']:22}{r['pass']:9}{ms['eager']:8.3f}{comp}{ms['triton']:8.3f}{r['vs_eager']:8.2f}{vs_c}"
              f"{r['triton_gbps']:7.0f}{share}{copy}{tf}{wall:>12}  {peaks:17}{r['max_rel_diff']:9.1e}  {r['registry_picks']}")
    for r in rows:
        for variant, kernels in r.get("breakdown", {}).items():
            print(f"  {r['op']} {r['pass']} {variant}: " + "; ".join(f"{n[:60]} {us:.1f}us x{c}" for n, us, c in kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
