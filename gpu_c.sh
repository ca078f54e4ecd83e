#!/bin/bash
cd "$(dirname "$0")"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
for c in 4 8 16; do
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bridge.py --sizes-mib 8,64,256,1024 --channels 1,4,8,12 --iters 4 --chunk-mib $c 2>&1 | tail -6 | head -5
done
