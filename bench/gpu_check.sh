#!/usr/bin/env bash
# One-shot check on a GPU machine (made for a short H200 lease: no network, a 10-minute command limit, and only the
# files written under $OUT come back). Builds llmpar._C, runs the GPU tests (bf16 cases first) on pytest-xdist
# workers, two bf16 training runs of the demo GPT through llmpar.initialize on NCCL (world size 1: ZeRO-2, then ZeRO-3
# with overlap_comm and optimizer offload), and the optimizer / GEMM / bucket benchmarks at LLM shapes.
#
#   bash bench/gpu_wheelhouse.sh                     HERE, once (network): the wheels the GPU machine lacks, into
#                                                    .gpu-wheelhouse/ (ignored: name it in the device tool's carry)
#   bash bench/gpu_check.sh                          THERE: everything, in the order of --plan (it cd's to the repo root)
#   bash bench/gpu_check.sh --plan                   print the steps, their time budgets and how pytest-xdist gets
#                                                    there; run nothing
#   bash bench/gpu_check.sh --only build_ext,train_bf16   only these steps (a rerun)
#
# Time: a global deadline (GPU_CHECK_DEADLINE, default 480 s: the run ends within 8 minutes) bounds the whole run.
# Each step runs under min(its budget, the time left); a step that no longer fits is skipped and listed as such.
# Test steps run pytest -v (a step killed at its limit still lists the tests that passed) with a per-test timeout
# shorter than the step's budget, and junit XML.
# Wheels: the env step installs what python3 lacks of pytest-xdist, execnet, pytest-timeout, ninja (pytest) from
# .gpu-wheelhouse/ offline (pip --no-index --target WORK/site, put on PYTHONPATH / PATH); without the wheelhouse and
# without xdist in the image the tests run serially (slower: they will not fit their budgets) and summary.md says so.
# Output: summary.md (step table, test counts, figures, versions, device, build tools, date) and gpu_check.tar.gz
# (every log and result table) in $OUT when it is set, else in bench/results/gpu_check_<date>/. Both are rewritten
# after every step and by a trap on exit / INT / TERM, so a run killed part-way still leaves what it measured.
# CUDA_HOME: the toolkit that builds the extension, resolved once and exported (torch's own guess takes `which nvcc`
# without following links: an nvcc on PATH that is a wrapper script or a link outside the toolkit breaks build_ext).
# A valid CUDA_HOME from the environment is kept; else nvcc's real location (links followed), else the TOP nvcc reports
# itself (`nvcc --dryrun`: wrapper scripts), else /usr/local/cuda; valid means include/cuda_runtime.h and libcudart.
# --plan and summary.md print it as CUDA_HOME=<path>.
# Env: PYTHON (default python3), MAX_JOBS (16), TORCH_CUDA_ARCH_LIST (this GPU's arch), GPU_CHECK_DEADLINE (480),
#      GPU_CHECK_WORKERS (pytest-xdist workers, 14), GPU_CHECK_WHEELHOUSE (.gpu-wheelhouse), LLMPAR_AUTOTUNE_CONFIGS
#      for the tests (1: no autotuning) and GPU_CHECK_BENCH_CONFIGS for the benchmarks (2): Triton's GEMM autotunes
#      over that many configs only.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SUMMARY_PY="$(command -v python3 || echo "$PY")"  # the summary helper needs the standard library only
DEADLINE="${GPU_CHECK_DEADLINE:-480}"
export MAX_JOBS="${MAX_JOBS:-16}"
WORKERS="${GPU_CHECK_WORKERS:-14}"
WHEELHOUSE="${GPU_CHECK_WHEELHOUSE:-$ROOT/.gpu-wheelhouse}"
TEST_CONFIGS="${LLMPAR_AUTOTUNE_CONFIGS:-1}"
BENCH_CONFIGS="${GPU_CHECK_BENCH_CONFIGS:-2}"
export PYTHONUNBUFFERED=1
STAMP="$(date -u +%Y%m%d-%H%M%S)"

