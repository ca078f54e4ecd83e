#!/usr/bin/env bash
# The open issues' GPU measurements, one section a call (each fits the device tool's 10-minute call):
#
#     bash benchmarks/four_gpus.sh SECTION [SECTION ...]     # logs under $OUT (else ./out/four_gpus), a table last
#
# Sections (the issue and item each re-measures; GPUs it needs):
#   examples    35.1  every GPU example trains 3 steps, first step bounded (tests/cuda/test_examples_gpu.py)  4
#   moe         35.4  the 1.2B 8-expert model compiled at 1 and 4 rows a rank, ep 4 against ep 1                4
#   train       35.5  hal train of examples/llama_1b_4gpu.yaml against benchmarks/pipeline.py --master-weights,
#                     same plan and precision (fp32 weights under bf16 autocast, as hal train keeps them)           4
#   train-bf16  35.5  the same benchmark with bf16 weights (the issue's 46.9 % MFU figure)                         4
#   train-loop  35.5  hal train of that example against the engine and optimizer it builds (train_vs_engine.py)    4
#   schedules   36    ZB-V and interleaved zero-bubble against our own 1F1B (--baseline 1f1b), compiled, at M 8      4
#   schedules-m16 36  the same at M 16                                                                              4
#   uneven      36    ZB-V over 9/6/5/4 layers, unit-time order against the measured one, compiled               4
#   dualpipev   36.3  DualPipeV compiled at M 8: its pairs at once against in turn, and against our own 1F1B       4
#   dualpipev-torch 36.3  DualPipeV against torch's ScheduleDualPipeV on the same stage modules (eager)           4
#   planner-wide, planner-narrow, planner-tied
#               35.3  the planner's first pick and memory on the untuned shapes (5 plans each)                  4
#   hetero      35.7  benchmarks/planner_hetero.py on 2 GPUs + 2 cpu ranks (goal: <= 3 minutes)                2
#   ccl         37.3  the collectives suite's reduction probes on NCCL (what the library's sums accumulate in) 2+
#   kernels     35.6  every Triton kernel against torch.compile of its reference, 2048 and 8192 tokens           1
#   replicas    34    two dp2 GPU islands (bf16 / fp32): rows auto against even and the fast island alone, the exchange
#                     during the backward against after it, each run beside the planner's prediction                4
#   izb-loop    36    the two-GPU interleaved zero-bubble test five times (hung 4 of 5; with the drain 2 of 2, then 5 of 5)  2
#
# Each command runs under `timeout`; a section's log keeps all it printed, the table the lines that carry its figures.
set -uo pipefail
cd "$(dirname "$0")/.."
SECTIONS="examples moe train train-bf16 train-loop schedules schedules-m16 uneven dualpipev dualpipev-torch planner-wide planner-narrow planner-tied hetero ccl kernels replicas izb-loop"
[ $# -gt 0 ] || { echo "usage: bash benchmarks/four_gpus.sh SECTION [SECTION ...]; sections: $SECTIONS" >&2; exit 2; }
for section in "$@"; do
    case " $SECTIONS " in *" $section "*) ;; *) echo "four_gpus.sh: unknown section '$section'; sections: $SECTIONS" >&2; exit 2 ;; esac
done
out="${OUT:-out/four_gpus}"
mkdir -p "$out"
python -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
card="$(python -c 'from hal import get_backend as g; b = g("cuda"); print(f"{b.device_count()} x {b.device_name(0)}")' 2>/dev/null)"
summary="$out/summary.txt"
echo "four_gpus.sh on ${card:-no GPU visible}, $(date -u +%F' '%H:%M) UTC" | tee -a "$summary"

step() {  # step NAME SECONDS COMMAND...: run it, log it, keep its figure lines for the table
    local name="$1" limit="$2"; shift 2
    local began=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - began))" | tee -a "$summary"
    grep -E 'tok(ens)?/s|MFU|passed|failed|ratio|idle|order|step [0-9]+ s|first pick|error|×|x faster| fwd' "$out/$name.log" \
        | grep -v -i 'warn' | tail -n 10 | sed 's/^/    /' | tee -a "$summary"
}

