#!/usr/bin/env bash
# One device call (~9 minutes on a fresh machine), written after run 22 (bench/NOTES.md "The next device call, in
# order (written after run 22)", item 1): prompt holds on and off, alternated on three servers of one compile cache,
# at 300 and 384 steady streams, end to end with real WebSocket clients. Run 22 (four calls, one server each way per
# call) had p95 first audio at 300 198-251 ms with holds (the default) against 159-187 ms without, no underruns
# either way, but 7 % of requests underran at 384 without holds (0 % with, call 1) and 12-34 % at 300:low; the
# servers of one configuration differed by ~50 ms of p95 between calls, so this alternates within one call.
#   servers: 1. defaults (--prefill-hold-below-s 0.1, --prefill-hold-max-s 0.25)  2. --prefill-hold-below-s off
#            3. defaults again                                                     (VARIANTS / FIRST_SERVE_ARGS)
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_first_audio_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
# Run 24: VARIANTS="--prefill-hold-at-risk on;--prefill-hold-below-s off;--prefill-hold-at-risk on" (holds only for a
# stream that would run dry before its next audio), E2E_LIMIT_S=540; its warm servers' startup_compile_* (ready.txt)
# also check that a warm start no longer re-tunes the one-row step's kernels.
# (--prefill-hold-at-risk was removed after run 24.) Next: VARIANTS="--prefill-hold-for low;--prefill-hold-below-s off;
# --prefill-hold-for low" with LEVELS including 300:low (holds only for latency-low streams, against none).
# Run 28: VARIANTS="--pace-lead-s off;default" LEVELS="300 384" WARM_LEVELS="300 384": pacing (default 1.5 s)
# against off; the first server runs the defaults.
# Run 29: FIRST_SERVE_ARGS="--prefill-hold-for low" LEVELS=300 VARIANTS="--prefill-hold-for all;--prefill-hold-for low"
# WARM_LEVELS="300 384 300:low": holds for latency-low streams only against holds for all, on more machines (run 28:
# p95 at 300 met <= 150 ms only on the machine where no turn held a prompt); start-up GC with each capture frozen.
# Run 29 call 2 measured catch-up steps (extra small-batch steps a turn for streams under 0.5 s ahead; removed after
# it): at 300 streams turns 18 -> 27 ms, p95 first audio 152 -> 963-1119 ms, 8-9 % underran.
# Run 29 call 3: FIRST_SERVE_ARGS="" LEVELS=300 VARIANTS="--prefill-hold-for all;default" WARM_LEVELS="300 384".
# Run 22's calls 2-3 ran earlier versions of this script (at 9d2ca48 and 6185f9e: first chunks, then the chunks of
# nearly dry clients, vocoded in the turn that completed them; both measured worse and were removed).
# FIRST_SERVE_ARGS go to every server, the warm restarts too (VARIANTS add to them): to compare a flag, give each
# variant its value. Run 30 call 3 ran FIRST_SERVE_ARGS="--admission-turn-fraction 0.65" LEVELS=384
# VARIANTS="default;--admission-turn-fraction 0.65" WARM_LEVELS="384 300" SKIP_GPU_TEST=1, meant as 0.65 against the
# bench's 0.9, so all three servers ran 0.65. The comparison: FIRST_SERVE_ARGS="" VARIANTS="--admission-turn-fraction
# 0.8;default" (the bench's 0.9).
set -u
OUT=${OUT:-/tmp/fishgate-first-audio}
source bench/device_call.sh
work=/tmp/first-audio
begin_call $work
# the device timing every level below prints (streaming/device_times.py, built after run 22): its GPU test first
[ -z "${SKIP_GPU_TEST:-}" ] && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/streaming/test_engine_gpu.py \
  -k device_times_add_up 2>&1 | tail -3 | tee $work/gpu_test.txt
OUT=$work SKIP_TESTS=1 LEVELS="${LEVELS:-300 384}" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 \
  WARM_CONC=16 GRAPH_WAIT_S=90 WARM_LEVELS="${WARM_LEVELS:-300 384}" PROFILE_LEVEL=none \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS ${FIRST_SERVE_ARGS:-}" \
  WARM_VARIANTS="${VARIANTS:---prefill-hold-below-s off;default}" \
  timeout "${E2E_LIMIT_S:-520}" bash bench/run_server_gpu.sh 2>&1 \
  | grep -E "$E2E_LINES" | grep -v "startup_" | head -40
cat $work/turns.txt 2>/dev/null | cut -c1-300
stop_tarring $work
