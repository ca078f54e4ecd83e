#!/bin/bash
# GPU session D (4 GPUs, after A): hal train of the example, bridge with more iterations.
cd "$(dirname "$0")"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
python3 - <<'PY'
import yaml
c = yaml.safe_load(open("examples/llama_1b_4gpu.yaml")); c["train"]["checkpoint_dir"] = "/tmp/hal_ckpt"
yaml.safe_dump(c, open("/tmp/ex.yaml", "w"))
PY
s=$(date +%s); timeout 300 python3 -m hal train /tmp/ex.yaml --steps 10 --json --run-dir /tmp/run_ex > $OUT/train.json 2> $OUT/train.err; echo "train rc=$? $(( $(date +%s)-s ))s"
tail -4 $OUT/train.err
python3 -c "
import json; s=json.load(open('$OUT/train.json')); print('hal train steady tok/s %.0f MFU %.1f%% first step %.1fs wall %.1fs tok/s wall %.0f' % (s['tokens_per_s'], 100*s['mfu'], s['first_step_s'], s['wall_s'], s['tokens_per_s_wall']))"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bridge.py --sizes-mib 8,64,256,1024 --channels 1,8 --iters 8 2>&1 | tail -7
