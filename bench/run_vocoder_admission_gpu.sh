#!/usr/bin/env bash
# One device call (run 16, calls 2-3; run 17, call 2 with VOCODER_VARIANTS empty and the layout on; bench/NOTES.md):
#   1. GPU tests of the Triton vocoder kernels (history join and conv bias, both layouts) and the channels-last graphs;
#   2. vocoder timing: the default layout (Triton join and bias since run 16) against channels-last (convs as NHWC
#      conv2d since call 2), with and without cuDNN autotuning, a per-ATen-op profile of the channels-last call;
#   3. `fishgate serve` end to end at 384 and 512 offered streams with `--admission-turn-fraction 0.9` (sessions
#      wait up to --admission-wait-s for room), every bucket compiled, the vocoder layout that was fastest at 64 × 24
#      in step 2 (autotuned only when it beats the heuristic by 15 %: it costs seconds per graph captured); slow
#      turns and GC pauses logged by the server.
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_vocoder_admission_gpu.sh
# Knobs (environment): VOCODER_VARIANTS (default none: the e2e runs the server's default layout, on), VOCODER_LAYOUT
# (off|on|tuned: skip the choice), HALF_STEP (on|off), ADMISSION (the turn fraction), LEVELS, GRAPH_WAIT_S,
# EXTRA_SERVE_ARGS, E2E_LIMIT_S, ENGINE_TESTS (a pytest -k for tests/streaming/test_engine_gpu.py after the e2e),
# PROFILE_LEVEL (py-spy on that level; PROFILE_AFTER_S, PROFILE_S).
# Everything lands in $OUT/all.tgz (one file: the device returns a limited number of files).
set -u
OUT=${OUT:-/tmp/fishgate-vocoder-admission}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
work=/tmp/vocoder-admission
mkdir -p $work
timeout 90 python3 -m pytest -q tests/model/test_gpu.py -k "triton or silu_joins or channels_last or fused or rerouted or pinned_staging" -p no:cacheprovider \
  -rf --tb=short > $work/gpu_tests.txt 2>&1
tail -4 $work/gpu_tests.txt
# each variant in its own process: cuDNN caches a conv's plan whether tuned or not (run 16 call 3: "+bench" after "+cl"
# in one process reused the heuristic's plans)
for v in ${VOCODER_VARIANTS:-}; do
  timeout 150 python3 -m bench.vocoder_variants --variants "$v" --shapes 1x8,64x24,256x24 --out "$work/vocoder_$v.json" \
    > "$work/vocoder_$v.txt" 2>&1
  grep -E "^ +op " "$work/vocoder_$v.txt" | head -8
  tail -4 "$work/vocoder_$v.txt"
done
layout=$(python3 - $work/vocoder_*.json <<'PY' 2>/dev/null
import json, sys
rows = {}
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        if (r["batch"], r["frames"]) == (64, 24):
            rows[r["variant"].replace("+ops", "")] = r["ms"]
plain, cl, tuned = rows.get("graph"), rows.get("graph+cl"), rows.get("graph+cl+bench")
best = "on"  # the server's default
if cl and plain and cl < plain:
    best = "on"
if tuned and plain and tuned < plain and tuned < 0.85 * (cl or float("inf")):
    best = "tuned"
print(best)
PY
)
[ -n "${VOCODER_LAYOUT:-}" ] && layout=$VOCODER_LAYOUT
echo "vocoder layout for the e2e: --vocoder-channels-last ${layout:-on}"
OUT=$work SKIP_TESTS=1 WAVES=2 RAMP_S=9 LEVELS="${LEVELS:-384 512}" LEVEL_TIMEOUT_S=100 WARM_CONC=16 PROFILE_LEVEL=${PROFILE_LEVEL:-none} \
  GRAPH_WAIT_S=${GRAPH_WAIT_S:-100} READY_LIMIT_S=240 \
  SERVE_ARGS="--compile-max-batch 512 --compile-tune-single-row off --vocoder-half-step-buckets ${HALF_STEP:-on} --admission-turn-fraction ${ADMISSION:-0.9} --compile-cache-dir build/cc --vocoder-channels-last ${layout:-on} ${EXTRA_SERVE_ARGS:-}" \
  timeout "${E2E_LIMIT_S:-330}" bash bench/run_server_gpu.sh > $work/e2e.txt 2>&1
grep -E "^level|start|captured|missing|^\| [0-9]|died|not ready|Error|slow turn|garbage|slow_turns" $work/e2e.txt | head -40
if [ -n "${ENGINE_TESTS:-}" ]; then
  timeout 150 python3 -m pytest -q tests/streaming/test_engine_gpu.py -k "$ENGINE_TESTS" -p no:cacheprovider -rf \
    --tb=short > $work/engine_tests.txt 2>&1
  tail -3 $work/engine_tests.txt
fi
tar czf "$OUT/all.tgz" -C $work .
