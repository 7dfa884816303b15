"""The GPU tests (``pytest -m gpu``, run by bench/gpu_check.sh on a GPU machine) replayed on the CPU by the plugin
tests/gpu_replay.py: every GPU test body runs here with its CUDA ops replaced by their CPU references, so a mistake
in a body's argument flow (a tensor left over from a loop handed to ``opcheck``, a wrong shape) fails here, in
`make test`, instead of on a GPU lease."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def gpu_test_files() -> list[Path]:
    """The files bench/gpu_check.sh hands to ``pytest -m gpu`` (its grep: those that use the mark)."""
    mark = re.compile(r"^ *(@pytest\.mark\.gpu|[A-Za-z_]+ = pytest\.mark\.gpu)", re.M)
    return [p for p in sorted((ROOT / "tests").glob("test_*.py")) if mark.search(p.read_text())]


def test_gpu_tests_replay_on_cpu(tmp_path):
    """Every GPU test function, each value of each of its parameters at least once, passes on the CPU references."""
    files = gpu_test_files()
    assert {"test_ops_bucket.py", "test_ops_gemm_ext.py", "test_ops_quant.py"} <= {f.name for f in files}, files
    xml = tmp_path / "replay.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    for var in ("LLMPAR_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "gpu_replay",
            "-m",
            "gpu",
            "-rfEs",
            f"--junitxml={xml}",
            *map(str, files),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT / "tests",
    )
    out = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert xml.exists(), out
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    outcome = {f"{c.get('classname')}::{c.get('name')}": next((ch.tag for ch in c), "passed") for c in cases}
    bad = {k: v for k, v in outcome.items() if v != "passed"}
    assert not bad, f"GPU tests that do not replay on CPU: {bad}\n{out}"
    functions = {k.split("[", 1)[0] for k in outcome}
    assert len(functions) >= 11, (sorted(functions), out)  # 7 in test_ops_gemm_ext, 2 in _bucket, 2 in _quant
    assert proc.returncode == 0, out


def _item(name: str, **params):
    return SimpleNamespace(
        nodeid=f"t.py::{name}[{'-'.join(map(str, params.values()))}]", callspec=SimpleNamespace(params=params)
    )


def test_covering_cases_keep_every_function_and_value():
    from gpu_replay import covering_cases

    grid = [_item("f", act=a, dtype=d, m=m) for a in "abcde" for d in ("x", "y", "z") for m in (5, 257)]
    plain = SimpleNamespace(nodeid="t.py::g", callspec=None)
    keep = covering_cases([*grid, plain])
    assert plain in keep
    kept = [i for i in keep if i is not plain]
    for key, values in (("act", "abcde"), ("dtype", "xyz"), ("m", (5, 257))):
        assert {i.callspec.params[key] for i in kept} == set(values), key
    assert len(kept) == 5, "five cases cover five activations, three dtypes and two shapes"
