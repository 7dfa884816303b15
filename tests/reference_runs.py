"""DeepSpeed reference runs for the tests that compare llmpar with DeepSpeed: run live, or read from golden files.

A test module declares its references once::

    REFERENCES = References("cifar", run=deepspeed_record, cases={"0": config(0), ...}, live={"2"},
                            sources=["tests/data/cifar_script.py"], packages=("deepspeed", "torch"), same=compare)
    theirs = REFERENCES.get("3", tmp_path, ds_ext_dir)

``run(case, spec, tmp, ext)`` launches DeepSpeed (``ext``: the TORCH_EXTENSIONS_DIR) and returns a JSON record. A case
in ``live`` runs DeepSpeed now, every time, and ``same(case, live, golden)`` checks it against its golden file: those
goldens still equal what DeepSpeed gives here, and the others were made the same way. The other cases read
``tests/golden/<suite>/<case>.json`` (the record, the spec and the sources it came from, the versions of
``packages``). When the installed versions differ from the golden's (``make test-latest`` installs DeepSpeed's
newest release), those cases run DeepSpeed live too. A golden made from another spec or other sources (the script
was edited) fails the test naming ``make golden``. ``LLMPAR_GOLDEN=live`` runs every case live.

``make golden`` (``python tests/reference_runs.py [suite ...]``) runs every case of the suites in :data:`SUITES` with
the installed DeepSpeed and writes their golden files.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GOLDEN = TESTS / "golden"
# suite -> the test module whose REFERENCES it is (what `make golden` refreshes)
SUITES = {
    "hf_trainer": "test_hf_trainer",
    "cifar": "test_deepspeed_scripts",
    "pipe_compat": "test_pipe_compat",
    "ds_moe": "checkpoint.test_checkpoint_ds_moe",
}
log = logging.getLogger("llmpar")


class StaleGolden(AssertionError):
    """A golden file made from other sources or another spec than the test's."""


def versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class References:
    """The DeepSpeed references of one test module (see the module docstring)."""

    def __init__(
        self,
        suite: str,
        *,
        run: Callable[[str, Any, Path, Path], dict],
        cases: dict[str, Any],
        live: set[str],
        sources: list[str],
        packages: tuple[str, ...],
        same: Callable[[str, dict, dict], None],
    ) -> None:
        unknown = set(live) - set(cases)
        if unknown:
            raise ValueError(f"live cases {sorted(unknown)} are not among the cases {sorted(cases)}")
        self.suite, self.run, self.cases, self.live = suite, run, cases, set(live)
        self.sources, self.packages, self.same = list(sources), tuple(packages), same

    def path(self, case: str) -> Path:
        return GOLDEN / self.suite / f"{case}.json"

    def fingerprint(self, case: str) -> dict:
        """What a golden of ``case`` must have been made from: the spec, and each source file's sha256."""
        spec = json.loads(json.dumps(self.cases[case]))  # tuples as lists, as stored
        return {"spec": spec, "sources": {s: _sha256(ROOT / s) for s in self.sources}}

    def golden(self, case: str) -> dict | None:
        """The stored golden of ``case`` (None if there is none); StaleGolden if it was made from other inputs."""
        path = self.path(case)
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        want = self.fingerprint(case)
        if {k: data.get(k) for k in want} != want:
            changed = [k for k in want["sources"] if data.get("sources", {}).get(k) != want["sources"][k]]
            what = f"sources {changed} changed" if changed else "its spec changed"
            raise StaleGolden(
                f"{path.relative_to(ROOT)} was made from other inputs ({what} since): run `make golden` "
                f"(python tests/reference_runs.py {self.suite}) with DeepSpeed installed and commit the files"
            )
        return data

    def get(self, case: str, tmp: Path, ext: Path) -> dict:
        """DeepSpeed's record of ``case``: live for the live cases (checked against their golden) and when the
        installed versions are not the golden's, else the golden's."""
        if case not in self.cases:
            raise KeyError(f"{self.suite} has no case {case!r} (cases: {sorted(self.cases)})")
        golden = self.golden(case)
        here = versions(self.packages)
        missing = sorted(name for name, v in here.items() if v is None)
        moved = golden is not None and golden["versions"] != here and not missing
        live = case in self.live or os.environ.get("LLMPAR_GOLDEN", "").lower() == "live" or moved
        if golden is None and not live:
            raise AssertionError(f"no golden file {self.path(case).relative_to(ROOT)}: run `make golden`")
        if live:
            if missing:
                import pytest

                pytest.skip(f"{missing} not installed: DeepSpeed's {self.suite}/{case} cannot run live")
            if moved and case not in self.live:
                log.warning("%s/%s: golden made with %s, here %s: run live", self.suite, case, golden["versions"], here)
            record = self.run(case, self.cases[case], tmp, ext)
            if golden is not None and golden["versions"] == here:
                try:
                    self.same(case, record, golden["record"])
                except AssertionError as err:
                    raise AssertionError(
                        f"DeepSpeed's live run of {self.suite}/{case} differs from its golden file "
                        f"{self.path(case).relative_to(ROOT)} (made with the same versions): the goldens are not what "
                        f"DeepSpeed gives here; refresh them with `make golden`\n{err}"
                    ) from err
            return record
        return golden["record"]

    def refresh(self, ext: Path) -> list[Path]:
        """Run every case live and write its golden file."""
        written = []
        for case, spec in self.cases.items():
            with tempfile.TemporaryDirectory(prefix=f"golden-{self.suite}-{case}-") as tmp:
                record = self.run(case, spec, Path(tmp), ext)
            data = {
                "suite": self.suite,
                "case": case,
                "made_by": f"make golden (python tests/reference_runs.py {self.suite})",
                "date": datetime.date.today().isoformat(),
                "versions": versions(self.packages),
                "python": platform.python_version(),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                **self.fingerprint(case),
                "record": record,
            }
            path = self.path(case)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1) + "\n")
            written.append(path)
            print(f"wrote {path.relative_to(ROOT)}", flush=True)
        return written


