#!/bin/sh
# Load run with wrk on loopback (not part of make test; needs the Debian package wrk).
#
#   bench/load.sh [SECONDS]
#
# Starts `twistd -n krafla` on the default model (SmolLM2-135M, pulled on first use), then runs:
#   1. GET /health, 32 connections;
#   2. a queue of short completions (2 tokens), 8 connections at once, the default --max-queue;
#   3. the same with 16 connections against a second server started with --max-queue 2, where
#      503s (with Retry-After) are asked for.
# Every request says Connection: close, as the server closes every connection anyway.
# Pass: runs 1 and 2 have no socket error and only 200s; run 3 has only 200s and 503s.
set -eu
cd "$(dirname "$0")/.."
SECONDS_PER_RUN=${1:-10}
PY=${PYTHON:-.venv/bin/python}
TWISTD=$(dirname "$PY")/twistd
command -v wrk >/dev/null || { echo "wrk is not installed: apt-get install -y wrk" >&2; exit 2; }
MODEL=$("$PY" -c 'from krafla_twisted import models; m = models.pull(models.DEFAULT_MODEL, progress=False); print(m.mlb, m.mlt)')
set -- $MODEL
MLB=$1 MLT=$2
WORK=$(mktemp -d)
PIDS=""
cleanup() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
  for pid in $PIDS; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

start() {  # start NAME ARGS...: a server on a free port; sets PORT
  name=$1; shift
  PYTHONPATH=. "$TWISTD" -n --pidfile= krafla "$MLB" -z "$MLT" --port 0 -t 2 --ctx 256 "$@" >"$WORK/$name.log" 2>&1 &
  PIDS="$PIDS $!"
  for _ in $(seq 600); do
    PORT=$(sed -n 's|.*# listening on http://127.0.0.1:\([0-9]*\)/v1.*|\1|p' "$WORK/$name.log")
    [ -n "$PORT" ] && return 0
    sleep 0.1
  done
  cat "$WORK/$name.log" >&2; exit 1
}

BODY='{"prompt": "1, 2, 3,", "max_tokens": 2}'
start main
echo "== GET /health, 32 connections, ${SECONDS_PER_RUN}s"
echo "wrk -t2 -c32 -d${SECONDS_PER_RUN}s -s bench/wrk/statuses.lua http://127.0.0.1:$PORT/health"
wrk -t2 -c32 -d"${SECONDS_PER_RUN}s" --timeout 10s -s bench/wrk/statuses.lua "http://127.0.0.1:$PORT/health"
echo "== POST /v1/completions (2 tokens), 8 connections, default --max-queue, ${SECONDS_PER_RUN}s"
echo "WRK_BODY='$BODY' wrk -t2 -c8 -d${SECONDS_PER_RUN}s -s bench/wrk/statuses.lua http://127.0.0.1:$PORT/v1/completions"
WRK_BODY=$BODY wrk -t2 -c8 -d"${SECONDS_PER_RUN}s" --timeout 30s -s bench/wrk/statuses.lua "http://127.0.0.1:$PORT/v1/completions"
start small --max-queue 2
echo "== POST /v1/completions (2 tokens), 16 connections, --max-queue 2 (503s asked for), ${SECONDS_PER_RUN}s"
echo "WRK_BODY='$BODY' wrk -t2 -c16 -d${SECONDS_PER_RUN}s -s bench/wrk/statuses.lua http://127.0.0.1:$PORT/v1/completions"
WRK_BODY=$BODY wrk -t2 -c16 -d"${SECONDS_PER_RUN}s" --timeout 30s -s bench/wrk/statuses.lua "http://127.0.0.1:$PORT/v1/completions"
echo "== server log lines by status (main, small)"
for name in main small; do
  printf '%s: ' "$name"; grep -o 'POST /v1/completions \([0-9]*\|client gone\)\|GET /health [0-9]*' "$WORK/$name.log" | sort | uniq -c | tr '\n' ';'; echo
  if grep -q "Traceback\|Unhandled" "$WORK/$name.log"; then echo "$name: errors in the log:" >&2; grep -A5 "Traceback\|Unhandled" "$WORK/$name.log" >&2; fi
done
