#!/usr/bin/env bash
# One device call: decode + vocoder bench with a cold torch.compile, a warm compile, the model check, GPU tests.
# (torch 2.11 inductor fails at batch 8, so only batch 1 is compiled by default; bench/profile_step.py is separate.)
# Usage on the GPU machine (repo root): FISHGATE_COMMIT=<sha> bash bench/run_gpu.sh   (results under $OUT)
set -u
OUT=${OUT:-/tmp/fishgate-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fishgate-inductor}
PY=${PY:-python3}
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
stamp "bench_decode (cold compile)"
timeout 250 $PY -m bench.bench_decode --out "$OUT/decode.json" --compile-batches "${COMPILE_BATCHES:-1}" 2>&1 \
  | grep -v "^decode batch\|^vocoder \|^compiled batch" | tail -60
stamp "bench_decode --compile-only (warm inductor cache)"
timeout 180 $PY -m bench.bench_decode --out "$OUT/compile_warm.json" --compile-only --compile-batches 1 2>&1 | tail -8
stamp "gpu_model_check"
timeout 100 $PY -m bench.gpu_model_check --out "$OUT/model_check.json" 2>&1 | tail -15
stamp "pytest tests/model/test_gpu.py"
timeout 90 $PY -m pytest tests/model/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -15
stamp "done"
du -sh "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null
