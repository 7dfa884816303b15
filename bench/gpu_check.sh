#!/usr/bin/env bash
# One-shot check on a CUDA machine (H200; no internet): build llmpar._C, run the GPU tests and the op tests,
# run the kernel benchmarks, print a table of steps. Target: under 8 minutes.
#   bash bench/gpu_check.sh            # from the repo root (or anywhere: it cd's there)
# Env: TORCH_CUDA_ARCH_LIST (default: this GPU's arch), MAX_JOBS (default 8), STEP_TIMEOUT (default 240 s),
#      SKIP_BUILD=1 (use the JIT build on first use instead of the in-place build).
# Results (logs, benchmark tables) go to bench/results/gpu_check_<date>/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="$ROOT/bench/results/gpu_check_$STAMP"
mkdir -p "$OUT"
export MAX_JOBS="${MAX_JOBS:-8}"
STEP_TIMEOUT="${STEP_TIMEOUT:-240}"
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo "9.0")"
  export TORCH_CUDA_ARCH_LIST
fi
export PYTHONUNBUFFERED=1

T0=$SECONDS
declare -a ROWS=()
FAILED=0
step() {  # step NAME CMD... : run with a timeout, log to $OUT/NAME.log, never abort the script
  local name="$1"; shift
  local t=$SECONDS rc=0
  echo "==> $name"
  set +e
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  local status="ok"
  if [[ $rc -eq 124 ]]; then status="TIMEOUT"; FAILED=1
  elif [[ $rc -ne 0 ]]; then status="FAIL($rc)"; FAILED=1; fi
  ROWS+=("$(printf '| %-26s | %-9s | %5ds |' "$name" "$status" $((SECONDS - t)))")
}

step env bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true; \
  $PY -c 'import torch, sys; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())'; \
  $PY -c 'import triton; print(\"triton\", triton.__version__)' || true; which nvcc && nvcc --version | tail -1 || true"

step install "$PY" -m pip install -e . --no-deps --no-build-isolation -q

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
  # in-place: llmpar/_C*.so next to the sources, found by llmpar/ops/_ext.py
  step build_ext env LLMPAR_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace
fi
# loads the in-place build, or JIT-builds it (also the fallback when build_ext failed)
step load_ext "$PY" -c "
from llmpar.ops import _ext, backend_report
from llmpar.ops._dispatch import has_ext_op
import json, torch
s = _ext.load()
print(s)
assert s.available, s.reason
print(torch.ops.llmpar.pack_bucket.default._schema)
for name in ('linear_lt', 'linear_lt_aux', 'bias_act_backward'):  # the fused-GEMM ops (cuBLASLt ones need cublasLt.h)
    print(name, getattr(torch.ops.llmpar, name).default._schema if has_ext_op(name) else 'MISSING (no CUDA kernel)')
print(json.dumps(backend_report(), indent=1))"

# which backend linear_act picks on CUDA per activation (cuda = cuBLASLt epilogue + bias_act_backward)
step gemm_dispatch "$PY" -c "
import torch
from llmpar.ops.gemm import ACTIVATIONS, select_backward_backend, select_forward_backend
x = torch.randn(8, 64, device='cuda', dtype=torch.bfloat16); w = torch.randn(32, 64, device='cuda', dtype=torch.bfloat16)
for act in ACTIVATIONS:
    print(f'{act:10s} forward {select_forward_backend(x, w, act)}')
print('backward', select_backward_backend(torch.randn(8, 32, device='cuda', dtype=torch.bfloat16), x))"

step pytest_gpu "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/ --junitxml="$OUT/gpu.xml"
step pytest_ops "$PY" -m pytest -q -p no:cacheprovider tests/test_ops_*.py tests/test_build*.py tests/test_optim_ops.py tests/test_optim_adamw.py tests/test_optim_build.py \
  --junitxml="$OUT/ops.xml"

# every bench/bench_*.py, each with --device cuda --out <results folder> plus its GPU-sized flags
# (bench_gemm: the cuBLASLt epilogue and the LLMPAR_BACKEND=cuda path next to Triton and torch, and the parallel
#  linears' forward + backward per backend)
for bench in bench/bench_*.py; do
  name="$(basename "$bench" .py)"
  extra=()
  case "$name" in
    bench_train) extra=(--widths 256 512 1024 --dtype bfloat16) ;;
  esac
  step "$name" "$PY" "$bench" --device cuda --out "$OUT" "${extra[@]}"
done

echo
echo "| step                       | status    |  time  |"
echo "|----------------------------|-----------|--------|"
printf '%s\n' "${ROWS[@]}"
printf '| %-26s | %-9s | %5ds |\n' "total" "$([[ $FAILED -eq 0 ]] && echo ok || echo FAILED)" $((SECONDS - T0))
for f in "$OUT"/*.md; do [[ -e "$f" ]] && { echo; cat "$f"; }; done
echo "logs: $OUT"
exit "$FAILED"
