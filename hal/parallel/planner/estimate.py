"""Estimate a device type that is not present: its catalog peak and memory bandwidth, scaled by a measured efficiency.

Why: a cluster is planned before it is owned (8 Ascend 910B next to 8 H100 on a laptop). The
estimate is a roofline with an efficiency: a layer's FLOPs over peak × efficiency, plus its weight
traffic over memory bandwidth. The efficiency is the one measured on a present device whose catalog
entry has a peak (achieved / peak); where none has one — a CPU host: cpu-generic publishes no peak —
it is ``DEFAULT_EFFICIENCY`` and the basis says so. Activation bytes depend on the model and the
precision, not the device, so they are copied from a measured device where there is one. Everything
made here is labelled ``estimated``.
"""
from __future__ import annotations

from hal.errors import ConfigError
from hal.parallel.config.flops import PEAK_KEY
from hal.parallel.config.memory import layer_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.cluster import DeviceType
from hal.parallel.planner.device_profile import ESTIMATED, DeviceProfile, LayerPoint, PerToken, Profile

DEFAULT_EFFICIENCY = 0.4  # dense-peak share of a tuned decoder layer on an accelerator (published large runs: 35-55 % MFU)
BANDWIDTH_EFFICIENCY = 0.7  # share of the datasheet memory bandwidth a streaming kernel reaches
LAUNCH_S = 1e-4  # per layer and pass: about 20 kernel launches of ~5 µs
OPTIMIZER_BYTES = 32  # AdamW per parameter: read param, grad, two moments (16 B); write param, moments (12 B) + slack
ROWS = (1, 2, 4)


def _element_bytes(precision: str) -> int:
    return 2 if PEAK_KEY.get(precision, "fp32") in ("bf16", "fp16") else 4


def analytic_activation_bytes(model: ModelConfig, tokens: int, precision: str, recompute: bool) -> int:
    """Bytes one layer saves for backward without a measurement: the input alone under recompute, else
    about 12 hidden-wide and 4 ffn-wide tensors a token (norms, q/k/v, attention output, SwiGLU)."""
    e = _element_bytes(precision)
    if recompute:
        return tokens * model.hidden_size * 4
    return tokens * (12 * model.hidden_size + 4 * model.ffn_hidden_size) * e


def estimate_device(kind: DeviceType, model: ModelConfig, precision: str, seq: int, reference: Profile | None) -> DeviceProfile:
    """An estimated profile for ``kind`` (one ConfigError line when the catalog and the cluster give no peak or bandwidth)."""
    key = PEAK_KEY.get(precision, "fp32")
    peak = kind.peak_tflops.get(key)
    if peak is None:
        raise ConfigError(f"{kind.device}: the catalog has no dense {key} peak (its vendor publishes none), so it cannot be "
                          f"estimated; declare it on the cluster group, e.g. peak_tflops: {{{key}: 300}}, or profile the device")
    if kind.memory_bandwidth_gbps is None:
        raise ConfigError(f"{kind.device}: the catalog has no memory bandwidth, so it cannot be estimated; declare it on the "
                          "cluster group, e.g. memory_bandwidth_gbps: 1600, or profile the device")
    measured = [d for d in (reference.devices.values() if reference else ()) if not d.estimated]
    rated = [d for d in measured if d.efficiency]
    eff = rated[0].efficiency if rated else DEFAULT_EFFICIENCY
    assert eff is not None
    flops_s = peak.value * 1e12 * eff
    bytes_s = kind.memory_bandwidth_gbps.value * 1e9 * BANDWIDTH_EFFICIENCY
    weights = layer_parameters(model) * _element_bytes(precision)
    donor = measured[0] if measured else None
    points = []
    for recompute in (False, True):
        for rows in ROWS:
            tokens = rows * seq
            fwd = tokens * (2.0 * layer_parameters(model) + 4.0 * model.num_heads * model.head_dim * seq) / flops_s
            fwd += weights / bytes_s + LAUNCH_S
            bwd = 2 * (fwd - LAUNCH_S) + LAUNCH_S + (fwd if recompute else 0.0)
            act = (round(donor.layer(1, rows, seq, recompute)[2]) if donor is not None
                   else analytic_activation_bytes(model, tokens, precision, recompute))
            points.append(LayerPoint(1, rows, seq, recompute, fwd, bwd, act))
    h, v, e = model.hidden_size, model.vocab_size, _element_bytes(precision)
    head_fwd = 2.0 * h * v / flops_s + 3 * v * 4 / bytes_s  # the head matmul, then softmax over fp32 logits
    embedding = PerToken(2 * h * e / bytes_s, 3 * h * 4 / bytes_s, donor.embedding.activation_bytes if donor else 8)
    head = PerToken(head_fwd, 2 * head_fwd, donor.head.activation_bytes if donor else (h * e + 2 * v * 4),
                    donor.head.transient_bytes if donor else 0)
    # fused with the loss: all three matmuls in the forward, the backward scales the input's and the weight's gradients;
    # its bytes from a measured device of the same backend only (another backend may run the op another way: the
    # cpu's reference forms the logits, cuda's Triton kernel does not), else the kernel's as measured on an H200 in
    # bf16 at hidden 1024-6144: 3 x hidden elements a token, and the weight's gradient each micro-batch
    scale_s = 2 * h * e / bytes_s
    fused = donor.fused_head if donor is not None and donor.backend == kind.backend else None
    fused_head = PerToken(3 * head_fwd, scale_s, fused.activation_bytes if fused else 3 * h * e,
                          fused.transient_bytes if fused else 0, fused.fixed_bytes if fused else v * h * e)
    where = (f"efficiency {eff:.3f} measured on {rated[0].device}" if rated else
             f"efficiency {DEFAULT_EFFICIENCY} (documented default: no present device has a catalog peak"
             + (f"; {measured[0].device} publishes none" if measured else "") + ")")
    basis = (f"estimated from the catalog: {key} peak {peak.value:g} TFLOP/s ({peak.source}), memory bandwidth "
             f"{kind.memory_bandwidth_gbps.value:g} GB/s ({kind.memory_bandwidth_gbps.source}) × {BANDWIDTH_EFFICIENCY}, {where}"
             + ("; activation bytes from the measured " + donor.device if donor else "; activation bytes from a formula"))
    # the weight half's share of a backward is the model's shape more than the device's: a measured device's, if any
    weight_share = next((d.weight_share for d in measured if d.weight_share is not None), None)
    # what splitting costs a layer is its program's (graph breaks, launches): a measured device of the same backend's
    split_cost = next((d.split_cost for d in measured if d.backend == kind.backend and d.split_cost), None)
    return DeviceProfile(kind.device, kind.backend, ESTIMATED, basis, tuple(points), embedding, head,
                         OPTIMIZER_BYTES / bytes_s, None, peak.value * eff, eff, fused_head, weight_share=weight_share,
                         split_cost=split_cost)