# ------------------------------------------------------------------- DeepSpeed's op builds, kept between sessions


def ds_ext_cache() -> Path | None:
    """Where finished DeepSpeed op builds are kept between sessions: ``$LLMPAR_DS_EXT_CACHE`` (default
    ``~/.cache/llmpar/ds_ext``; ``off`` keeps none), one folder per Python environment and torch / DeepSpeed
    version; None without DeepSpeed."""
    root = os.environ.get("LLMPAR_DS_EXT_CACHE", str(Path.home() / ".cache" / "llmpar" / "ds_ext"))
    if root.lower() in ("", "0", "off", "no"):
        return None
    v = versions(("deepspeed", "torch"))
    if v["deepspeed"] is None:
        return None
    env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    return Path(root) / f"py{sys.version_info[0]}{sys.version_info[1]}-torch{v['torch']}-ds{v['deepspeed']}-{env}"


def finished_builds(root: Path) -> list[Path]:
    """The op folders under ``root`` whose build finished: a shared library, and no lock (a build under way, or one
    killed midway, leaves ``lock`` behind)."""
    if not root.is_dir():
        return []
    return [d for d in root.iterdir() if d.is_dir() and not (d / "lock").exists() and any(d.glob("*.so"))]


def _publish(build: Path, cache: Path) -> None:
    """Copy one finished op folder into the cache, replacing an older build of it: copied aside, then renamed in, so
    a session reading the cache meanwhile sees the old build or the new one, never half of one."""
    target = cache / build.name

    def stamp(folder: Path) -> list:
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.glob("*.so"))]

    if target.is_dir() and stamp(target) == stamp(build):
        return
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{build.name}-", dir=cache))
    try:
        shutil.copytree(build, tmp / build.name)  # copy2: the mtimes ninja compares come along
        if target.exists():
            target.rename(tmp / "old")
        (tmp / build.name).rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def ds_extensions(path: Path) -> Iterator[Path]:
    """``path`` as a TORCH_EXTENSIONS_DIR of its own, seeded with the cached finished builds; the builds finished
    in it are cached on exit. ninja, which torch runs on every load, rebuilds a copied op whose sources, flags or
    compiler command changed."""
    cache = ds_ext_cache()
    for build in finished_builds(cache) if cache else []:
        try:
            shutil.copytree(build, path / build.name)
        except OSError:  # replaced meanwhile by another session: built here instead
            shutil.rmtree(path / build.name, ignore_errors=True)
    yield path
    for build in finished_builds(path) if cache else []:
        try:
            _publish(build, cache)
        except OSError as err:  # a read-only or full cache: the next session builds again
            log.warning("DeepSpeed op build %s not cached: %s", build.name, err)


# the DeepSpeed ops its CPU runs here build (builder name -> folder): DeepSpeed's shared-memory collectives, and the
# CPU Adam of the offload cases
DS_OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "CPUAdamBuilder": "cpu_adam"}


def build_missing_ops(path: Path) -> list[str]:
    """JIT-build the :data:`DS_OPS` that ``path`` (a TORCH_EXTENSIONS_DIR) lacks, in a subprocess (~40 s of CPU each
    on 2 cores; nothing when the cache seeded them). Returns the ops built; a failed build is logged and left to the
    run that needs the op."""
    missing = [name for name, folder in DS_OPS.items() if not any((path / folder).glob("*.so"))]
    if not missing or versions(("deepspeed",))["deepspeed"] is None:
        return []
    code = "from deepspeed.accelerator import get_accelerator\n" + "".join(
        f"get_accelerator().create_op_builder({name!r}).load()\n" for name in missing
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=path, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        log.warning("DeepSpeed ops %s not built ahead (the runs build them): %s", missing, proc.stderr[-2000:])
        return []
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Refresh the golden DeepSpeed references (tests/golden/).")
    ap.add_argument("suites", nargs="*", help=f"default: all of {sorted(SUITES)}")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.suites) - set(SUITES))
    if unknown:
        ap.error(f"unknown suites {unknown}: choose from {sorted(SUITES)}")
    sys.path.insert(0, str(TESTS))

    if versions(("deepspeed",))["deepspeed"] is None:
        print("DeepSpeed is not installed: the golden references need it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="golden-ext-") as tmp, ds_extensions(Path(tmp)) as ext:
        for suite in a.suites or list(SUITES):
            module = importlib.import_module(SUITES[suite])
            module.REFERENCES.refresh(ext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
