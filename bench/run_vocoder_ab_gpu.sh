#!/usr/bin/env bash
# One device call (~8.5 minutes), written after run 21's first call (whose merge-padding restart ran out of time and
# whose default server was the cold one): the overlap GPU test with its bf16 tolerance, then one cold start (no
# levels: it only fills the compile cache) and three warm restarts on that cache at WARM_LEVELS (default 300):
# default, --vocoder-merge-padding 32, and --vocoder-overlap on with --vocoder-merge-padding 32. Warm against warm.
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_vocoder_ab_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-vocoder-ab}
source bench/device_call.sh
work=/tmp/vocoder-ab
begin_call $work
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 120 python3 -m pytest -q -s tests/streaming/test_engine_gpu.py -p no:cacheprovider -k "beside_the_step" \
    -rA --tb=short > $work/gpu_tests.txt 2>&1
  grep -E "overlap vs serial|PASSED|FAILED|passed|failed" $work/gpu_tests.txt | head -6
fi
OUT=$work SKIP_TESTS=1 LEVELS="" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 WARM_CONC=16 \
  GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300}" \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS" \
  WARM_VARIANTS="${WARM_VARIANTS:-default;--vocoder-merge-padding 32;--vocoder-overlap on --vocoder-merge-padding 32}" \
  timeout "${E2E_LIMIT_S:-480}" bash bench/run_server_gpu.sh 2>&1 | grep -E "$E2E_LINES" \
  | head -30
cat $work/turns.txt 2>/dev/null | cut -c1-300
stop_tarring $work
