#!/usr/bin/env bash
# One device call: GPU tests, then the whole gateway end to end on the H200 — `fishgate serve` on a full-size
# random-weight Fish 1.5 checkpoint (bf16, CUDA graphs) and `fishgate ttfa` with real WebSocket clients at several
# concurrency levels (a ~650-frame stored voice puts streams at positions 1,000-2,000; lengths fixed by
# max_new_tokens). Usage on the GPU machine, repo root, wheels in .whl (see bench/NOTES.md):
#   bash bench/run_server_gpu.sh          (results under $OUT)
#   WAVES=3 RAMP_S=9 LEVELS="128 256 384" LEVEL_TIMEOUT_S=240 bash bench/run_server_gpu.sh   (a steady load: each
#   client sends 3 requests one after another, first requests spread over 9 s — see docs/BENCHMARKS.md "Steady load")
#   SERVE_ARGS="--graph-first-frames on" bash bench/run_server_gpu.sh   (extra `fishgate serve` flags)
#   LEVELS="300 300:low" bash bench/run_server_gpu.sh   (a level is a concurrency, or concurrency:latency for the
#   clients' Fish latency mode)
#   TTFA_ARGS="--compression off --sockets per-request" ...   (extra flags for every `fishgate ttfa` of the run; the
#   client offers deflate and reuses each worker's socket by default, see docs/ttfa.md)
#   LEVELS="300 300@bare" CLIENT_bare="--compression off --sockets per-request" ...   (concurrency[:latency]@name adds
#   $CLIENT_name's flags to that level's clients; its files are tagged _name)
#   LEVEL_START_LIMIT_S=420 ...   (start a level only while this many seconds have passed since the script began)
#   SERVE_ARGS="--compile-cache-dir build/cc" WARM_RESTART=1 bash bench/run_server_gpu.sh   (after the levels, start
#   the server again on the now warm cache: the warm start-up figure, then one level-1 pass; WARM_SERVE_ARGS adds
#   flags to that start and WARM_LEVELS runs more levels on it; WARM_VARIANTS="default;--flag x" restarts once per
#   variant, see the end of this file)
#   STARTUP_SPY=1 ...   (py-spy every server from its process start to ready: spy_start_<log>.txt and its summary, the
#   samples by start-up part — bench/spy_summary.py --startup)
set -u
OUT=${OUT:-/tmp/fishgate-server-bench}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # py-spy's binary, if carried
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  stamp "gpu tests"
  timeout 150 python3 -m pytest tests/model/test_gpu.py tests/streaming/test_engine_gpu.py -q -s -p no:cacheprovider -rf --tb=short 2>&1 | tee "$OUT/gpu_tests.txt" | tail -30
fi
stamp "checkpoint"
python3 -m bench.make_checkpoint /tmp/ckpt /tmp/refs
python3 - > /tmp/texts.txt <<'PY'
import random
random.seed(0)
words = "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills near the river".split()
for i in range(2000):
    print(f"Request {i}: " + " ".join(random.choice(words) for _ in range(14)) + ".")
