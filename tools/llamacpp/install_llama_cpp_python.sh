#!/usr/bin/env bash
# Install the pinned llama-cpp-python into the venv, built from its sdist for the llama.cpp target
# engine (backends/python_ssd/ssd/engine/llamacpp_engine.py).
#
#   PYTHON=.venv/bin/python bash tools/llamacpp/install_llama_cpp_python.sh
#
# The engine needs a row's logits to be the same whatever else shares its forward (docs/cpu_engine.md):
# - GGML_LLAMAFILE=OFF: the llamafile GEMMs tile a forward's rows by their count;
# - repacked weights stay on (their one-row GEMV is llama.cpp's fastest decode kernel), with
#   patches/*.patch applied to the vendored llama.cpp: the Q4_K GEMV adds its sums in the order of the
#   4-row GEMM, and the Q6_K dot product in the order of the tiled kernels (8+ rows), so each pair of
#   kernels gives a row the same bits; Q6_K products of 2-7 rows unpack each weight once for all the
#   rows (AVX-512 builds), and Q4_K products take all of a forward's rows in one pass with VNNI
#   (AVX-512 VNNI builds), each with the one-row kernel's bits.
# The engine checks the result at load. Skipped when the installed build has these options and patches.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
source "$ROOT/tools/llamacpp/cpu_options.sh"
OPTS=(-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=ON -DGGML_OPENMP=ON "${GGML_CPU_OPTIONS[@]}"
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF)
PATCHES=("$ROOT"/tools/llamacpp/patches/*.patch)
PATCH_SUM="$(cat "${PATCHES[@]}" | sha256sum | cut -c1-16)"
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STAMP="$SITE/llama_cpp/.ssd_build_options"
WANT="$VERSION ${OPTS[*]} patches:$PATCH_SUM"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi

source "$ROOT/tools/llamacpp/sdist.sh"
SDIST="$(llama_sdist "$VERSION" "$PYTHON")"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
for p in "${PATCHES[@]}"; do
  (cd "$SRC" && git apply "$p")
done

echo "[llama-cpp-python] building $VERSION from source with $(basename -a "${PATCHES[@]}" | tr '\n' ' '): ${OPTS[*]}" >&2
t0=$(date +%s)
CMAKE_ARGS="${OPTS[*]}" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-$(nproc)}" \
  "$PYTHON" -m pip install -q --no-cache-dir --no-deps --force-reinstall "$SRC" >&2
echo "$WANT" > "$STAMP"
echo "[llama-cpp-python] built in $(( $(date +%s) - t0 )) s" >&2
