#!/usr/bin/env bash
# BATCHES (default 1): the buckets to time (the one-row one traced); run 26 call 5: 1,4,8 (gemv's few-row kernels).
# Run 27 call 2: BATCHES=1,4,8 VARIANTS=engine_tuned_gemv_pdl,engine_tuned_gemv,engine_tuned_gemv8_pdl
#   TESTS='programmatic or gemv or compiled_step_equals_eager or tuned_one_row' (programmatic dependent launch).
# Run 26: GEMV_SWEEP=<seconds> first measures model.gemv's launch configs (bench/gemv_sweep.py) and hands them to the
# step variants (engine_tuned_gemv). Run 25: the tuned one-row decode step's kernels in launch order (grid, block, gaps) and inductor's generated code
# for it (call 1 also timed the same step tuned with coordinate descent in every direction: VARIANTS=...), then the
# GPU tests named by TESTS (a pytest -k expression; none if empty). Device call:
#   run(command="TESTS='small_sort or length_attention' bash bench/run_step_anatomy_gpu.sh", carry=[".whl"])
# VARIANTS: one-row variants (traced and profiled); LARGE_VARIANTS at LARGE_BATCHES (default 64,256), untraced.
# Results under $OUT: all.tgz (step.json, step.log, traces/*.json and their *.txt sequences, code/*.py, tests.txt).
set -u
source bench/device_call.sh
work=/tmp/anatomy
begin_call "$work"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/gpu.txt"
VARIANTS=${VARIANTS:-engine_tuned_length_4096}
gemv_args=()
if [ -n "${GEMV_SWEEP:-}" ]; then  # run 26: model.gemv's configs measured first (GEMV_SWEEP = the sweep's budget, s)
  timeout $((GEMV_SWEEP + 90)) python -m bench.gemv_sweep --out "$work/gemv_sweep.json" --budget-s "$GEMV_SWEEP" 2>&1 \
    | tee "$work/gemv_sweep.log" | tail -8
  [ -s "$work/gemv_sweep.json" ] && gemv_args=(--gemv-configs "$work/gemv_sweep.json")
fi
timeout "${STEP_TIMEOUT_S:-480}" python -m bench.step_variants --variants "$VARIANTS" --batches "${BATCHES:-1}" \
  --compile-batches "${BATCHES:-1}" --trace-dir "$work/traces" --code-dir "$work/code" --out "$work/step.json" \
  --budget-s "${STEP_BUDGET_S:-400}" "${gemv_args[@]}" 2>&1 \
  | tee "$work/step.log" | grep -v "^ *\[" | tail -40
if [ -n "${LARGE_VARIANTS:-}" ]; then  # static-compiled larger buckets (no tuning), one process per call
  timeout 300 python -m bench.step_variants --variants "$LARGE_VARIANTS" --batches "${LARGE_BATCHES:-64,256}" \
    --compile-batches "${LARGE_BATCHES:-64,256}" --profile-batches "" --out "$work/step_large.json" --budget-s 240 2>&1 \
    | tee "$work/step_large.log" | grep -v "^ *\[" | tail -12
fi
for t in "$work"/traces/*.json; do
  python -m bench.step_anatomy "$t" --first 400 > "${t%.json}.txt" 2>&1
  head -1 "${t%.json}.txt"
done
if [ -n "${TESTS:-}" ]; then
  timeout 240 python -m pytest -q -x tests/model/test_gpu.py -k "$TESTS" -p no:cacheprovider > "$work/tests.txt" 2>&1
  tail -5 "$work/tests.txt"
fi
stop_tarring "$work"
