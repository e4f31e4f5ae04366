# Sourced by the llama.cpp build scripts: GGML_CPU_OPTIONS, the instruction sets this CPU reports
# (/proc/cpuinfo), enabled one by one with GGML_NATIVE=OFF. A native build also turns on AMX, and
# llama.cpp with AMX segfaults on the first multi-row forward on the Xeons this project runs on, so
# AMX stays off.
_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
_has() { [[ "$_flags" == *" $1 "* ]] && echo ON || echo OFF; }
GGML_CPU_OPTIONS=(
  -DGGML_NATIVE=OFF
  -DGGML_AVX="$(_has avx)" -DGGML_AVX2="$(_has avx2)" -DGGML_FMA="$(_has fma)" -DGGML_F16C="$(_has f16c)"
  -DGGML_BMI2="$(_has bmi2)" -DGGML_AVX_VNNI="$(_has avx_vnni)"
  -DGGML_AVX512="$(_has avx512f)" -DGGML_AVX512_VBMI="$(_has avx512vbmi)"
  -DGGML_AVX512_VNNI="$(_has avx512_vnni)" -DGGML_AVX512_BF16="$(_has avx512_bf16)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
