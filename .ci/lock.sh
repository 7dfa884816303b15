#!/usr/bin/env bash
# Print constraints.txt: the versions installed in a venv made from the newest releases (`make lock`).
# torch and what its build pins (triton, nvidia-*, cuda-*) are left out: the TORCH pin of the Makefile chooses them,
# and a GPU machine's torch needs its own.
set -euo pipefail
py=$1
torch_pin=$2
echo "# Known-good versions for llmpar's installs (make demo / make test / CI): pip install -c constraints.txt."
echo "# Written by \`make lock\` on $(date -u +%Y-%m-%d) with $("$py" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])') and $torch_pin;"
echo "# refresh it on purpose, in a commit of its own, after \`make test-latest\` passes. torch, triton, nvidia-* and"
echo "# cuda-* are left out (the TORCH pin chooses them; the Makefile's TRITON pins triton for the CPU build)."
echo "# triton found here: $("$py" -m pip show triton 2>/dev/null | sed -n 's/^Version: //p')"
"$py" -m pip freeze --exclude-editable --disable-pip-version-check \
  | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|pip|setuptools|wheel)([=@ ]|$)' \
  | LC_ALL=C sort -f
