#!/usr/bin/env bash
# Creates the checkout's virtualenv (.venv) with the pinned stack; the Makefile runs it.
#
#   bash tools/setup_venv.sh [--dev] [--engines engines/default.yaml]
#
# The steps that do not need each other run side by side, each printing what it does:
# - llama-cpp-python: the patched wheel from the per-user cache, or compiled once (minutes on two
#   cores; tools/llamacpp/install_llama_cpp_python.sh);
# - the pinned requirements (requirements.txt; --dev adds requirements-dev.txt: tests, benches,
#   load tests, the OpenVINO runtime);
# - with --engines, the engines that profile names: their weights download while llama.cpp
#   compiles, and a drafter's conversion runs as soon as the requirements are in.
# Env: PYTHON (the interpreter that creates the venv, default python3), VENV (default .venv).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
DEV=0
ENGINES=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dev) DEV=1; shift ;;
    --engines) ENGINES=$2; shift 2 ;;
    *) echo "usage: $0 [--dev] [--engines FILE]" >&2; exit 2 ;;
  esac
done

T0=$SECONDS
say() { echo "[setup] $* ($((SECONDS - T0)) s)"; }
[[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip==24.3.1 pyyaml==6.0.2 2>&1 | grep -v '^WARNING: Location' || true

# The compile only needs the sdist and pip's isolated build environment: start it first.
BUILD_ONLY=1 PYTHON="$PY" bash tools/llamacpp/install_llama_cpp_python.sh &
LLAMA=$!
FETCH=""
if [[ -n "$ENGINES" ]]; then
  say "fetching the weights $ENGINES names, beside the compile"
  "$PY" tools/fetch_weights.py "$ENGINES" &
  FETCH=$!
fi

say "installing the pinned requirements$([[ $DEV == 1 ]] && echo ' (with requirements-dev.txt)')"
# a line per package pip fetches, then one for the install
"$PY" -m pip install --progress-bar off -r "$([[ $DEV == 1 ]] && echo requirements-dev.txt || echo requirements.txt)" 2>&1 \
  | awk '/^Collecting / { n++; printf "[pip] %d: %s\n", n, $2; fflush() }
         /^Installing collected/ { print "[pip] installing " n " packages ..."; fflush() }
         /^(ERROR|error)/ { print; fflush() }' || true
"$PY" -m pip install -q --no-deps -e . 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -c "import torch, transformers, tritonclient, pytriton" \
  || { echo "[setup] ERROR: the requirements did not install (pip's messages are above)" >&2; exit 1; }
say "requirements installed"

if [[ -n "$FETCH" ]]; then
  wait "$FETCH" || { echo "[setup] ERROR: fetching the weights failed (its message is above)" >&2; exit 3; }
  say "weights fetched and verified; building the engines"
  "$PY" tools/build_engines.py --config "$ENGINES"
fi

if ! wait "$LLAMA"; then
  echo "[setup] ERROR: llama-cpp-python did not build (its log is above)" >&2
  exit 1
fi
PYTHON="$PY" bash tools/llamacpp/install_llama_cpp_python.sh
say "done"
