#!/bin/bash
# GPU session A (4 GPUs): pipeline benchmarks, then hal train of the example.
cd "$(dirname "$0")"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
B="python3 benchmarks/pipeline.py --stages 4 --micro-batches 16 --compile --steps 4 --warmup 2 --rounds 3 --json --timeout 300"
run() { name=$1; shift; s=$(date +%s); $B "$@" > $OUT/$name.json 2> $OUT/$name.err; echo "$name rc=$? $(( $(date +%s)-s ))s" >> $OUT/times.txt; }
run mbs4_fused_uneven --micro-batch-size 4 --fused-head --layers 7,6,6,5
run mbs4_uneven --micro-batch-size 4 --layers 7,6,6,5
run mbs2_fused_uneven --micro-batch-size 2 --fused-head --layers 7,6,6,5
run mbs1_fused_uneven --micro-batch-size 1 --fused-head --layers 7,6,6,5
cat $OUT/times.txt
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    try: s = json.load(open(f))
    except Exception as e: print(os.path.basename(f), "unreadable", e); continue
    print(os.path.basename(f), s["card"], "mbs", s["micro_batch_size"], s["layers"], "fused", s["fused_head"],
          "tok/s %.0f/%.0f" % (s["tokens_per_s"]["ours"], s["tokens_per_s"]["torch"]),
          "MFU %.1f%%/%.1f%%" % (100*s["mfu"]["ours"], 100*s["mfu"]["torch"]),
          "ratio %.3f %s" % (s["ratio_ours_over_torch"], [round(r,3) for r in s["ratio_per_round"]]),
          "idle %.3f/%.3f" % (s["bubble_measured_mean"], s["bubble_ideal"]),
          "mem", [round(st["peak_mem_gib_ours"],1) for st in s["per_stage"]])
PY
