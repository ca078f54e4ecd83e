#!/bin/bash
# GPU session B (2 GPUs): bridge channels, linear-CE kernel, hal train --profile (device events), 2-stage pipeline sanity.
cd "$(dirname "$0")"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
t() { name=$1; shift; s=$(date +%s); timeout $T "$@" > $OUT/$name.out 2> $OUT/$name.err; echo "$name rc=$? $(( $(date +%s)-s ))s" >> $OUT/times.txt; }
T=150 t bridge env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bridge.py --sizes-mib 16,64,256,1024 --channels 1,2,4,8 --iters 4
T=150 t kernels_ce python3 benchmarks/kernels.py --only linear_cross_entropy --hidden 4096 --tokens 8192 --vocab 128256 --iters 10 --warmup 3
python3 - <<'PY'
import yaml
c = yaml.safe_load(open("examples/llama_1b_4gpu.yaml"))
c["parallel"]["stages"] = [{"backend": "cuda", "devices": 1, "layers": 13}, {"backend": "cuda", "devices": 1, "layers": 11}]
c["parallel"]["micro_batches"] = 8; c["parallel"]["micro_batch_size"] = 2; c["train"]["steps"] = 4
c["train"]["checkpoint_dir"] = "/tmp/hal_ckpt"
yaml.safe_dump(c, open("/tmp/two_gpu.yaml", "w"))
PY
T=200 t train_profile python3 -m hal train /tmp/two_gpu.yaml --steps 4 --profile --json --run-dir /tmp/run_prof
cp /tmp/run_prof/*.jsonl $OUT/ 2>/dev/null; cp /tmp/run_prof/*.json $OUT/ 2>/dev/null
cat $OUT/times.txt
echo "--- bridge"; tail -8 $OUT/bridge.out; tail -3 $OUT/bridge.err
echo "--- kernels"; tail -12 $OUT/kernels_ce.out; tail -3 $OUT/kernels_ce.err
echo "--- train"; tail -5 $OUT/train_profile.err
python3 - <<'PY'
import json, glob, os
for f in glob.glob("/tmp/run_prof/*.jsonl") + glob.glob("/tmp/run_prof/**/*.jsonl", recursive=True):
    for line in open(f):
        r = json.loads(line)
        if "stages" in r and "step" in r:
            print("step", r["step"], "step_s %.3f" % r["step_s"], "sched", r.get("schedule_s"), [(s["stage"], s["compute_s"] and round(s["compute_s"],3), s["p2p_s"] and round(s["p2p_s"],3), s["bubble_s"] and round(s["bubble_s"],3), s["optimizer_s"] and round(s["optimizer_s"],3)) for s in r["stages"]])
    break
try:
    s = json.load(open(os.environ["OUT"] + "/train_profile.out"))
    print("summary tok/s", s["tokens_per_s"], "mfu", s["mfu"], "first_step_s", s["first_step_s"], "wall", s["wall_s"])
except Exception as e:
    print("no summary", e)
PY
