#!/usr/bin/env bash
# One device call (~9 minutes on a fresh machine), written after run 22's first call (bench/NOTES.md "Run 22"):
# where 300 streams' first audio goes, end to end with real WebSocket clients, at 300 and 300:low (Fish `latency:
# low`, a 2-frame first chunk), on three servers of one compile cache:
#   1. the defaults (new prompts held while a running client is nearly dry: --prefill-hold-below-s 0.1, at most
#      --prefill-hold-max-s 0.25 at a time; run 22 call 1 held 15 % of the turns at 300, 33 % at 300:low);
#   2. --prefill-hold-below-s off;
#   3. holds off and --first-chunk-same-turn on (first chunks vocoded after the step that completed them instead of
#      beside the next turn's step).
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_first_audio_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-first-audio}
source bench/device_call.sh
device_env
work=/tmp/first-audio
keep_tarring $work
python3 -m bench.make_checkpoint /tmp/ckpt /tmp/refs > /dev/null
OUT=$work SKIP_TESTS=1 LEVELS="${LEVELS:-300 300:low}" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 \
  WARM_CONC=16 GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300 300:low}" PROFILE_LEVEL=none \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS" \
  WARM_VARIANTS="${WARM_VARIANTS:---prefill-hold-below-s off;--prefill-hold-below-s off --first-chunk-same-turn on}" \
  timeout "${E2E_LIMIT_S:-540}" bash bench/run_server_gpu.sh 2>&1 \
  | grep -E "$E2E_LINES" | grep -v "startup_" | head -40
cat $work/turns.txt 2>/dev/null | cut -c1-300
stop_tarring $work
