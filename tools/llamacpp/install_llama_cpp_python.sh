#!/usr/bin/env bash
# Install the pinned llama-cpp-python into the venv, built from its sdist for the llama.cpp target
# engine (backends/python_ssd/ssd/engine/llamacpp_engine.py).
#
#   PYTHON=.venv/bin/python bash tools/llamacpp/install_llama_cpp_python.sh
#
# Built with GGML_LLAMAFILE=OFF and GGML_CPU_REPACK=OFF: the llamafile GEMMs and the repacked
# weight layouts tile a forward's rows differently by row count, so a row's logits would depend on
# how many rows share its forward; without them a row is computed the same way in a 1-row step and
# in a verify (the engine checks this at load). Skipped when the installed build has these options.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
source "$ROOT/tools/llamacpp/cpu_options.sh"
OPTS=(-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=ON -DGGML_OPENMP=ON "${GGML_CPU_OPTIONS[@]}"
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF)
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STAMP="$SITE/llama_cpp/.ssd_build_options"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION ${OPTS[*]}" ]; then
  exit 0
fi
echo "[llama-cpp-python] building $VERSION from source: ${OPTS[*]}" >&2
t0=$(date +%s)
CMAKE_ARGS="${OPTS[*]}" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-$(nproc)}" \
  "$PYTHON" -m pip install -q --no-cache-dir --no-binary llama-cpp-python --no-deps --force-reinstall \
  "llama-cpp-python==$VERSION" >&2
echo "$VERSION ${OPTS[*]}" > "$STAMP"
echo "[llama-cpp-python] built in $(( $(date +%s) - t0 )) s" >&2
