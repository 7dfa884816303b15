import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so that the ranks (and tests) can import multirank and helpers

from multirank import close_pools  # noqa: E402


@pytest.fixture(scope="session")
def ds_ext_dir(tmp_path_factory):
    """One TORCH_EXTENSIONS_DIR for every DeepSpeed process the session starts: DeepSpeed JIT-builds its CPU ops
    (shm comm, cpu_adam: ~40 s each) once, not once per test; a build killed midway leaves its lock in this
    session's directory only."""
    return tmp_path_factory.mktemp("ds_ext")


@pytest.fixture(scope="session", autouse=True)
def cpu_ext_built():
    """Build (or load) the CPU extension (csrc/cpu/: the ZeRO-Offload AdamW kernel) once, before the first test: on a
    fresh clone the JIT build (~20 s on 2 cores) then happens here, not inside the ranks of a timed multi-rank
    test. Its status (the kernel, or why the torch path runs) is in the session's log."""
    from llmpar.ops import _cpu_ext

    return _cpu_ext.load()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    close_pools()
