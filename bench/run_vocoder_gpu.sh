#!/usr/bin/env bash
# One device call: the GPU tests (compiled step and vocoder regions among them), then bench/vocoder_variants.py
# (the graph-captured vocoder with and without torch.compile). Usage on the GPU machine, repo root, wheels in .whl
# (bench/NOTES.md; carry [".whl"]):   FISHGATE_COMMIT=<sha> bash bench/run_vocoder_gpu.sh     (results under $OUT)
# The end-to-end figure: SERVE_ARGS="--compile-vocoder on" bash bench/run_server_gpu.sh
set -u
OUT=${OUT:-/tmp/fishgate-vocoder-bench}
mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fishgate-inductor}
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
stamp "gpu tests"
timeout 240 python3 -m pytest tests/model/test_gpu.py tests/model/test_vocoder_stream.py tests/streaming/test_engine_gpu.py \
  -m gpu -q -p no:cacheprovider 2>&1 | tail -8
stamp "vocoder variants"
timeout 300 python3 -m bench.vocoder_variants --out "$OUT/vocoder_variants.json" 2>&1 | tail -12
stamp "done"
