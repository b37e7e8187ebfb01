#!/usr/bin/env bash
# One device call (~7 minutes; bench/NOTES.md "The next device call, in order (written after run 18)", items 1 and 3):
#   1. GPU tests of the length-aware decode attention kernel (model/decode_attention.py): against SDPA in fp32 and
#      bf16 at full-size shapes, and the compiled graph step with it against the eager step;
#   2. the decode step with and without it: `bench.step_variants --variants compiled,compiled_length,
#      compiled_length_4096` at 1, 64, 256 and 384 rows (positions 1,000-1,900, attention bucket 2,048; the last over
#      a 4,096-position cache, the engine's one decode length with the kernel on), a kernel profile of each at 384;
#   3. static prefill passes by rows bucket (`bench.prefill_passes`: rows 1-8 × chunks 64/256 × lengths 1,024/2,048):
#      whether a pass's time is set by its kernels (flat in rows: a rows bucket of 8 would halve burst prefill);
#   4. the engine GPU tests (tests/streaming/test_engine_gpu.py), last run before the eighth session's changes
#      (SKIP_ENGINE_TESTS=1 leaves them out: with three step variants the call runs ~8 minutes without them).
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_length_attention_gpu.sh
# Everything lands in $OUT/all.tgz.
set -u
OUT=${OUT:-/tmp/fishgate-length-attention}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
work=/tmp/length-attention
mkdir -p $work
timeout 150 python3 -m pytest -q -s tests/model/test_gpu.py -k "length_attention" -p no:cacheprovider -rf \
  --tb=short > $work/gpu_tests.txt 2>&1
save() { tar czf "$OUT/all.tgz" -C $work .; }
save
grep -E "rel err|passed|failed|Error" $work/gpu_tests.txt | head -20
timeout 370 python3 -m bench.step_variants --variants compiled,compiled_length,compiled_length_4096 \
  --batches 1,64,256,384 --compile-batches 1,64,256,384 --profile-batches 384 --budget-s 330 \
  --out $work/step.json > $work/step.txt 2>&1
grep -E "batch [0-9]+:|by family|^ +(variant|compiled)" $work/step.txt | head -40
save
timeout 90 python3 -m bench.prefill_passes --out $work/prefill_passes.json > $work/prefill_passes.txt 2>&1
tail -17 $work/prefill_passes.txt
save
if [ "${SKIP_ENGINE_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -q -s tests/streaming/test_engine_gpu.py -p no:cacheprovider -rf --tb=short \
    > $work/engine_tests.txt 2>&1
  grep -E "identical|passed|failed" $work/engine_tests.txt | tail -6
fi
tar czf "$OUT/all.tgz" -C $work .
