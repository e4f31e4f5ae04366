#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp source that the pinned llama-cpp-python sdist
# vendors, for the bench's llama.cpp peer (tools/bench/llamacpp.py).
#
#   bash tools/llamacpp/build_llama_server.sh        # prints the binary's path on its last line
#
# The binary is cached in build/llama.cpp-<version>/ and rebuilt only when the version or the cmake
# options change. The instruction sets are the ones this CPU reports (cpu_options.sh; AMX off). Its
# defaults otherwise (llamafile GEMMs, repacked weights): the peer is llama.cpp as users run it.
# Static libraries, no CURL/OpenSSL: the peer reads local GGUF files only.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
OUT="$ROOT/build/llama.cpp-$VERSION"
JOBS="${JOBS:-$(nproc)}"
BIN="$OUT/build/bin/llama-server"

source "$ROOT/tools/llamacpp/cpu_options.sh"
OPTS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  "${GGML_CPU_OPTIONS[@]}"
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
)
STAMP="$OUT/build/.options"
if [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "${OPTS[*]}" ]; then
  echo "$BIN"
  exit 0
fi

source "$ROOT/tools/llamacpp/sdist.sh"
SDIST="$(llama_sdist "$VERSION" "$PYTHON")"
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tar -xzf "$SDIST" -C "$OUT" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi

echo "[llama-server] cmake ${OPTS[*]}" >&2
t0=$(date +%s)
cmake -S "$SRC" -B "$OUT/build" "${OPTS[@]}" >&2
cmake --build "$OUT/build" --target llama-server -j "$JOBS" >&2
echo "${OPTS[*]}" > "$STAMP"
echo "[llama-server] built in $(( $(date +%s) - t0 )) s" >&2
echo "$BIN"
