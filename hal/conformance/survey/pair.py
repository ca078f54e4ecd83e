"""One op of ``op_db`` in one dtype on the device: its samples forward and, where autograd applies, backward.

The outcome of a pair is one of ``pass`` (every sample within the tolerance), ``failed`` (a wrong answer: the sample,
the worst element, the error), ``raised`` (the device raised where the CPU did not: the first line), ``fallback``
(it ran, but the backend reports work on the host), ``untested`` (why: PyTorch's own test skips the comparison,
random output, or the CPU itself cannot run the sample).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager
from unittest import mock

import torch

from . import samples as S
from .judge import Miss, judge_outputs

Watch = Callable[[int], ContextManager[Any]]  # given the inputs' bytes; its value says whether work went to the host


@dataclass
class Finding:
    """The survey's outcome for one (op, dtype)."""

    op: str
    family: str
    dtype: str
    status: str  # pass | failed | raised | fallback | untested
    samples: int = 0
    backward: bool = False
    decided_by: str = ""  # golden (float64) | cpu (the CPU kernel in the same dtype) | "" where nothing was compared
    golden_ratio: float = 0.0  # the largest error / golden bound over every output and sample
    detail: str = ""
    sample: str = ""  # the failing sample, described

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in ("", None)}


@dataclass(frozen=True)
class Settings:
    """What pins a survey's cohort besides the op list: samples per pair, the seed, backward on or off."""

    max_samples: int = 3
    seed: int = 1234
    backward: bool = True


@dataclass
class _Runs:
    got: list[tuple[str, Any]] = field(default_factory=list)
    golden: list[tuple[str, Any]] | None = None
    same: list[tuple[str, Any]] = field(default_factory=list)


