#!/usr/bin/env bash
# The container's command. tritonserver runs in explicit model-control mode (the engine supervisor
# reloads a dead engine over the model-control API, which only this mode offers) and loads the
# engine models at start. The orchestrator (`ssd`) has a warmup request that measures the engines'
# costs over BLS, which Triton refuses while the server starts: it is loaded through the repository
# API once the engines are READY, and strict readiness (/v2/health/ready) stays false until its
# warmup is done, so no client pays for the measurement. tools/triton_launcher.py does the same.
set -euo pipefail
REPO=${SSD_MODEL_REPOSITORY:-/opt/ssd/build/model_repository}
HTTP=http://127.0.0.1:8000
# GET, or POST with a body: succeeds on a 2xx answer (python3 is in every Triton image, curl is not said to be)
http() { python3 -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], sys.argv[2].encode() if sys.argv[2:] else None, 3600)' "$@" 2>/dev/null; }
startup=() deferred=()
for cfg in "$REPO"/*/config.pbtxt; do
  model=$(basename "$(dirname "$cfg")")
  if grep -q model_warmup "$cfg"; then deferred+=("$model"); else startup+=("--load-model=$model"); fi
done
tritonserver --model-repository="$REPO" --model-control-mode=explicit "${startup[@]}" \
  --http-port=8000 --grpc-port=8001 --metrics-port=8002 "$@" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null' TERM INT
until http "$HTTP/v2/health/ready"; do
  kill -0 "$server" 2>/dev/null || { wait "$server"; exit $?; }
  sleep 1
done
for model in "${deferred[@]}"; do
  if ! http "$HTTP/v2/repository/models/$model/load" '{}'; then
    echo "serve.sh: loading $model failed (see the server's log above)" >&2
    kill -TERM "$server"
  fi
done
wait "$server"
