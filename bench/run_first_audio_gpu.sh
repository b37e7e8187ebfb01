#!/usr/bin/env bash
# One device call (~8 minutes on a fresh machine), written after run 22 (bench/NOTES.md "The next device call, in
# order (written after run 22)", item 1): prompt holds, end to end with real WebSocket clients at 300, 300:low (Fish
# `latency: low`) and 384 steady streams, on two servers of one compile cache:
#   1. --prefill-hold-predicted on (hold only for a client under 0.1 s whose next chunk would come too late; built
#      after run 22, CPU-tested);
#   2. the defaults (hold for any client under 0.1 s, at most 0.25 s at a time).
# Run 22 had, with plain holds / without holds: 300 p95 first audio 198-251 / 159-187 ms, 0 / 0-1 requests underran;
# 384 0 % / 7 % underran; 300:low 0.3-2.2 % / 12-34 %. Predicted holds should keep the first column's underruns and
# the second's first audio at 300 (turns holding prompts ~0 there; the worker's prompt part ~13 ms, not 25-31).
# The servers of one configuration differed by up to ~60 ms of p95 between calls: compare within the call.
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_first_audio_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
# Run 22's calls 2-3 ran earlier versions of this script (at 9d2ca48 and 6185f9e: first chunks, then the chunks of
# nearly dry clients, vocoded in the turn that completed them; both measured worse and were removed).
set -u
OUT=${OUT:-/tmp/fishgate-first-audio}
source bench/device_call.sh
device_env
work=/tmp/first-audio
keep_tarring $work
python3 -m bench.make_checkpoint /tmp/ckpt /tmp/refs > /dev/null
OUT=$work SKIP_TESTS=1 LEVELS="${LEVELS:-300 300:low 384}" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 \
  WARM_CONC=16 GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300 300:low 384}" PROFILE_LEVEL=none \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS ${FIRST_SERVE_ARGS:---prefill-hold-predicted on}" \
  WARM_VARIANTS="${VARIANTS:-default}" \
  timeout "${E2E_LIMIT_S:-520}" bash bench/run_server_gpu.sh 2>&1 \
  | grep -E "$E2E_LINES" | grep -v "startup_" | head -40
cat $work/turns.txt 2>/dev/null | cut -c1-300
stop_tarring $work
