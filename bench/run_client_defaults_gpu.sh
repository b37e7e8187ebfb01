#!/usr/bin/env bash
# One device call (~5-7 minutes on a fresh machine, under 9.5 at most): the server under clients that connect as
# real voice-agent clients do (browsers, websockets and pipecat offer permessage-deflate; LiveKit's Fish plugin pools
# one socket per client across turns; docs/ttfa.md), against the bare client every earlier benchmark used. One
# server with the end-to-end throughput settings (THROUGHPUT_SERVE_ARGS, bench/device_call.sh: the README's "many
# concurrent streams" settings), 300 steady streams (WAVES=2 RAMP_S=9: each client sends 2 requests one after
# another, the first ones spread over 9 s):
#   300       `fishgate ttfa` defaults: permessage-deflate offered, each worker's 2 requests on one socket
#   300_bare  --compression off --sockets per-request (the bare client: no extension offered, a socket per request)
#   500       the defaults at 500 streams, only while the call has time left (WITH_500=0 leaves it out)
# then a table per variant (served, first audio p50/p95, underruns, real-time factor, connections and reconnects;
# bench/client_variants.py) and its JSON in $OUT/client_variants.json, the ttfa JSON files in $OUT/all.tgz.
# Usage on the GPU machine, repo root, wheels in .whl (carry [".whl"]):   bash bench/run_client_defaults_gpu.sh
# EXTRA_SERVE_ARGS="--ws-compression on" measures a server that accepts the deflate the clients offer.
# Time plan: ready ~85-170 s on an empty compile cache (runs 17-31), a steady 300 level ~20-25 s (run 18). Each
# request gives up after 30 s (and 10 s more to close a failed socket), so a level ends within 9 + 2 x 40 s and
# writes its JSON (LEVEL_TIMEOUT_S=100 backs that up); no level starts after 400 s of the server script, and that
# script is stopped at 540 s.
set -u
OUT=${OUT:-/tmp/fishgate-client-defaults}
source bench/device_call.sh
work=/tmp/client-defaults
begin_call $work
levels="300 300@bare"
[ "${WITH_500:-1}" = 1 ] && levels="$levels 500"
OUT=$work SKIP_TESTS=1 LEVELS="${LEVELS:-$levels}" WAVES=2 RAMP_S=9 LEVEL_TIMEOUT_S=100 READY_LIMIT_S=240 \
  WARM_CONC=16 GRAPH_WAIT_S=60 PROFILE_LEVEL=none LEVEL_START_LIMIT_S=400 \
  SERVE_ARGS="$THROUGHPUT_SERVE_ARGS ${EXTRA_SERVE_ARGS:-}" \
  TTFA_ARGS="--timeout-s 30" CLIENT_bare="--compression off --sockets per-request" \
  timeout "${E2E_LIMIT_S:-540}" bash bench/run_server_gpu.sh 2>&1 \
  | grep -E "$E2E_LINES|level [0-9]+_[a-z_]+:|^== level" | grep -v "startup_" | head -40
echo
python3 -m bench.client_variants $work/ttfa_300.json $work/ttfa_300_bare.json \
  $([ "${WITH_500:-1}" = 1 ] && echo $work/ttfa_500.json) --json "$OUT/client_variants.json"
cp "$OUT/client_variants.json" $work/ 2>/dev/null
stop_tarring $work
