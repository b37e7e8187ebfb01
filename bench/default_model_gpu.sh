#!/usr/bin/env bash
# The shipped default voice (model/default_model) on the H200: `fishgate serve` with no --checkpoint, then
# `fishgate ttfa` (built-in English corpus, real WebSocket clients) at a few concurrency levels. Prints the ttfa
# table (first audio, underruns, real-time factor) and the engine's ready line; ttfa.json goes under $OUT.
#   OUT=/tmp/default-gpu LEVELS="1,8,64" bash bench/default_model_gpu.sh   (wheels installed as in run_server_gpu.sh)
set -u
OUT=${OUT:-/tmp/fishgate-default-gpu}
PORT=${PORT:-7870}
mkdir -p "$OUT"
python3 -m server.cli serve --device "${DEVICE:-cuda}" --port "$PORT" --max-sessions "${MAX_SESSIONS:-128}" \
  --rate-limit-per-min 1000000 ${SERVE_ARGS:-} --log-level warning > "$OUT/server.log" 2>&1 &
SERVER=$!
t0=$(date +%s)
for i in $(seq 1 240); do
  curl -sf "localhost:$PORT/readyz" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 1
done
echo "== ready after $(( $(date +%s) - t0 )) s"
curl -s "localhost:$PORT/healthz"; echo
TTFA="python3 -m server.cli ttfa ws://127.0.0.1:$PORT/v1/tts/live --no-plots --timeout-s 120"
timeout 60 $TTFA --concurrency 8 --requests 8 --out /tmp/default_warm > /dev/null 2>&1  # graphs of the first shapes
timeout "${TTFA_TIMEOUT_S:-200}" $TTFA --concurrency "${LEVELS:-1,8,64}" --requests "${REQUESTS:-64}" --out "$OUT" 2>&1 | tail -8
kill -TERM $SERVER; wait $SERVER
grep -E "engine ready|ERROR|CRITICAL" "$OUT/server.log" | head -10
