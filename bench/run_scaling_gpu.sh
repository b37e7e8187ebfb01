#!/usr/bin/env bash
# One device call (~6-8 minutes on a fresh machine): throughput against batch, vocoder included (issue 3's sweep and
# plot; the last sweep was runs 1-6's, before the step got 4x faster at small batch). In one call:
#   1. bench.step_variants: the engine's step as the throughput servers run it (compiled_length_4096: every bucket
#      compiled, the length-aware attention over a 4,096-position cache) and the plain captured step (eager: the
#      anchor's yardstick, ANCHORS §1), both at batches BATCHES, rows at positions 1,000-1,900
#   2. bench.vocoder_variants: the captured vocoder as every server runs it (graph+cl+cf+fuse: channels-last, the
#      one conv shape cuDNN's heuristic handles badly channels-first, biases folded; `--vocoder-channels-last on`,
#      the default) at 1-64 rows × 24 frames (the chunk size of steady streaming) and 1 × 8 (the first chunk).
#      Run 31 call 1 ran graph+cl, which leaves that conv channels-last: 199-213 ms at 32-64 rows (run 16's
#      pathological shape), so call 2 ran the vocoder again (SKIP_STEP=1) and bench.scaling combined the two calls
#   3. bench.scaling: both combined into the turn at each batch (step + the vocoder work it carries), the table
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_scaling_gpu.sh
# Everything lands in $OUT/all.tgz (written every 20 s, so a call cut short still returns what it had).
set -u
OUT=${OUT:-/tmp/fishgate-scaling}
source bench/device_call.sh
work=/tmp/scaling
begin_call $work
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/gpu.txt"
BATCHES=${BATCHES:-1,8,32,64,128,256,512,1024}
[ -z "${SKIP_STEP:-}" ] && timeout "${STEP_TIMEOUT_S:-400}" python -m bench.step_variants --variants "${STEP_VARIANTS:-eager,compiled_length_4096}" \
  --batches "$BATCHES" --compile-batches "$BATCHES" --profile-batches "${PROFILE_BATCHES:-256}" \
  --out "$work/step.json" --budget-s "${STEP_BUDGET_S:-330}" 2>&1 | tee "$work/step.log" | grep -v "^ *\[" | tail -24
timeout 150 python -m bench.vocoder_variants --variants "${VOCODER_VARIANT:-graph+cl+cf+fuse}" \
  --shapes "${VOCODER_SHAPES:-1x8,1x24,2x24,4x24,8x24,16x24,32x24,64x24}" --out "$work/vocoder.json" 2>&1 \
  | tee "$work/vocoder.log" | tail -10
[ -s "$work/step.json" ] && python -m bench.scaling "$work/step.json" "$work/vocoder.json" --out "$work/scaling.json" 2>&1 | tee "$work/scaling.txt"
stop_tarring $work
