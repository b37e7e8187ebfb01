#!/usr/bin/env bash
# One short device call (run 16 call 4 ran it with graph+cl+bench+ops, +dbench and graph+cl; the default now is the
# next session's: the one bad conv shape channels-first, with and without folded biases, against autotuning), each
# variant in its own process (cuDNN caches a conv's plan
# whether tuned or not, so variants sharing shapes in one process reuse each other's); plus the GPU tests of the
# channels-last graphs and the Triton kernels.
# Usage on the GPU machine, repo root:   bash bench/run_vocoder_layouts_gpu.sh        (everything in $OUT/all.tgz)
set -u
OUT=${OUT:-/tmp/fishgate-vocoder-layouts}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
work=/tmp/vocoder-layouts
mkdir -p $work
timeout 90 python3 -m pytest -q tests/model/test_gpu.py -k "triton or silu_joins or channels_last or fused" -p no:cacheprovider \
  -rf --tb=short > $work/gpu_tests.txt 2>&1
tail -3 $work/gpu_tests.txt
for v in ${VARIANTS:-graph+cl+cf graph+cl+cf+fuse graph+cl+bench}; do
  timeout 150 python3 -m bench.vocoder_variants --variants "$v" --shapes 1x8,64x24,256x24 --out "$work/$v.json" \
    > "$work/$v.txt" 2>&1
  grep -E "^ +op " "$work/$v.txt" | head -8
  tail -3 "$work/$v.txt"
done
tar czf "$OUT/all.tgz" -C $work .