# name|budget in seconds|what it does. The order is the priority: what matters most runs while time is plentiful.
# Budgets from measured runs and static estimates: build_ext ~20-30 s with ninja (80-90 s without), tests_gpu_other
# 35-55 s on 14 workers (~300 s serially, compile-bound), tests_gpu_bf16 about the same, bench_bucket ~35 s before its
# table fix; env up to ~20 s (the first torch import on a cold image); bench_gemm 65-85 s (~26 Triton variants
# compiled, ~30 autotuned keys, 32 CUDA graphs captured); bench_grouped_mm ~15 s (an estimate: 4 Triton kernels
# compiled without autotuning, 2 shapes x 3 cases x forward / forward + backward; it writes its table after each shape).
PLAN=(
  "env|25|device, driver, python3 / torch / triton / nvcc versions; missing wheels from the wheelhouse (offline)"
  "install|15|pip install -e . --no-deps --no-build-isolation (offline)"
  "build_ext|45|LLMPAR_BUILD_CUDA=1 setup.py build_ext --inplace for this GPU's arch, MAX_JOBS=$MAX_JOBS, ninja"
  "load_ext|10|load llmpar._C, list its ops, backend report; later steps never JIT-build (LLMPAR_NO_JIT=1)"
  "tests_gpu_bf16|60|pytest -m gpu, bf16 cases, on the files with GPU tests (xdist workers)"
  "tests_gpu_other|80|pytest -m gpu, the other cases (fp32, fp16, dtype-free)"
  "tests_optim_cuda|35|pytest tests/test_optim_ops.py on the GPU: torch, triton and cuda backends"
  "train_bf16|30|llmpar train --nproc 1 --device cuda --bf16 --steps 30: the demo GPT through llmpar.initialize"
  "zero3_nccl|20|the same on ZeRO-3 + overlap_comm + optimizer offload (NCCL, world size 1: async streams)"
  "bench_optim|35|FusedAdamW (every precision) vs torch AdamW, GPT parameter lists of 100M and 1B"
  "bench_gemm|85|linear_act vs cuBLAS, 8192 tokens x LLaMA 7B/8B MLP shapes, tp 1 and 8; parallel layers fwd+bwd"
  "bench_bucket|25|pack/unpack of a 1e8-element gradient bucket, every backend"
  "bench_grouped_mm|15|MoE experts: Triton grouped GEMM vs torch._grouped_mm vs per-expert cuBLAS, DeepSeek-V3 / Qwen3 shapes"
)
NAMES=(); BUDGETS=(); WHATS=()
for row in "${PLAN[@]}"; do
  IFS='|' read -r n b w <<<"$row"
  NAMES+=("$n"); BUDGETS+=("$b"); WHATS+=("$w")
done

if [[ -n "${OUT:-}" ]]; then DEST="$OUT"; else DEST="$ROOT/bench/results/gpu_check_$STAMP"; fi

cuda_toolkit_ok() {  # cuda_toolkit_ok DIR: DIR holds the runtime header and library the extension builds against
  [[ -n "$1" && -f "$1/include/cuda_runtime.h" ]] && compgen -G "$1/lib64/libcudart*" >/dev/null
}

resolve_cuda_home() {  # sets CUDA_HOME_PATH (empty when none is valid) and CUDA_HOME_HOW (where it came from)
  local nvcc top cand
  CUDA_HOME_PATH=""; CUDA_HOME_HOW=""
  if [[ -n "${CUDA_HOME:-}" ]]; then
    if cuda_toolkit_ok "$CUDA_HOME"; then CUDA_HOME_PATH="$CUDA_HOME"; CUDA_HOME_HOW="from the environment"; return; fi
    CUDA_HOME_HOW="CUDA_HOME=$CUDA_HOME from the environment lacks include/cuda_runtime.h or lib64/libcudart*; "
  fi
  nvcc="$(command -v nvcc || true)"
  if [[ -n "$nvcc" ]]; then
    cand="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"
    if cuda_toolkit_ok "$cand"; then CUDA_HOME_PATH="$cand"; CUDA_HOME_HOW+="nvcc at $nvcc, links followed"; return; fi
    top="$(timeout 20 "$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)"
    if [[ -n "$top" ]] && cand="$(readlink -f "$top")" && cuda_toolkit_ok "$cand"; then
      CUDA_HOME_PATH="$cand"; CUDA_HOME_HOW+="the toolkit nvcc at $nvcc reports (nvcc --dryrun TOP)"; return
    fi
  fi
  cand="$(readlink -f /usr/local/cuda 2>/dev/null || true)"
  if cuda_toolkit_ok "$cand"; then CUDA_HOME_PATH="$cand"; CUDA_HOME_HOW+="/usr/local/cuda"; return; fi
  CUDA_HOME_HOW+="no toolkit found (nvcc ${nvcc:-not on PATH}): build_ext will fail"
}
resolve_cuda_home
if [[ -n "$CUDA_HOME_PATH" ]]; then export CUDA_HOME="$CUDA_HOME_PATH"; fi

