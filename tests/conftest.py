import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so that the ranks (and tests) can import multirank and helpers

from multirank import close_pools  # noqa: E402
from reference_runs import build_missing_ops, ds_extensions  # noqa: E402
from suite_rules import (  # noqa: E402,F401  (the suite's tiers and durations budget: hooks pytest finds here)
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_report_header,
    pytest_runtest_call,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)


@pytest.fixture(scope="session")
def ds_ext_dir(tmp_path_factory):
    """One TORCH_EXTENSIONS_DIR for every DeepSpeed process the session starts, its own, so that a build killed
    midway leaves its lock in this session's directory only. DeepSpeed JIT-builds its CPU ops (shm comm, cpu_adam:
    ~40 s of CPU each): the builds finished in an earlier session are copied in, those missing are built here, and
    the new ones kept for the next (tests/reference_runs.py ``ds_extensions``; ``LLMPAR_DS_EXT_CACHE=off`` builds
    afresh)."""
    with ds_extensions(tmp_path_factory.mktemp("ds_ext")) as path:
        build_missing_ops(path)  # a cold cache builds here, in a session fixture: not charged to a test's budget
        yield path


@pytest.fixture(scope="session", autouse=True)
def cpu_ext_built():
    """Build (or load) the CPU extension (csrc/cpu/: the ZeRO-Offload AdamW kernel) once, before the first test: on a
    fresh clone the JIT build (~20 s on 2 cores) then happens here, not inside the ranks of a timed multi-rank
    test. Its status (the kernel, or why the torch path runs) is in the session's log."""
    from llmpar.ops import _cpu_ext

    return _cpu_ext.load()


# what a launcher (torchrun, srun, mpirun) sets for a rank: a test that leaves any of them in the pytest process's
# environment makes every later test that starts a job believe it is a rank of a launched one
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
)


@pytest.fixture(autouse=True)
def launcher_environment_untouched(request):
    """Fail (at teardown) a test that leaves launcher variables set or changed in this process, and restore them."""
    before = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    changed = {k: (v, os.environ.get(k)) for k, v in before.items() if os.environ.get(k) != v}
    for k, (v, _) in changed.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if changed:
        pytest.fail(
            f"{request.node.nodeid} left launcher variables changed in the test process (before, after): "
            f"{changed}; restore them (monkeypatch.setenv / a try-finally)",
            pytrace=False,
        )


def pytest_sessionfinish(session, exitstatus):
    close_pools()
