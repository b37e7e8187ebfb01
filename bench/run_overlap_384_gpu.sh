#!/usr/bin/env bash
# One device call (~8 minutes), written after run 21's second call (warm A/B at 300: overlap with merged calls best,
# merged calls alone worst): 1. a cold start that fills the compile cache, then a warm restart with --graphs-up-front 1
# (start-up by phase with the warm-up on the lowest rows, and 8 level-1 requests right after ready); 2. on that
# cache, warm restarts with --vocoder-overlap on, alone and with --vocoder-merge-padding 32, at 300 and 384 streams.
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_overlap_384_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-overlap-384}
source bench/device_call.sh
work=/tmp/overlap-384
mkdir -p $work/start $work/levels
begin_call $work
common=(SKIP_TESTS=1 LEVELS="" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 WARM_CONC=16 GRAPH_WAIT_S=90
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS")
env "${common[@]}" OUT=$work/start WARM_VARIANTS="--graphs-up-front 1" \
  timeout "${START_LIMIT_S:-230}" bash bench/run_server_gpu.sh 2>&1 | grep -E "$E2E_LINES" | head -10
env "${common[@]}" OUT=$work/levels WARM_LEVELS="${WARM_LEVELS:-300 384}" \
  WARM_VARIANTS="${WARM_VARIANTS:---vocoder-overlap on;--vocoder-overlap on --vocoder-merge-padding 32}" \
  timeout "${E2E_LIMIT_S:-330}" bash bench/run_server_gpu.sh 2>&1 | grep -E "$E2E_LINES" | head -30
cat $work/levels/turns.txt 2>/dev/null | cut -c1-300
stop_tarring $work
