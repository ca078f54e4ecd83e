"""``hal export CHECKPOINT --to hf OUT_DIR``: a training checkpoint as a Hugging Face model directory.

The library is ``hal.parallel.state.hf_export`` (imported only when the command runs, so ``hal --help``
stays fast and ``safetensors`` stays optional). Bad input — a damaged checkpoint, an existing
non-empty OUT_DIR without ``--force``, a tokenizer that is not the data's — is a HalError, which
``hal``'s main prints as one line and exit 2, with nothing written.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

NAME = "export"
FORMATS = ("hf",)


def add_parser(sub: Any) -> None:
    """Add ``export`` to hal's sub-command parsers."""
    p = sub.add_parser(
        NAME, help="write a training checkpoint as a Hugging Face model directory (config.json + sharded safetensors)",
        description="Write CHECKPOINT (a step-N directory, or a checkpoint_dir: its latest — as --resume takes it) as a "
        "Hugging Face model directory that transformers' AutoModelForCausalLM.from_pretrained loads: config.json "
        "(model_type of the model's family: llama, qwen2, mixtral or qwen2_moe), model-0000k-of-0000N.safetensors shards and "
        "model.safetensors.index.json, plus the tokenizer files when one is known. The checkpoint is checked first; "
        "everything is written to a temporary directory and renamed into place when complete.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint hal train wrote (step-N, or its checkpoint_dir)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the format: hf (Hugging Face transformers)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (absent or empty, unless --force)")
    p.add_argument("--max-shard-mib", type=int, default=2048, metavar="MIB", help="largest safetensors shard (default 2048)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a tokenizer.json (or its directory) to include; default: the one in the Hugging Face directory the "
                   "run started from (model.hf with weights / --init-from), if any")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR (only once the new one is complete)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hal.errors import ConfigError
    from hal.parallel.state.hf_export import export_hf

    if args.max_shard_mib < 1:
        raise ConfigError(f"--max-shard-mib {args.max_shard_mib} is not a size; give 1 or more (MiB)")
    report = export_hf(args.checkpoint, args.out_dir, max_shard_bytes=args.max_shard_mib * 2**20, tokenizer=args.tokenizer,
                       force=args.force)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        tokenizer = ", ".join(report["tokenizer"]) if report["tokenizer"] else "no tokenizer (pass --tokenizer to include one)"
        print(f"hal export: {report['checkpoint']} (step {report['step']}) -> {report['out_dir']}: {report['model_type']}, "
              f"{report['tensors']} tensors, {report['bytes'] / 2**20:.1f} MiB in {report['shards']} shard(s); {tokenizer}")
    return 0
