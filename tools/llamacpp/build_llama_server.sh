#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp source that the pinned llama-cpp-python sdist
# vendors, for the bench's llama.cpp peer (tools/bench/llamacpp.py).
#
#   bash tools/llamacpp/build_llama_server.sh        # prints the binary's path on its last line
#
# The binary is cached in build/llama.cpp-<version>/ and rebuilt only when the version or the cmake
# options change. The instruction sets are the ones this CPU reports (/proc/cpuinfo), enabled one by
# one with GGML_NATIVE=OFF: a native build also turns on AMX, and llama.cpp with AMX segfaults on the
# first multi-row forward on the Xeons this project runs on, so AMX stays off. Static libraries, no
# CURL/OpenSSL: the peer reads local GGUF files only.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
OUT="$ROOT/build/llama.cpp-$VERSION"
JOBS="${JOBS:-$(nproc)}"
BIN="$OUT/build/bin/llama-server"

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }
OPTS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF
  -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)"
  -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
  -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
  -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
)
STAMP="$OUT/build/.options"
if [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "${OPTS[*]}" ]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$OUT"
SDIST="$OUT/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "[llama-server] downloading the llama-cpp-python==$VERSION sdist from PyPI" >&2
  "$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$OUT" "llama-cpp-python==$VERSION" >&2
fi
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
