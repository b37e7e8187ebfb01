#!/usr/bin/env bash
# One device call (~9 minutes on a fresh machine), written after run 21 (bench/NOTES.md "The next device call, in
# order (written after run 21)", items 1-3):
#   1. where the DualAR's 4-8 s load goes (bench/load_weights.py: the engine's split, a per-tensor copy, one pinned
#      bulk copy), ~1 min;
#   2. end to end with the vocoder beside the step (the default since run 21): a first server at 300 and 300:low
#      (Fish `latency: low`, a 2-frame first chunk), then a warm restart with --prefill-max-rows 8 at 300 and 384,
#      py-spy on the server through 8 s of the 384 level's steady state (what a loaded turn's 5-8 ms of "prefill" is).
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_low_latency_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-low-latency}
source bench/device_call.sh
work=/tmp/low-latency
begin_call $work
python3 -m bench.make_checkpoint /tmp/ckpt /tmp/refs > /dev/null
timeout 90 python3 -m bench.load_weights /tmp/ckpt --out $work/load_weights.json 2>&1 | tee $work/load_weights.txt
OUT=$work SKIP_TESTS=1 LEVELS="${LEVELS:-300 300:low}" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 \
  WARM_CONC=16 GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300 384}" \
  PROFILE_LEVEL=none WARM_PROFILE_LEVEL="${PROFILE_LEVEL:-384}" PROFILE_AFTER_S=8 PROFILE_S=8 \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS" \
  WARM_VARIANTS="${WARM_VARIANTS:---prefill-max-rows 8}" \
  timeout "${E2E_LIMIT_S:-450}" bash bench/run_server_gpu.sh 2>&1 \
  | grep -E "$E2E_LINES|dual_ar" | head -40
cat $work/turns.txt 2>/dev/null | cut -c1-300
head -40 $work/spy_384_summary.txt 2>/dev/null
stop_tarring $work