def describe(sample: Any) -> str:
    """A sample in one line: the shapes and dtypes of its tensors and its plain arguments."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(one(x) for x in v) + "]"
        return repr(v)
    parts = [one(sample.input)] + [one(a) for a in sample.args] + [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 200 else text[:197] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _call(op: Any, sample: Any, backward: bool, seed: int, move: Callable[[torch.Tensor], torch.Tensor],
          rng_seed: int | None = None) -> list[tuple[str, Any]]:
    """The op on the sample, flattened; with the gradients of every input that requires one where ``backward``.
    The random generators start from ``rng_seed`` (default ``seed``); the output gradients from ``seed``."""
    torch.manual_seed(seed if rng_seed is None else rng_seed)
    out = op(sample.input, *sample.args, **sample.kwargs)
    flat = S.flatten(out)
    if backward:
        processed = S.flatten(sample.output_process_fn_grad(out)) if sample.output_process_fn_grad else flat
        outs = S.differentiable(processed)
        leaves = S.grad_leaves(sample)
        flat = flat + S.gradients(outs, leaves, S.cotangents(outs, seed), move)
    return flat


def survey_pair(op: Any, dtype: torch.dtype, device: torch.device, settings: Settings, family: str,
                watch: Watch, golden_dtypes: set[torch.dtype]) -> Finding:
    """Survey ``op`` in ``dtype`` on ``device``; the CPU computes the references from the same samples."""
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    dname = str(dtype).replace("torch.", "")
    finding = Finding(name, family, dname, "pass")
    backward = (settings.backward and op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
                and (dtype.is_floating_point or dtype.is_complex))
    finding.backward = backward
    skipped = pytorch_skips(op, device.type, dtype)
    if skipped:
        return _untested(finding, skipped)
    widen = dtype in S.WIDE and S.WIDE[dtype] in golden_dtypes
    torch.manual_seed(settings.seed)
    try:  # drawn on the device, as PyTorch's test_compare_cpu does: arguments an op wants on the host stay there
        drawn = []
        for sample in op.sample_inputs(device, dtype, requires_grad=backward):
            drawn.append(sample)
            if len(drawn) >= settings.max_samples:
                break
    except Exception as exc:  # noqa: BLE001 - making tensors on the device is part of what is surveyed
        finding.status, finding.detail = "raised", f"making OpInfo's sample inputs on the device raised: {_first_line(exc)}"
        return finding
    if not drawn:
        return _untested(finding, "OpInfo has no sample inputs for this dtype")
    worst = 0.0
    decided: set[str] = set()
    judged = 0
    for k, sample in enumerate(drawn):
        seed = settings.seed + k
        runs = _Runs()
        try:
            on_device, sample = sample, S.to_device(sample, torch.device("cpu"))  # the references' copy
            runs.same = S.to_host(_call(op, S.copied(sample), backward, seed, lambda c: c))
            if _random_output(op, sample, backward, seed, runs.same):
                continue  # the device's generator is not the host's: nothing to compare
            if widen:
                runs.golden = S.to_host(_call(op, S.widened(sample), backward, seed, lambda c: c.to(S.WIDE[c.dtype])))
        except Exception as exc:  # noqa: BLE001 - the CPU cannot run it: nothing to judge the device by
            return _untested(finding, f"the CPU reference raised on sample {k} ({describe(sample)}): {_first_line(exc)}")
        try:
            with watch(S.tensor_bytes(on_device)) as host:
                got = _call(op, on_device, backward, seed, lambda c: c.to(device))
            got_host = S.to_host(got)
        except Exception as exc:  # noqa: BLE001 - the device raised: the first line is the finding
            finding.status, finding.detail, finding.sample = "raised", _first_line(exc), f"sample {k}: {describe(sample)}"
            finding.samples = judged
            return finding
        if host.fell_back and not _returns_to_host(got, device):
            finding.status, finding.detail, finding.sample = "fallback", host.why(), f"sample {k}: {describe(sample)}"
            finding.samples = judged + 1
            return finding
        miss, by, ratio = judge_outputs(got_host, runs.golden, runs.same)
        worst = max(worst, ratio)
        decided.add(by)
        judged += 1
        if miss is not None:
            return _failed(finding, miss, sample, k, worst, judged)
    if not judged:
        return _untested(finding, "random output: every sample gives other values under another seed (the device's "
                                  "generator is not the host's)")
    finding.samples = judged
    finding.golden_ratio = worst
    finding.decided_by = "cpu" if "cpu" in decided else "golden"
    return finding


def _untested(finding: Finding, why: str) -> Finding:
    finding.status, finding.detail = "untested", why
    return finding


def _failed(finding: Finding, miss: Miss, sample: Any, k: int, worst: float, judged: int) -> Finding:
    finding.status, finding.detail, finding.sample = "failed", miss.text(), f"sample {k}: {describe(sample)}"
    finding.samples, finding.golden_ratio = judged, worst
    return finding


def _random_output(op: Any, sample: Any, backward: bool, seed: int, first: list[tuple[str, Any]]) -> bool:
    """Whether the op draws random numbers: its CPU result with every seed moved (OpInfo's own ``wrapper_set_seed``
    included, through ``torch.manual_seed``) differs from ``first``."""
    real = torch.manual_seed
    with mock.patch.object(torch, "manual_seed", lambda s: real(s + 7919)):
        again = S.to_host(_call(op, S.copied(sample), backward, seed, lambda c: c))
    for (_, a), (_, b) in zip(first, again):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or not torch.equal(torch.nan_to_num(a.float() if not a.is_complex() else torch.view_as_real(a)),
                                                     torch.nan_to_num(b.float() if not b.is_complex() else torch.view_as_real(b))):
                return True
        elif a != b and a == a:
            return True
    return False


def pytorch_skips(op: Any, device_type: str, dtype: torch.dtype) -> str | None:
    """PyTorch's own word on comparing this op's device result with the CPU's (``TestCommon.test_compare_cpu``): a
    skip (with its reason) or an expected failure, where active for this device type and dtype."""
    import inspect

    for info in (*op.decorators, *getattr(op, "skips", ())):
        if not hasattr(info, "is_active") or not info.is_active("TestCommon", "test_compare_cpu", device_type, dtype, {}):
            continue
        if info.cls_name is None or info.test_name is None:
            continue  # a decorator for every test of a class: not about the CPU comparison
        for decorator in info.decorators:
            name = getattr(decorator, "__qualname__", "")
            if name == "expectedFailure":
                return "PyTorch expects its result to differ from the CPU's (test_compare_cpu: expected failure)"
            if name.startswith("skip"):
                try:
                    reason = inspect.getclosurevars(decorator).nonlocals.get("reason")
                except TypeError:
                    reason = None
                return f"PyTorch's test_compare_cpu skips it: {reason or 'no reason given'}"
    return None


def _returns_to_host(got: list[tuple[str, Any]], device: torch.device) -> bool:
    """An op whose result is on the host by design (``to("cpu")``): its copy off the device is no fallback."""
    return device.type != "cpu" and any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for _, v in got)
