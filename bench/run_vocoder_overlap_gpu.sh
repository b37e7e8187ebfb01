#!/usr/bin/env bash
# One device call (~9 minutes; bench/NOTES.md "The next device call, in order (written after run 20)", items 1, 2, 4):
#   1. GPU tests (≤ 200 s): the engine with --vocoder-overlap on against the serial one (seeded codes and audio, no
#      turn over 1 s), and the merged-chunk vocoder graphs against unpadded eager calls;
#   2. end to end on one compile cache (bench/run_server_gpu.sh, run 19's settings): a cold default server at 300
#      steady streams, then warm restarts with --vocoder-overlap on and with --vocoder-merge-padding 32, each at
#      WARM_LEVELS (default 300; "300 384" needs a call of its own: ~3 more minutes).
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_vocoder_overlap_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-vocoder-overlap}
source bench/device_call.sh
work=/tmp/vocoder-overlap
begin_call $work
timeout 200 python3 -m pytest -q -s tests/streaming/test_engine_gpu.py tests/model/test_gpu.py -p no:cacheprovider \
  -k "beside_the_step or merged_chunk_lengths" -rA --tb=short > $work/gpu_tests.txt 2>&1
grep -E "overlap vs serial|PASSED|FAILED|passed|failed" $work/gpu_tests.txt | head -8
OUT=$work SKIP_TESTS=1 LEVELS="300" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 WARM_CONC=16 \
  GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300}" \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS" \
  WARM_VARIANTS="--vocoder-overlap on;--vocoder-merge-padding 32" \
  timeout "${E2E_LIMIT_S:-370}" bash bench/run_server_gpu.sh 2>&1 | grep -E "$E2E_LINES" \
  | head -30
cat $work/turns.txt 2>/dev/null | cut -c1-300
stop_tarring $work
