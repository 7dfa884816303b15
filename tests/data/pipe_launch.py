"""Run a DeepSpeed script under torchrun with DeepSpeed itself or with llmpar as a drop-in:

    torchrun --nproc_per_node 2 tests/data/pipe_launch.py deepspeed|llmpar SCRIPT ARGS...

``llmpar``: the script's ``import deepspeed`` line becomes ``import llmpar as deepspeed`` (the only change) and the
script runs as ``__main__``. ``deepspeed``: the script runs as it is, on DeepSpeed's CPU accelerator, with its
shared-memory comm op switched off (it would be JIT-compiled with a C++ toolchain).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main():
    which, script, *args = sys.argv[1:]
    with open(script) as f:
        source = f.read()
    if which == "llmpar":
        if source.count("\nimport deepspeed\n") != 1:
            raise SystemExit(f"{script} must have one 'import deepspeed' line")
        source = source.replace("\nimport deepspeed\n", "\nimport llmpar as deepspeed\n")
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
