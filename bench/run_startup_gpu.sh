#!/usr/bin/env bash
# One device call (~7 minutes on a fresh machine), written in run 23: where a server start goes, process start to
# ready, for the default configuration (compiled buckets up to 8 rows, tuned one-row step) and two shorter ones,
# each py-spied (bench/spy_summary.py --startup). Run 23's call 2 found a quarter of a warm start compiling Python
# source (6.4-7.5 s): the GPU machine's packages carry no bytecode and none was written (call 3: folders writable), so every
# process compiled torch's compiler stack again; device_env now points PYTHONPYCACHEPREFIX at a writable folder, as
# a normal install (pip writes bytecode at install time) would have it.
#   servers: 1. defaults on an empty compile cache (then idle until every graph is captured, filling the cache)
#            2.-4. warm restarts: defaults, --graphs-up-front 1, --compile-symbolic-batch-above 1   (VARIANTS)
#   each warm restart: start-up by phase, then 8 requests at level 1 right after ready (what a first client meets)
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_startup_gpu.sh
# After run 29: VARIANTS="default;--compile-after-ready on;--compile-after-ready on" (ready before any compile; the
# compiled graphs replace the uncompiled ones in idle time), after `pytest tests/model/test_gpu.py -k deferred`
# (GPU_TESTS_K=deferred); WARM_AFTER_GRAPHS=1 times each warm server's idle captures and runs level 1 again after them.
set -u
OUT=${OUT:-/tmp/fishgate-startup}
source bench/device_call.sh
work=/tmp/startup
begin_call $work
python3 - <<'PY' | tee $work/env.txt
import os, sys, torch
d = os.path.dirname(torch.__file__)
cached = os.path.isdir(os.path.join(d, "_dynamo", "__pycache__"))
print(f"torch {torch.__version__} at {d}: folder writable {os.access(d, os.W_OK)}, torch._dynamo bytecode cached "
      f"{cached}, dont_write_bytecode {sys.flags.dont_write_bytecode}, pycache_prefix {sys.pycache_prefix}")
PY
if [ -n "${GPU_TESTS_K:-}" ]; then  # GPU tests first (pytest -k), e.g. GPU_TESTS_K=deferred
  timeout "${GPU_TESTS_LIMIT_S:-150}" python3 -m pytest tests/model/test_gpu.py tests/streaming/test_engine_gpu.py \
    -k "$GPU_TESTS_K" -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $work/gpu_test.txt | tail -15
fi
OUT=$work SKIP_TESTS=1 LEVELS="" STARTUP_SPY=1 WARM_CONC=16 GRAPH_WAIT_S="${GRAPH_WAIT_S:-90}" READY_LIMIT_S=240 \
  SERVE_ARGS="--compile-cache-dir build/cc ${STARTUP_SERVE_ARGS:-}" \
  WARM_VARIANTS="${VARIANTS:-default;--graphs-up-front 1;--compile-symbolic-batch-above 1}" \
  timeout "${STARTUP_LIMIT_S:-480}" bash bench/run_server_gpu.sh 2>&1 | grep -E "$E2E_LINES|startup_[a-z_]*\"|graphs|graph missing"
# run 24: did the warm starts find inductor's tuning results? (run 23's warm starts spent 7-10 s in coordinate-descent
# tuning.) The .best_config files in the cache, how many say found_by_coordesc, and the device torch's own reading
# of them (its autotune cache module and the tuner's entry point, copied out to be read on the CPU machine)
WORK=$work python3 - <<'PY' | tee $work/autotune_cache.txt
import glob, json, os, shutil, torch
files = glob.glob("build/cc/**/*.best_config", recursive=True)
coordesc = sum(bool(json.load(open(f)).get("found_by_coordesc")) for f in files)
print(f"{len(files)} .best_config files in build/cc, {coordesc} found_by_coordesc; e.g. {files[:1]}")
if files:
    print(open(files[0]).read()[:400])
rt = os.path.join(os.path.dirname(torch.__file__), "_inductor", "runtime")
for name in ("autotune_cache.py", "triton_heuristics.py", "coordinate_descent_tuner.py"):
    shutil.copy(os.path.join(rt, name), os.path.join(os.environ.get("WORK", "."), "torch_" + name))
PY
for f in $work/spy_start_*_summary.txt; do echo "== $f"; head -14 "$f"; done
stop_tarring $work
