#!/usr/bin/env bash
# The Python wheels bench/gpu_check.sh needs on a GPU machine that cannot reach a package registry: pytest-xdist (the
# GPU test steps fit their budgets only on parallel workers) and execnet, pytest-timeout (a hung test becomes a failure
# inside the step's budget), ninja (setup.py compiles the CUDA extension in ~20-30 s with it, 80-90 s without), and
# pytest with its own needs in case the image lacks it. Pinned, for CPython 3.12 on x86-64 Linux (the GPU image's).
#
#   bash bench/gpu_wheelhouse.sh                  here (network): download them into .gpu-wheelhouse/ (~2 MB; ignored
#                                                 by git: name it in the device tool's `carry` so it travels)
#   bash bench/gpu_wheelhouse.sh --install SITE   there (offline): install the ones $PYTHON lacks into SITE with
#                                                 pip --no-index --no-deps --target; the caller puts SITE on PYTHONPATH
#                                                 and SITE/bin on PATH (bench/gpu_check.sh's env step does)
#   bash bench/gpu_wheelhouse.sh --status         what $PYTHON has of them, and what the wheelhouse holds
# Env: PYTHON (python3), GPU_CHECK_WHEELHOUSE (the folder, default .gpu-wheelhouse/ at the repository root).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELHOUSE="${GPU_CHECK_WHEELHOUSE:-$ROOT/.gpu-wheelhouse}"
# distribution==version|how to tell it is there (a module to import, or "bin:NAME" for a program on PATH)
WHEELS=(
  "pytest-xdist==3.8.0|xdist"
  "execnet==2.1.2|execnet"
  "pytest-timeout==2.4.0|pytest_timeout"
  "ninja==1.13.2|bin:ninja"
  "pytest==9.2.0|pytest"
  "iniconfig==2.3.1|iniconfig"
  "pluggy==1.7.0|pluggy"
  "packaging==26.4|packaging"
  "pygments==2.19.2|pygments"
)

has() {  # has PROBE: 0 when $PY (or PATH) has it
  local probe="$1"
  if [[ "$probe" == bin:* ]]; then command -v "${probe#bin:}" >/dev/null 2>&1; return; fi
  "$PY" -c "import $probe" >/dev/null 2>&1
}

wheel_of() {  # wheel_of DIST==VERSION: the file in the wheelhouse, or nothing
  local dist="${1%%==*}" version="${1##*==}"
  compgen -G "$WHEELHOUSE/${dist//-/_}-${version}-*.whl" | head -n 1
}

download() {
  mkdir -p "$WHEELHOUSE"
  local specs=() row
  for row in "${WHEELS[@]}"; do specs+=("${row%%|*}"); done
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$WHEELHOUSE" "${specs[@]}" || { echo "gpu_wheelhouse.sh: pip download failed" >&2; return 1; }
  local missing=0
  for row in "${WHEELS[@]}"; do
    [[ -n "$(wheel_of "${row%%|*}")" ]] || { echo "gpu_wheelhouse.sh: no wheel for ${row%%|*}" >&2; missing=1; }
  done
  echo "gpu_wheelhouse.sh: ${#WHEELS[@]} wheels in ${WHEELHOUSE#"$ROOT"/} ($(du -sh "$WHEELHOUSE" | cut -f1))"
  return "$missing"
}

install() {  # install SITE
  local site="$1" row spec probe file todo=() names=()
  for row in "${WHEELS[@]}"; do
    spec="${row%%|*}"; probe="${row##*|}"
    if has "$probe"; then echo "  ${spec%%==*}: already there"; continue; fi
    file="$(wheel_of "$spec")"
    if [[ -z "$file" ]]; then echo "  ${spec%%==*}: MISSING (no wheel in ${WHEELHOUSE#"$ROOT"/})"; continue; fi
    todo+=("$file"); names+=("${spec%%==*}")
  done
  if (( ${#todo[@]} == 0 )); then echo "gpu_wheelhouse.sh: nothing to install"; return 0; fi
  mkdir -p "$site"
  if "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
       --target "$site" "${todo[@]}"; then
    echo "gpu_wheelhouse.sh: installed offline into $site: ${names[*]}"
  else
    echo "gpu_wheelhouse.sh: pip install from the wheelhouse failed" >&2
    return 1
  fi
}

status() {
  local row
  echo "wheelhouse: ${WHEELHOUSE#"$ROOT"/} ($(compgen -G "$WHEELHOUSE/*.whl" | wc -l) wheels)"
  for row in "${WHEELS[@]}"; do
    printf '  %-24s python: %-8s wheel: %s\n' "${row%%|*}" "$(has "${row##*|}" && echo yes || echo no)" \
      "$(basename "$(wheel_of "${row%%|*}")" 2>/dev/null || true)"
  done
}

case "${1:-}" in
  "") download ;;
  --install) install "${2:?--install needs the folder to install into}" ;;
  --status) status ;;
  -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" ;;
  *) echo "gpu_wheelhouse.sh: unknown argument $1 (none, --install SITE, --status)" >&2; exit 2 ;;
esac
