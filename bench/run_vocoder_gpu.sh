#!/usr/bin/env bash
# One device call: the vocoder's graph variants (bench/vocoder_variants.py: channels-last layout, torch.compile,
# per-kernel profiles), the GPU tests, then how often a seeded stream's codes change under load
# (bench/seed_divergence.py); STEP_VARIANTS=a,b also times decode-step variants (bench/step_variants.py). Usage on the GPU machine, repo root, wheels in .whl (bench/NOTES.md; carry [".whl"]):
#   bash bench/run_vocoder_gpu.sh          (results under $OUT)
# The end-to-end figure: SERVE_ARGS="--compile-vocoder on" bash bench/run_server_gpu.sh
set -u
OUT=${OUT:-/tmp/fishgate-vocoder-bench}
mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fishgate-inductor}
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ -n "${FIRST_TESTS:-}" ]; then  # e.g. FIRST_TESTS="tests/a.py::test_x tests/b.py::test_y": each run alone, whole
  i=0                                 # tracebacks kept under $OUT even when a later one runs out of time
  for t in $FIRST_TESTS; do
    i=$((i + 1))
    stamp "first test $i: $t"
    timeout "${FIRST_TESTS_S:-150}" python3 -m pytest "$t" -m gpu -p no:cacheprovider -rf --tb=long 2>&1 \
      > "$OUT/first_test_$i.txt"
    grep -E "^E |passed|failed" "$OUT/first_test_$i.txt" | head -20
  done
fi
stamp "vocoder variants"
timeout "${VOCODER_S:-300}" python3 -m bench.vocoder_variants --budget-s "$(( ${VOCODER_S:-300} - 40 ))" \
  --variants "${VARIANTS:-graph,graph+cl,graph+compiled,graph+cl+compiled}" ${SHAPES:+--shapes $SHAPES} \
  --out "$OUT/vocoder_variants.json" 2>&1 \
  | grep -v "^{" | tail -60
if [ -n "${STEP_VARIANTS:-}" ]; then  # e.g. STEP_VARIANTS=compiled,compiled_reduce: the decode step's what-ifs
  stamp "step variants"
  timeout "${STEP_S:-170}" python3 -m bench.step_variants --variants "$STEP_VARIANTS" --batches "${STEP_BATCHES:-1,8}" \
    --compile-batches "${STEP_BATCHES:-1,8}" --budget-s "$(( ${STEP_S:-170} - 50 ))" --out "$OUT/step_variants.json" \
    2>&1 | tail -30
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  stamp "gpu tests"
  timeout "${TESTS_S:-170}" python3 -m pytest tests/model/test_gpu.py tests/model/test_vocoder_stream.py \
    tests/streaming/test_engine_gpu.py -m gpu -q -p no:cacheprovider -rf --tb=short 2>&1 | tee "$OUT/gpu_tests.txt" | tail -30
fi
[ -n "${SKIP_DIVERGENCE:-}" ] && { stamp "done"; exit 0; }
stamp "seed divergence"
timeout "${DIVERGENCE_S:-100}" python3 -m bench.seed_divergence --seeds "${SEEDS:-8}" --out "$OUT/seed_divergence.json" \
  2>&1 | tail -6
stamp "done"