PY
serve() {
python3 -m server.cli serve --checkpoint /tmp/ckpt --references-dir /tmp/refs --device cuda \
  --max-sessions "${MAX_SESSIONS:-512}" --max-seq-len "${MAX_SEQ_LEN:-4096}" --rate-limit-per-min 1000000 \
  ${GRAPHS_UP_FRONT:+--graphs-up-front $GRAPHS_UP_FRONT} ${SERVE_ARGS:-} $2 --log-level warning > "$OUT/$1" 2>&1 &
SERVER=$!
local i  # the loop below counts seconds; the warm restarts' own counter is also called i
if [ -n "${STARTUP_SPY:-}" ] && command -v py-spy >/dev/null; then  # where the start goes, process start to ready
  py-spy record -p $SERVER -r 100 --threads --format raw -o "$OUT/spy_start_$1.txt" --nonblocking > /dev/null 2>&1 &
  STARTUP_SPY_PID=$!
fi
for i in $(seq 1 "${READY_LIMIT_S:-300}"); do
  if curl -sf localhost:7860/readyz >/dev/null; then
    [ -n "${STARTUP_SPY_PID:-}" ] && { kill -INT $STARTUP_SPY_PID; wait $STARTUP_SPY_PID; STARTUP_SPY_PID=""
      python3 bench/spy_summary.py "$OUT/spy_start_$1.txt" --seconds "$i" --rate 100 --top "${STARTUP_SPY_TOP:-25}" \
        --startup > "$OUT/spy_start_$1_summary.txt"; }
    return 0
  fi
  kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/$1"; exit 1; }
  sleep 1
done
echo "not ready after ${READY_LIMIT_S:-300} s"; tail -30 "$OUT/$1"; kill -TERM $SERVER; exit 1
}
stamp "serve"
ts=$(date +%s); serve server.log ""; echo "start → ready: $(( $(date +%s) - ts )) s" | tee -a "$OUT/ready.txt"
# the engine's share of it by phase (the server runs at --log-level warning, so its "engine ready" line is not logged)
curl -s localhost:7860/metrics | grep -oE 'startup_[a-z_]*"} [0-9.]+' | tee -a "$OUT/ready.txt"
stamp "ready"
curl -s localhost:7860/healthz; echo
TTFA="python3 -m server.cli ttfa --reference-id bench-voice --texts /tmp/texts.txt --no-plots --timeout-s 240 ${TTFA_ARGS:-}"
stamp "warm-up"
timeout 120 $TTFA --concurrency "${WARM_CONC:-256}" --requests "${WARM_CONC:-256}" --max-new-tokens 80 --out /tmp/warm 2>&1 | tail -4
wait_for_graphs() {  # idle until every graph is captured (fishgate_engine{what="graphs_missing"} 0), at most 150 s
  local i
  for i in $(seq 1 "${GRAPH_WAIT_S:-150}"); do
    left=$(curl -s localhost:7860/metrics | sed -n 's/^fishgate_engine{what="graphs_missing"} \([0-9.]*\)$/\1/p')
    [ "${left%.*}" = "0" ] && { echo "all graphs captured after $i s idle"; return 0; }
    sleep 1
  done
  echo "graphs still missing after ${GRAPH_WAIT_S:-150} s: $left"
}
GRAPH_WAIT_S=${COLD_GRAPH_WAIT_S:-${GRAPH_WAIT_S:-150}} wait_for_graphs  # the first server's wait: COLD_GRAPH_WAIT_S
run_level() {  # a level is concurrency[:latency][@client]: the clients' Fish latency mode (e.g. 300:low), and
  # extra `fishgate ttfa` flags for this level from $CLIENT_<client> (e.g. 300@bare, CLIENT_bare="--compression off")
  local spec=${1%%@*} client="" client_args=""
  case $1 in *@*) client=${1#*@}; local var="CLIENT_$client"
    [ -n "${!var+set}" ] || { echo "level $1: $var is not set"; return 0; }
    client_args=${!var} ;; esac
  level=${spec/:/_}${client:+_$client}
  conc=${spec%%:*}
  case $spec in *:*) latency="--latency ${spec#*:}" ;; *) latency="" ;; esac
  n=$(( conc * ${WAVES:-1} < 8 ? 8 : conc * ${WAVES:-1} ))
  if [ -n "${LEVEL_START_LIMIT_S:-}" ] && [ $(( $(date +%s) - t0 )) -gt "$LEVEL_START_LIMIT_S" ]; then
    stamp "level $level skipped (past LEVEL_START_LIMIT_S=$LEVEL_START_LIMIT_S)"; return 0
  fi
  stamp "level $level"
  curl -s localhost:7860/metrics > "/tmp/metrics_before_$level.txt"
  if [ "$level" = "${PROFILE_LEVEL:-256}" ] && command -v py-spy >/dev/null; then
    # where the server's threads spend the level's steady state (py-spy samples running threads only)
    (sleep "${PROFILE_AFTER_S:-25}"; py-spy record -p $SERVER -d "${PROFILE_S:-20}" -r 100 --threads --format raw \
      -o "$OUT/spy_$level.txt" --nonblocking > /dev/null 2>&1) &
  fi
  # the admission's gauges and each half second's turns through the level (bench/metrics_series.py)
  python3 -m bench.metrics_series http://127.0.0.1:7860/metrics --out "$OUT/series_${TAG:-}$level.jsonl" &
  SAMPLER=$!
  timeout "${LEVEL_TIMEOUT_S:-200}" $TTFA --concurrency $conc --requests $n --ramp-s "${RAMP_S:-0}" $latency \
    --max-new-tokens "${FRAMES:-200}" $client_args --out "/tmp/ttfa_$level" 2>&1 | tail -5
  kill -TERM $SAMPLER; wait $SAMPLER
  python3 -m bench.metrics_series --table "$OUT/series_${TAG:-}$level.jsonl" > "$OUT/series_${TAG:-}${level}_table.txt"
  cp "/tmp/ttfa_$level/ttfa.json" "$OUT/ttfa_${TAG:-}$level.json" 2>/dev/null
  curl -s localhost:7860/metrics > "/tmp/metrics_after_$level.txt"
  python3 bench/turn_attribution.py "/tmp/metrics_before_$level.txt" "/tmp/metrics_after_$level.txt" --level "$level" \
    | tee -a "$OUT/turns.txt"
  cp "/tmp/metrics_after_$level.txt" "$OUT/metrics_${TAG:-}$level.txt"
  grep -E 'what="(slow_turns|turn_max_seconds|gc_[a-z_]*|admission_[a-z]*|vocode_rerouted_calls|decode_routed_steps|graphs_captured|prefill_eager_calls)"' "/tmp/metrics_after_$level.txt" \
    | sed 's/^fishgate_engine{what="\([a-z_]*\)"} /  \1 /' | tr '\n' ' ' | tee -a "$OUT/turns.txt"; echo | tee -a "$OUT/turns.txt"
  if [ -f "$OUT/spy_$level.txt" ]; then
    python3 bench/spy_summary.py "$OUT/spy_$level.txt" --seconds "${PROFILE_S:-20}" --rate 100 --top 10 \
      | tee "$OUT/spy_${level}_summary.txt" | head -60
  fi
}
# LEVELS="" runs no level (start-up and warm restarts only)
for level in ${LEVELS-1 64 256 384 512}; do run_level $level; done
stamp "done"
kill -TERM $SERVER; wait $SERVER
grep -E "engine ready|ERROR|CRITICAL|slow turn|garbage collection" "$OUT/server.log" | head -30
# Warm restarts: WARM_RESTART=1 starts once more with WARM_SERVE_ARGS; WARM_VARIANTS="default;--flag a;--flag b"
# starts once per variant (";"-separated extra flags, "default" for none), each on the cache the first server wrote:
# its start-up by phase, 8 requests at level 1 right after ready (what a first client meets), with WARM_AFTER_GRAPHS=1
# the seconds until no graph is missing and 8 more requests then, then WARM_LEVELS (after the idle captures finish,
# unless WARM_NO_GRAPH_WAIT=1).
variants=${WARM_VARIANTS:-}
[ -z "$variants" ] && [ -n "${WARM_RESTART:-}" ] && variants=${WARM_SERVE_ARGS:-default}
level1_requests() {  # 8 requests at level 1, one after another (what a first client meets): $OUT/ttfa_$1.json
  timeout 60 $TTFA --concurrency 1 --requests 8 --max-new-tokens "${FRAMES:-200}" --out "/tmp/ttfa_$1" 2>&1 | tail -3
  cp "/tmp/ttfa_$1/ttfa.json" "$OUT/ttfa_$1.json" 2>/dev/null
}
i=0
IFS=';' read -ra variant_list <<< "$variants"
for variant in ${variant_list[@]+"${variant_list[@]}"}; do
  [ "$variant" = default ] && variant=""
  i=$((i + 1)); tag=$([ $i = 1 ] && echo warm || echo "warm$i")
  stamp "warm restart $i ($variant)"
  ts=$(date +%s); serve "server_$tag.log" "$variant"
  echo "warm start → ready: $(( $(date +%s) - ts )) s ($variant)" | tee -a "$OUT/ready.txt"
  curl -s localhost:7860/metrics | grep -oE 'startup_[a-z_]*"} [0-9.]+' | tee -a "$OUT/ready.txt"
  level1_requests "${tag}_1"
  if [ -n "${WARM_AFTER_GRAPHS:-}" ]; then  # the idle captures' time to finish, then level 1 on every graph in place
    ts=$(date +%s); wait_for_graphs; echo "ready → no graph missing: $(( $(date +%s) - ts )) s ($variant)" | tee -a "$OUT/ready.txt"
    level1_requests "${tag}_1_after_graphs"
  fi
  [ -n "${WARM_LEVELS:-}" ] && [ -z "${WARM_NO_GRAPH_WAIT:-}" ] && wait_for_graphs
  PROFILE_LEVEL=${WARM_PROFILE_LEVEL:-none} TAG=${tag}_  # py-spy on a warm server: WARM_PROFILE_LEVEL
  for level in ${WARM_LEVELS:-}; do echo "(warm server $i: $variant)" >> "$OUT/turns.txt"; run_level $level; done
  kill -TERM $SERVER; wait $SERVER
  grep -E "engine ready|ERROR|CRITICAL" "$OUT/server_$tag.log" | head -20
done
