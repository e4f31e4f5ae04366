#!/usr/bin/env bash
# Install the pinned llama-cpp-python into the venv, built from its sdist for the llama.cpp target
# engine (backends/python_ssd/ssd/engine/llamacpp_engine.py).
#
#   PYTHON=.venv/bin/python bash tools/llamacpp/install_llama_cpp_python.sh
#
# The engine needs a row's logits to be the same whatever else shares its forward (docs/cpu_engine.md):
# - GGML_LLAMAFILE=OFF: the llamafile GEMMs tile a forward's rows by their count;
# - repacked weights stay on (their one-row GEMV is llama.cpp's fastest decode kernel), with
#   patches/*.patch applied to the sdist: the Q4_K GEMV adds its sums in the order of the 4-row
#   GEMM, and the Q6_K dot product in the order of the tiled kernels (8+ rows), so each pair of
#   kernels gives a row the same bits; Q6_K products of 2-7 rows unpack each weight once for all the
#   rows (AVX-512 builds), and Q4_K products take all of a forward's rows in one pass with VNNI
#   (AVX-512 VNNI builds), each with the one-row kernel's bits; only the libraries Python loads are
#   compiled (no llama.cpp `common`).
# The engine checks the result at load.
#
# The built wheel is kept per user in $SSD_CACHE (default ~/.cache/ssd, or $XDG_CACHE_HOME/ssd),
# keyed by version, build options (the CPU's instruction sets among them), patches and Python
# ABI: a second checkout, `make clean` or a new venv installs it in seconds. Skipped when the
# installed build already has this key. BUILD_ONLY=1 builds (or finds) the wheel without
# installing it, so the Makefile can compile while pip installs the rest of the stack.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
source "$ROOT/tools/llamacpp/cpu_options.sh"
OPTS=(-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=ON -DGGML_OPENMP=ON "${GGML_CPU_OPTIONS[@]}"
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF)
PATCHES=("$ROOT"/tools/llamacpp/patches/*.patch)
PATCH_SUM="$(cat "${PATCHES[@]}" | sha256sum | cut -c1-16)"
ABI="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')"
WANT="$VERSION ${OPTS[*]} patches:$PATCH_SUM $ABI"
KEY="$(printf '%s' "$WANT" | sha256sum | cut -c1-16)"
CACHE="${SSD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ssd}/wheels/llama-cpp-python-$VERSION-$KEY"
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STAMP="$SITE/llama_cpp/.ssd_build_options"
say() { echo "[llama.cpp] $*" >&2; }

if [ "${BUILD_ONLY:-0}" != 1 ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi

# Compiles the wheel into $CACHE, printing a line per tenth of the build steps (the compile is
# the longest step of a fresh install: minutes on two cores).
build_wheel() {
  source "$ROOT/tools/llamacpp/sdist.sh"
  local sdist work src log t0
  sdist="$(llama_sdist "$VERSION" "$PYTHON")"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' RETURN
  tar -xzf "$sdist" -C "$work"
  src="$work/llama_cpp_python-$VERSION"
  for p in "${PATCHES[@]}"; do
    (cd "$src" && git apply "$p")
  done
  say "compiling llama-cpp-python $VERSION with $(basename -a "${PATCHES[@]}" | tr '\n' ' ')(${OPTS[*]})"
  t0=$(date +%s)
  log="$work/build.log"
  # -v makes pip show the build's ninja lines ("[12/130] Building ..."); the filter prints progress
  CMAKE_ARGS="${OPTS[*]}" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-$(nproc)}" \
    "$PYTHON" -m pip wheel -v --no-deps --no-cache-dir -w "$work/wheel" "$src" > "$log" 2>&1 &
  local pid=$! shown=0 line n total
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    line="$(grep -oE '^ *\[[0-9]+/[0-9]+\] ' "$log" | tail -n 1 | tr -d ' []')" || true
    [ -n "$line" ] || continue
    n=${line%/*}; total=${line#*/}
    if (( 10 * n / total > shown )); then
      shown=$(( 10 * n / total ))
      say "compiled $n/$total steps ($(( 100 * n / total ))%, $(( $(date +%s) - t0 )) s)"
    fi
  done
  wait "$pid" || true
  if ! ls "$work"/wheel/llama_cpp_python-*.whl >/dev/null 2>&1; then
    tail -n 40 "$log" >&2
    say "ERROR: the build failed (the end of its log is above)"
    return 1
  fi
  mkdir -p "$CACHE.partial"
  cp "$work"/wheel/llama_cpp_python-*.whl "$CACHE.partial/"
  echo "$WANT" > "$CACHE.partial/build_options"
  rm -rf "$CACHE" && mv "$CACHE.partial" "$CACHE"
  say "compiled in $(( $(date +%s) - t0 )) s; wheel kept in $CACHE"
}

if ! ls "$CACHE"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  build_wheel
else
  say "using the wheel built before: $CACHE"
fi
if [ "${BUILD_ONLY:-0}" = 1 ]; then
  exit 0
fi
"$PYTHON" -m pip install -q --no-deps --force-reinstall "$CACHE"/llama_cpp_python-*.whl
echo "$WANT" > "$STAMP"
say "installed"
