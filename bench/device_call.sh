# Sourced by the bench/run_*_gpu.sh device calls (repo root, wheels in .whl, carried with carry [".whl"]):
#   begin_call WORK       device_env, then keep_tarring WORK: how every call starts
#   device_env            installs the carried wheels into /tmp/site and puts them first on PYTHONPATH and PATH
#   keep_tarring WORK     from now on, every 20 s, WORK's files as $OUT/all.tgz (a call cut short returns them)
#   stop_tarring WORK     the last, complete all.tgz
#   THROUGHPUT_SERVE_ARGS the end-to-end runs' server settings since run 19 (every bucket compiled, half-step vocoder
#                         buckets, channels-last vocoder, real-time admission at 0.9, a compile cache in the repo)
#   E2E_LINES             grep -E pattern of bench/run_server_gpu.sh's summary lines (ttfa rows, turn split, starts)
E2E_LINES='^\| [0-9]|level [0-9]+:|warm start|start →|ready:'
THROUGHPUT_SERVE_ARGS="--compile-max-batch 512 --compile-tune-single-row off --vocoder-half-step-buckets on
  --admission-turn-fraction 0.9 --compile-cache-dir build/cc --vocoder-channels-last on"
device_env() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
  # the machine's packages carry no bytecode (their folders are writable, so likely PYTHONDONTWRITEBYTECODE): every process
  # compiled torch's compiler stack from source again, 6.4-7.5 s of each server start (run 23, call 2); a normal
  # install has the bytecode
  export PYTHONPYCACHEPREFIX=/tmp/pycache
  unset PYTHONDONTWRITEBYTECODE
}
begin_call() {
  device_env
  keep_tarring "$1"
}
keep_tarring() {
  mkdir -p "$OUT" "$1"
  (while sleep 20; do tar czf "$OUT/all.tgz" -C "$1" . 2>/dev/null; done) &
  TARRING_PID=$!
}
stop_tarring() {
  kill "$TARRING_PID" 2>/dev/null
  tar czf "$OUT/all.tgz" -C "$1" .
}
