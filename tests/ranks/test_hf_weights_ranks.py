"""Hugging Face weights into a heterogeneous plan on real gloo ranks, and each rank's host memory while loading."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from .. import hf_cases as cases
from ..dist_harness import ok_values, run_world

pytest.importorskip("transformers", reason="the reference is transformers' model ('test' extra)")
from safetensors.torch import save_file  # noqa: E402

TOL = 1e-5
MIB = 2**20


def test_tp2_then_dp2_plan_gives_transformers_logits(tmp_path: Path) -> None:
    """4 ranks: stage 0 tp2 (ranks 0-1), stage 1 dp2 (ranks 2-3, one row each), for each family."""
    directories = {f: cases.save_random(f, tmp_path / f, seed=10 + i, max_shard_size="100KB" if f == "llama" else None)
                   for i, f in enumerate(("llama", "mistral", "qwen2"))}
    tokens = cases.ids()
    want = {f: cases.hf_logits(d, tokens) for f, d in directories.items()}
    values = ok_values(run_world("tests.hf_cases", "tp2_then_dp2", 4, deadline_s=240,
                                 directories=[str(d) for d in directories.values()]), 4)
    for family, directory in directories.items():
        for rank in (0, 1):  # really sharded: half of every split weight
            local = values[rank][str(directory)]["local"]
            assert local["layers.0.attn.qkv.weight"] == ((4 + 2 * 2) * 16 // 2, 64)
            assert local["layers.0.mlp.down.weight"] == (64, 64)
            assert local["embed.weight"] == (128, 64)
            assert ("layers.0.attn.qkv.bias" in local) == (family == "qwen2")
        for rank in (2, 3):
            got = values[rank][str(directory)]
            row = got["row"]
            err = float((got["logits"] - want[family][row:row + 1]).abs().max())
            assert err <= TOL, f"{family} rank {rank}: max |logit difference| {err:.3g} above {TOL}"


def test_tp2_moe_stage_loads_each_experts_tp_slice_and_gives_transformers_logits(tmp_path: Path) -> None:
    """The same plan for Mixtral and Qwen2-MoE: stage 0's MoE layers at tp2, every expert's FFN width split over the
    two ranks (gate|up by rows, down by columns; Qwen2-MoE's shared expert too), each rank loading only its slices."""
    directories = {f: cases.save_random(f, tmp_path / f, seed=20 + i, dense_layers=0)
                   for i, f in enumerate(("mixtral", "qwen2_moe"))}
    tokens = cases.ids()
    want = {f: cases.hf_logits(d, tokens) for f, d in directories.items()}
    values = ok_values(run_world("tests.hf_cases", "tp2_then_dp2", 4, deadline_s=240,
                                 directories=[str(d) for d in directories.values()]), 4)
    widths = {"mixtral": 128, "qwen2_moe": 48}
    for family, directory in directories.items():
        for rank in (0, 1):
            local = values[rank][str(directory)]["local"]
            assert local["layers.0.mlp.experts.gate_up"] == (4, widths[family], 64)  # 2 × width / 2 ranks
            assert local["layers.0.mlp.experts.down"] == (4, 64, widths[family] // 2)
            if family == "qwen2_moe":
                assert local["layers.0.mlp.shared.gate_up.weight"] == (40, 64)
                assert local["layers.0.mlp.shared.down.weight"] == (64, 20)
        for rank in (2, 3):
            got = values[rank][str(directory)]
            err = float((got["logits"] - want[family][got["row"]:got["row"] + 1]).abs().max())
            assert err <= TOL, f"{family} rank {rank}: max |logit difference| {err:.3g} above {TOL}"


# --- memory -------------------------------------------------------------------------------------------------------
# 91 M parameters, 350 MiB in fp32; the embedding and the head are 128 MiB each, so a rank that materialised one
# whole tensor, or kept a whole half-tensor's pages mapped while copying it, would exceed the bound below
BIG = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4, max_position_embeddings=64)
SHARD_BYTES = 64 * MIB
BOUND = 48 * MIB  # what a rank may hold beyond its own shard while loading (the reader maps 16 MiB blocks)


def _write_big(directory: Path) -> tuple[int, dict[str, float]]:
    """A random Llama-shaped checkpoint in 64 MiB shards with its index, written tensor by tensor (the test
    process never holds the model); its size and the sums each TP rank's probe slices must have."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.state.hf_checks import hf_shapes

    directory.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, **BIG}
    (directory / "config.json").write_text(json.dumps(config))
    model = ModelConfig.from_mapping({"hf": str(directory)})
    g = torch.Generator().manual_seed(0)
    sums, total, shard, index = {}, 0, {}, {}
    parts: list[str] = []

    def flush() -> None:
        parts.append(f"part-{len(parts) + 1}.safetensors")
        save_file(shard, directory / parts[-1], metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, parts[-1]))
        shard.clear()

    for name, shape in hf_shapes(model).items():
        tensor = torch.randn(shape, generator=g) * 0.02
        if name == "model.embed_tokens.weight":
            sums.update({f"{t}:embed.weight": float(tensor.double()[t * 16384:(t + 1) * 16384].sum()) for t in (0, 1)})
        if name == "model.layers.0.mlp.down_proj.weight":
            sums.update({f"{t}:layers.0.mlp.down.weight": float(tensor.double()[:, t * 1408:(t + 1) * 1408].sum()) for t in (0, 1)})
        if shard and sum(v.numel() * 4 for v in shard.values()) + tensor.numel() * 4 > SHARD_BYTES:
            flush()
        shard[name] = tensor
        total += tensor.numel() * 4
    flush()
    names = {old: f"model-{k:05d}-of-{len(parts):05d}.safetensors" for k, old in enumerate(parts, 1)}  # -of-N known only now
    for old, new in names.items():
        (directory / old).rename(directory / new)
    weight_map = {tensor: names[old] for tensor, old in index.items()}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, sums


def test_each_tp2_rank_holds_its_shard_plus_a_bounded_buffer_while_loading(tmp_path: Path) -> None:
    total, sums = _write_big(tmp_path / "big")
    assert total > 340 * MIB and len(list((tmp_path / "big").glob("model-*.safetensors"))) >= 4
    values: dict[int, Any] = ok_values(run_world("tests.hf_cases", "load_peak", 2, deadline_s=240, directory=str(tmp_path / "big")), 2)
    for rank, v in values.items():
        assert v["reset"], "this kernel cannot reset the peak RSS (/proc/self/clear_refs); the measurement needs it"
        print(f"rank {rank}: peak {v['peak'] / MIB:.1f} MiB while loading; its shard {v['shard'] / MIB:.1f} MiB; "
              f"the full model {total / MIB:.1f} MiB")
        assert v["shard"] < total / 2 + MIB
        assert v["peak"] <= v["shard"] + BOUND, f"rank {rank}: peak {v['peak'] / MIB:.1f} MiB > shard {v['shard'] / MIB:.1f} + {BOUND / MIB:.0f} MiB"
        for name, value in v["sums"].items():  # the rank's own slices, not another rank's
            assert value == pytest.approx(sums[f"{rank}:{name}"], rel=1e-9, abs=1e-9), name
