#!/usr/bin/env bash
# Build the CUDA extension llmpar._C into a wheel on a machine WITHOUT a GPU and check what came out:
#   - a separate venv (.venv-cuda, reused when present) with the CUDA build of torch,
#   - `pip wheel` with LLMPAR_BUILD_CUDA=1 against that torch (no build isolation: the ABI then matches),
#   - cuobjdump lists sm_80 and sm_90 cubins in _C*.so,
#   - `import llmpar._C` works and registers a CUDA kernel for every op llmpar/ops/_library.py defines (the one list of
#     llmpar:: ops; tests/test_build_cuda.py checks that csrc/*.cpp implement exactly those), with the .so loaded
#     before and after the schemas are defined.
# Env: VENV (default .venv-cuda), TORCH_SPEC (default torch==2.14.1), CUDA_HOME (default /usr/local/cuda-13.0),
#      TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), MAX_JOBS (default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv-cuda}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda-13.0}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
export PATH="$CUDA_HOME/bin:$PATH"
WHEELHOUSE="$ROOT/wheelhouse"

T0=$SECONDS
declare -a TIMES=()
step() {  # step NAME CMD...: run, time, remember
  local name="$1"; shift
  local t=$SECONDS
  echo "==> $name"
  "$@"
  TIMES+=("$(printf '%-28s %4ds' "$name" $((SECONDS - t)))")
}

[[ -x "$CUDA_HOME/bin/nvcc" ]] || { echo "error: no nvcc under CUDA_HOME=$CUDA_HOME" >&2; exit 1; }
ls "$CUDA_HOME"/lib64/libcudart.so* >/dev/null 2>&1 || ls "$CUDA_HOME"/lib/libcudart.so* >/dev/null 2>&1 \
  || { echo "error: CUDA_HOME=$CUDA_HOME holds no lib64/libcudart" >&2; exit 1; }

make_venv() {
  [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" ninja setuptools wheel numpy
}
step "venv + $TORCH_SPEC" make_venv
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"   # ninja from the venv
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

build_wheel() {
  rm -rf "$ROOT/build" "$WHEELHOUSE"
  LLMPAR_BUILD_CUDA=1 "$PY" -m pip wheel --no-build-isolation --no-deps -w "$WHEELHOUSE" "$ROOT"
}
step "pip wheel (LLMPAR_BUILD_CUDA=1)" build_wheel
WHEEL="$(ls "$WHEELHOUSE"/llmpar-*.whl | head -n1)"
echo "wheel: $WHEEL"

step "install wheel" "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SO="$(ls "$SITE"/llmpar/_C*.so | head -n1)"
# cuobjdump: PATH, the toolkit, or the copy triton ships (minimal toolkits lack it)
CUOBJDUMP="$(command -v cuobjdump || true)"
[[ -n "$CUOBJDUMP" ]] || CUOBJDUMP="$(ls "$CUDA_HOME/bin/cuobjdump" "$SITE"/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -n1 || true)"
[[ -n "$CUOBJDUMP" ]] || { echo "error: cuobjdump not found (PATH, \$CUDA_HOME/bin, triton)" >&2; exit 1; }
check_cubins() {
  local listing
  echo "$SO ($(du -h "$SO" | cut -f1)), listed by $CUOBJDUMP"
  listing="$("$CUOBJDUMP" --list-elf "$SO")"
  echo "$listing"
  local arch
  for arch in $(echo "$TORCH_CUDA_ARCH_LIST" | tr ';' ' '); do
    arch="${arch%%+PTX}"; arch="sm_${arch//./}"
    grep -q "$arch" <<<"$listing" || { echo "error: no $arch cubin in $SO" >&2; return 1; }
    echo "ok: $arch cubin present"
  done
}
step "cuobjdump cubins" check_cubins

# from another folder, so that the installed wheel is imported, not the source tree; torch NOT imported first.
# Every op of llmpar/ops/_library.py (the one place that defines the llmpar:: schemas) must have a CUDA kernel, and
# loading the .so must work both before the schemas exist (impl before def) and after.
check_import() {
  local order
  for order in so_first schemas_first; do
    (cd /tmp && "$PY" -c "
import sys
if sys.argv[1] == 'so_first':
    import llmpar._C
from llmpar.ops import _dispatch, _library
import llmpar._C, torch
print('llmpar._C (' + sys.argv[1] + '):', llmpar._C.__file__)
missing = []
for name in _library.OPS:
    has = _dispatch.has_ext_op(name)
    missing += [] if has else [name]
    print('  torch.ops.llmpar.' + name + ':', getattr(torch.ops.llmpar, name).default._schema, '[CUDA kernel]' if has else '[NO CUDA KERNEL]')
assert not missing, f'llmpar._C has no CUDA kernel for {missing}'
" "$order") || return 1
  done
}
step "import llmpar._C" check_import

echo
echo "---- timings ----"
printf '%s\n' "${TIMES[@]}"
printf '%-28s %4ds\n' "total" $((SECONDS - T0))
