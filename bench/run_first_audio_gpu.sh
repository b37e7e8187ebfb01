#!/usr/bin/env bash
# One device call (~9.5 minutes on a fresh machine), written during run 22 (bench/NOTES.md "Run 22"): where 300
# streams' first audio goes, end to end with real WebSocket clients, at 300, 300:low (Fish `latency: low`, a 2-frame
# first chunk) and 384, on two servers of one compile cache:
#   1. new prompts never held back (--prefill-hold-below-s off; run 22 call 2 at 300: p95 first audio 198 → 159 ms);
#   2. the same with --urgent-chunks-same-turn on (the chunks of clients with nothing or under 0.15 s to play are
#      vocoded after the step that completed them instead of beside the next turn's step);
# then, in what is left of the call, the one-row decode step with the length-aware attention kernel, compiled and
# compiled with coordinate-descent tuning (bench/step_variants.py; issue 3's batch-1 level).
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_first_audio_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-first-audio}
source bench/device_call.sh
device_env
work=/tmp/first-audio
keep_tarring $work
python3 -m bench.make_checkpoint /tmp/ckpt /tmp/refs > /dev/null
OUT=$work SKIP_TESTS=1 LEVELS="${LEVELS:-300 300:low 384}" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 \
  WARM_CONC=16 GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300 300:low 384}" PROFILE_LEVEL=none \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS ${FIRST_SERVE_ARGS:---prefill-hold-below-s off}" \
  WARM_VARIANTS="${WARM_VARIANTS:---urgent-chunks-same-turn on}" \
  timeout "${E2E_LIMIT_S:-440}" bash bench/run_server_gpu.sh 2>&1 \
  | grep -E "$E2E_LINES" | grep -v "startup_" | head -40
cat $work/turns.txt 2>/dev/null | cut -c1-300
timeout "${STEP_LIMIT_S:-110}" python3 -m bench.step_variants --variants compiled_length_4096,compiled_cd_length_4096 \
  --batches 1 --compile-batches 1 --profile-batches "" --budget-s 80 --out $work/step_one_row.json 2>&1 \
  | grep -v "^W\|Warning" | tail -12
stop_tarring $work