xdist_route() {  # how pytest-xdist reaches the test steps, in one line
  local wheels
  wheels="$(compgen -G "$WHEELHOUSE/pytest_xdist-*.whl" | head -n 1)"
  if timeout 20 "$PY" -c "import xdist" >/dev/null 2>&1; then
    echo "in $PY's own environment (the image); $WORKERS workers"
  elif [[ -n "$wheels" ]]; then
    echo "from ${WHEELHOUSE#"$ROOT"/}/ ($(compgen -G "$WHEELHOUSE/*.whl" | wc -l | tr -d ' ') wheels, $(basename "$wheels")" \
      "among them), installed offline by the env step (pip --no-index --target WORK/site); $WORKERS workers"
  else
    echo "MISSING: $PY has no xdist and there is no ${WHEELHOUSE#"$ROOT"/}/ (make it here with" \
      "bash bench/gpu_wheelhouse.sh and carry it): the tests run serially and will not fit their budgets"
  fi
}

test_timeout() {  # test_timeout BUDGET: pytest-timeout's per-test limit, shorter than the step's budget
  local t=$(( $1 - 10 < 60 ? $1 - 10 : 60 ))
  echo $(( t < 10 ? 10 : t ))
}

print_plan() {
  local total=0 i
  echo "bench/gpu_check.sh plan: ${#NAMES[@]} steps, global deadline ${DEADLINE}s (steps that no longer fit are skipped)"
  printf '  %-17s %7s  %s\n' "step" "budget" "what"
  for i in "${!NAMES[@]}"; do
    printf '  %-17s %6ss  %s\n' "${NAMES[$i]}" "${BUDGETS[$i]}" "${WHATS[$i]}"
    total=$((total + BUDGETS[i]))
  done
  echo "  sum of budgets ${total}s; each step runs under min(budget, time left before the deadline)"
  echo "  pytest-xdist: $(xdist_route)"
  echo "  test steps: pytest -v, junit XML, per-test timeout $(test_timeout 60)s / $(test_timeout 80)s /" \
    "$(test_timeout 35)s (bf16 / other / optim)"
  echo "  python: $PY; MAX_JOBS=$MAX_JOBS; Triton autotune configs: tests $TEST_CONFIGS, benchmarks $BENCH_CONFIGS"
  echo "  CUDA_HOME=${CUDA_HOME_PATH:-NONE} ($CUDA_HOME_HOW)"
  echo "  output: $DEST/summary.md and $DEST/gpu_check.tar.gz${OUT:+ (\$OUT)}"
}

ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --plan) print_plan; exit 0 ;;
    --only) ONLY=",${2:?--only needs a comma-separated list of steps},"; shift 2 ;;
    -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --plan, --only STEPS)" >&2; exit 2 ;;
  esac
done
if [[ -n "$ONLY" ]]; then
  for n in $(tr ',' ' ' <<<"$ONLY"); do
    [[ " ${NAMES[*]} " == *" $n "* ]] || { echo "gpu_check.sh: no step named $n (see --plan)" >&2; exit 2; }
  done
fi

mkdir -p "$DEST"
if [[ -n "${OUT:-}" ]]; then WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"; else WORK="$DEST"; fi
LOGS="$WORK/logs"; RESULTS="$WORK/results"
mkdir -p "$LOGS" "$RESULTS"
STATUS=(); SECS=()
for i in "${!NAMES[@]}"; do STATUS+=("pending"); SECS+=(""); done
T0=$SECONDS
CHILD=""

write_outputs() {  # steps.tsv -> summary.md, then the tarball; cheap enough to run after every step
  local i
  : >"$WORK/steps.tsv"
  for i in "${!NAMES[@]}"; do
    printf '%s\t%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${BUDGETS[$i]}" "${WHATS[$i]}" \
      >>"$WORK/steps.tsv"
  done
  if ! "$SUMMARY_PY" bench/gpu_check_summary.py summary "$WORK" "$DEST/summary.md" 2>>"$LOGS/summary.err"; then
    { echo "# GPU check (summary helper failed: see logs/summary.err)"; echo; cat "$WORK/steps.tsv"; } >"$DEST/summary.md"
  fi
  cp "$DEST/summary.md" "$WORK/summary.md" 2>/dev/null || true
  tar -czf "$DEST/gpu_check.tar.gz.tmp" -C "$WORK" logs results steps.tsv summary.md \
    $( [[ -f "$WORK/env.json" ]] && echo env.json ) $( [[ -f "$WORK/tools.txt" ]] && echo tools.txt ) 2>/dev/null \
    && mv -f "$DEST/gpu_check.tar.gz.tmp" "$DEST/gpu_check.tar.gz"
}

on_signal() {
  [[ -n "$CHILD" ]] && kill -TERM "$CHILD" 2>/dev/null
  for i in "${!STATUS[@]}"; do [[ "${STATUS[$i]}" == running ]] && STATUS[$i]="KILLED"; done
  echo "gpu_check.sh: interrupted; outputs in $DEST" >&2
  exit 130
}
trap on_signal INT TERM
trap write_outputs EXIT

run_step() {  # run_step INDEX CMD...: under min(budget, time left), output to logs/NAME.log
  local i="$1"; shift
  local name="${NAMES[$i]}" left t rc
  if [[ -n "$ONLY" && "$ONLY" != *",$name,"* ]]; then STATUS[$i]="not selected"; return 0; fi
  left=$((DEADLINE - (SECONDS - T0)))
  if (( left < 15 )); then
    STATUS[$i]="SKIPPED (deadline)"; echo "==> $name: skipped, ${left}s left before the deadline"; write_outputs
    return 0
  fi
  local limit=$(( BUDGETS[i] < left ? BUDGETS[i] : left ))
  echo "==> $name (limit ${limit}s): ${WHATS[$i]}"
  STATUS[$i]="running"; write_outputs
  t=$SECONDS
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 &
  CHILD=$!
  wait "$CHILD"; rc=$?
  CHILD=""
  SECS[$i]=$((SECONDS - t))
  if (( rc == 124 || rc == 137 )); then STATUS[$i]="TIMEOUT"
  elif (( rc != 0 )); then STATUS[$i]="FAIL (rc $rc)"
  else STATUS[$i]="ok"; fi
  tail -n 4 "$LOGS/$name.log" | sed 's/^/    /'
  echo "    -> ${STATUS[$i]} in ${SECS[$i]}s"
  write_outputs
}

# --------------------------------------------------------------------------------------------- the steps

SITE="$WORK/site"
SETTINGS="deadline ${DEADLINE}s, MAX_JOBS=$MAX_JOBS, autotune configs tests $TEST_CONFIGS / benches $BENCH_CONFIGS,"
SETTINGS+=" CUDA_HOME=${CUDA_HOME_PATH:-NONE} ($CUDA_HOME_HOW)"
run_step 0 bash -c '"$1" bench/gpu_check_summary.py env "$2" "$3"; rc=$?; echo; echo "wheels (${4#"$6"/}):"
  PYTHON="$1" GPU_CHECK_WHEELHOUSE="$4" bash bench/gpu_wheelhouse.sh --install "$5" || rc=1
  export PYTHONPATH="$5${PYTHONPATH:+:$PYTHONPATH}" PATH="$5/bin:$5/ninja/data/bin:$PATH"
  { echo "ninja $(ninja --version 2>/dev/null || echo "not found")"
    echo "pytest-xdist $("$1" -c "import xdist; print(xdist.__version__)" 2>/dev/null || echo "not found")"
  } | tee "$2/tools.txt"; exit $rc' _ "$PY" "$WORK" "$SETTINGS" "$WHEELHOUSE" "$SITE" "$ROOT"
if [[ -d "$SITE" ]]; then  # what the env step installed from the wheelhouse
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$SITE/ninja/data/bin:$PATH"
fi

run_step 1 "$PY" -m pip install -e . --no-deps --no-build-isolation -q --disable-pip-version-check

if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null \
    || echo "9.0")"
fi
export TORCH_CUDA_ARCH_LIST
run_step 2 env LLMPAR_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace
export LLMPAR_NO_JIT=1  # built or not: nothing JIT-builds inside a timed test

run_step 3 "$PY" -c "
import json, torch
from llmpar.ops import _ext, backend_report
from llmpar.ops._dispatch import has_ext_op
from llmpar.ops._library import OPS
s = _ext.load()
print(s)
for name in OPS:
    print(f'  llmpar::{name}:', 'CUDA kernel' if has_ext_op(name) else 'NO CUDA KERNEL')
print(json.dumps(backend_report(), indent=1))
assert s.available, s.reason"

GPU_FILES=($(grep -lE '^ *(@pytest\.mark\.gpu|[A-Za-z_]+ = pytest\.mark\.gpu)' tests/test_*.py))  # files that use the mark
PYTEST=(env "PYTHONPATH=$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -v -p no:cacheprovider -p dtype_select
        -rfE)
if "$PY" -c "import xdist" 2>/dev/null && (( WORKERS > 1 )); then
  PYTEST+=(-n "$WORKERS"); TESTS_HOW="pytest-xdist, $WORKERS workers"
else
  TESTS_HOW="SERIAL: no pytest-xdist (no wheelhouse?), slower than the budgets assume"
fi
HAS_TIMEOUT=0; "$PY" -c "import pytest_timeout" 2>/dev/null && HAS_TIMEOUT=1
echo "test steps: $TESTS_HOW; per-test timeout: $( ((HAS_TIMEOUT)) && echo yes || echo 'NO (pytest-timeout missing)')" \
  | tee -a "$LOGS/env.log"
echo "tests $TESTS_HOW" >>"$WORK/tools.txt"
pytest_step() {  # pytest_step INDEX ARGS...: the test command with a per-test timeout under the step's budget
  local i="$1"; shift
  local extra=()
  ((HAS_TIMEOUT)) && extra=(--timeout "$(test_timeout "${BUDGETS[$i]}")")
  run_step "$i" "${PYTEST[@]}" "${extra[@]}" --junitxml="$LOGS/${NAMES[$i]}.xml" "$@"
}
export LLMPAR_AUTOTUNE_CONFIGS="$TEST_CONFIGS"
pytest_step 4 -m gpu --dtype-group bf16 "${GPU_FILES[@]}"
pytest_step 5 -m gpu --dtype-group other "${GPU_FILES[@]}"
pytest_step 6 tests/test_optim_ops.py

run_step 7 "$PY" -m llmpar.cli train --nproc 1 --device cuda --bf16 --steps 30 --sample 0 --json "$RESULTS/train.json"
# ZeRO-3 with overlap_comm (async reduce-scatters), small buckets (several of them in flight) and the optimizer on the
# CPU (its copy stream): the async paths on NCCL, with one GPU (two ranks cannot share a GPU under NCCL)
cat >"$WORK/zero3.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
 "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 30}},
 "zero_optimization": {"stage": 3, "overlap_comm": true, "contiguous_gradients": true, "reduce_bucket_size": 50000,
   "stage3_prefetch_bucket_size": 50000, "stage3_param_persistence_threshold": 1000,
   "offload_optimizer": {"device": "cpu", "pin_memory": true}},
 "bf16": {"enabled": true}}
JSON
run_step 8 "$PY" -m llmpar.cli train --nproc 1 --device cuda --config "$WORK/zero3.json" --steps 30 --sample 0 \
  --json "$RESULTS/train_zero3.json"

export LLMPAR_AUTOTUNE_CONFIGS="$BENCH_CONFIGS"
run_step 9 "$PY" bench/bench_optim.py --device cuda --sizes 100M 1B --no-deepspeed --out "$RESULTS"
run_step 10 "$PY" bench/bench_gemm.py --device cuda --tp 1 8 --out "$RESULTS"
run_step 11 "$PY" bench/bench_bucket.py --device cuda --repeats 15 --out "$RESULTS"
# one config per kernel (no autotuning: 4 Triton kernels compiled, shared by both shapes), uniform routing only
run_step 12 env LLMPAR_AUTOTUNE_CONFIGS=1 "$PY" bench/bench_grouped_mm.py --device cuda --routing uniform --repeats 5 \
  --out "$RESULTS"

echo
echo "| step              | status             | time  |"
echo "|-------------------|--------------------|-------|"
for i in "${!NAMES[@]}"; do printf '| %-17s | %-18s | %4ss |\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]:--}"; done
printf '| %-17s | %-18s | %4ss |\n' "total" "" $((SECONDS - T0))
echo "summary: $DEST/summary.md; logs and tables: $DEST/gpu_check.tar.gz"
FAILED=0
for s in "${STATUS[@]}"; do [[ "$s" == ok || "$s" == "not selected" ]] || FAILED=1; done
exit "$FAILED"