for section in "$@"; do
    case "$section" in
        examples)
            step examples 560 python -m pytest -q -m cuda tests/cuda/test_examples_gpu.py -p no:cacheprovider ;;
        moe)
            step moe-4-rows 280 python benchmarks/moe.py --world-size 4 --compile --micro-batch-size 4 --model-steps 6 --tokens 8192
            step moe-1-row 260 python benchmarks/moe.py --world-size 4 --compile --micro-batch-size 1 --model-steps 6 --tokens 8192 ;;
        train)
            step bench-1f1b-7-6-6-5-master-weights 280 python benchmarks/pipeline.py --stages 4 --micro-batches 16 \
                --micro-batch-size 4 --compile --fused-head --layers 7,6,6,5 --master-weights
            step hal-train-llama-1b 280 python -m hal train examples/llama_1b_4gpu.yaml --steps 12 --json --run-dir "$out/llama-1b" ;;
        train-loop)
            step train-vs-engine-llama-1b 560 python benchmarks/train_vs_engine.py examples/llama_1b_4gpu.yaml --steps 4 \
                --rounds 2 --timeout 270 ;;
        train-bf16)
            step bench-1f1b-7-6-6-5 280 python benchmarks/pipeline.py --stages 4 --micro-batches 16 --micro-batch-size 4 \
                --compile --fused-head --layers 7,6,6,5 ;;
        schedules|schedules-m16)  # each run compiles two engines (ours and the 1F1B baseline): two runs a call
            M="$([ "$section" = schedules ] && echo 8 || echo 16)"
            for schedule in zbv interleaved-zero-bubble; do
                step "pipeline-$schedule-M$M-vs-1f1b" 280 python benchmarks/pipeline.py --stages 4 --micro-batches "$M" \
                    --micro-batch-size 4 --fused-head --compile --schedule "$schedule" --baseline 1f1b
            done ;;
        uneven)
            for order in unit measured; do
                step "pipeline-zbv-9-6-5-4-$order" 280 python benchmarks/pipeline.py --stages 4 --micro-batches 8 \
                    --micro-batch-size 4 --fused-head --compile --schedule zbv --layers 5+4,3+3,3+2,2+2 --order "$order" \
                    --baseline 1f1b
            done ;;
        dualpipev)  # two compiling runs: pairs at once (HAL_PAIR_OVERLAP=1, set by --baseline in-turn) against in turn;
                    # then as a user gets it (compiled: pairs in turn) against our 1F1B on the same layers
            for baseline in in-turn 1f1b; do
                step "pipeline-dualpipev-M8-vs-$baseline" 280 python benchmarks/pipeline.py --stages 4 --micro-batches 8 \
                    --micro-batch-size 4 --fused-head --compile --schedule dualpipev --baseline "$baseline"
            done ;;
        dualpipev-torch)  # torch's DualPipeV splits neither a compiled layer nor a fused head: eager, the head in the stage
            step pipeline-dualpipev-M8-vs-torch 280 python benchmarks/pipeline.py --stages 4 --micro-batches 8 \
                --micro-batch-size 4 --schedule dualpipev --baseline torch ;;
        planner-wide|planner-narrow|planner-tied)
            model="$(case "$section" in planner-wide) echo wide-shallow ;; planner-narrow) echo narrow-deep ;; *) echo tied-128k-vocab ;; esac)"
            step "planner-$model" 560 python benchmarks/planner_accuracy.py --backend cuda --model "$model" --only 1,2,5,6,9 ;;
        hetero)
            step planner-hetero 560 python benchmarks/planner_hetero.py --gpus 2 --cpus 2 ;;
        kernels)
            for tokens in 2048 8192; do
                step "kernels-$tokens-tokens" 250 python benchmarks/kernels.py --tokens "$tokens"
            done ;;
        replicas)
            step replicas-two-gpu-islands 560 python benchmarks/replicas_shares.py --devices 2 --hidden 2048 --layers 8 \
                --rows 64 --steps 12 --overlap both --profile make --timeout 120 ;;
        izb-loop)
            for i in 1 2 3 4 5; do
                step "izb-two-gpus-$i" 100 python -m pytest -q -m cuda \
                    "tests/cuda/test_engine_cuda.py::test_interleaved_zero_bubble_on_two_gpus_matches" -p no:cacheprovider
            done ;;
        ccl)
            step ccl-probes 400 python -m hal conformance run --backend cuda --suite collectives -k 'reduction_probe' \
                --report "$out/ccl-report" ;;
    esac
done
