"""Run a DeepSpeed script under torchrun with DeepSpeed itself or with llmpar as a drop-in:

    torchrun --nproc_per_node 2 tests/data/pipe_launch.py deepspeed|llmpar SCRIPT ARGS...

``llmpar``: the script's import lines are renamed mechanically and nothing else changes: ``import deepspeed`` becomes
``import llmpar as deepspeed``, ``from deepspeed.X import ...`` becomes ``from llmpar.X import ...`` and ``import
deepspeed.X as Y`` becomes ``import llmpar.X as Y``; the script runs as ``__main__``. ``deepspeed``: the script runs
as it is, on DeepSpeed's CPU accelerator, with its shared-memory comm op switched off (it would be JIT-compiled with a
C++ toolchain).
"""

import os
import re
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def rename(source: str) -> str:
    """The script with its DeepSpeed import lines renamed to llmpar's (module docstring)."""
    source = source.replace("\nimport deepspeed\n", "\nimport llmpar as deepspeed\n")
    source = re.sub(r"^(\s*)from deepspeed((?:\.\w+)*) import ", r"\1from llmpar\2 import ", source, flags=re.M)
    return re.sub(r"^(\s*)import deepspeed((?:\.\w+)+) as ", r"\1import llmpar\2 as ", source, flags=re.M)


def main():
    which, script, *args = sys.argv[1:]
    with open(script) as f:
        source = f.read()
    if which == "llmpar":
        if source.count("\nimport deepspeed\n") != 1:
            raise SystemExit(f"{script} must have one 'import deepspeed' line")
        source = rename(source)
    elif which == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        raise SystemExit(f"first argument must be 'deepspeed' or 'llmpar', got {which!r}")
    import torch

    torch.set_num_threads(1)
    sys.argv = [script, *args]
    exec(compile(source, script, "exec"), {"__name__": "__main__", "__file__": script})


if __name__ == "__main__":
    main()
