# Sourced by the llama.cpp build scripts (with ROOT set): `llama_sdist VERSION PYTHON` prints the path
# of the pinned llama-cpp-python sdist in build/llama.cpp-VERSION/, downloading it from PyPI the first
# time: one download for the patched library and the unpatched llama-server peer.
llama_sdist() {
  local dir="$ROOT/build/llama.cpp-$1"
  local sdist="$dir/llama_cpp_python-$1.tar.gz"
  if [ ! -f "$sdist" ]; then
    mkdir -p "$dir"
    echo "[llama.cpp] downloading the llama-cpp-python==$1 sdist from PyPI" >&2
    "$2" -m pip download -q --no-binary :all: --no-deps -d "$dir" "llama-cpp-python==$1" >&2
  fi
  echo "$sdist"
}
