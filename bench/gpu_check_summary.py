"""summary.md of a bench/gpu_check.sh run, rendered from its work folder (after every step), and the env record.

    python3 bench/gpu_check_summary.py env WORK "SETTINGS"      # WORK/env.json: device, versions, date; prints them
    python3 bench/gpu_check_summary.py summary WORK DEST/summary.md

WORK holds steps.tsv (name, status, seconds, budget, what: one row per step of the plan, in order), env.json (device
and versions, from the env step), tools.txt (ninja, pytest-xdist and how the tests ran, after the wheels went in),
logs/<step>.log and results/ (bench tables *.md, train*.json). Standard library only: it must run even where torch
does not import. A test step killed at its limit has no pytest summary line: its counts then come from the -v lines
(one per finished test), so the summary still says which tests passed.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

_PYTEST = re.compile(r"(\d+ (passed|failed|skipped|errors?|deselected)|no tests ran).*in [\d.]+s")


def _steps(work: Path) -> list[dict]:
    rows = []
    path = work / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, budget, what = (line.split("\t") + [""] * 5)[:5]
        rows.append(dict(name=name, status=status, seconds=seconds, budget=budget, what=what))
    return rows


_VERBOSE = re.compile(
    r"(?:^|\] )(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+::\S+)|(\S+::\S+) "
    r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"
)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+::\S+)")


def _verbose_results(text: str) -> dict[str, str]:
    """test id -> outcome, from pytest -v lines (``path::test PASSED [ 5%]``, or with xdist ``[gw3] [ 5%] PASSED
    path::test``); the last outcome of an id wins (an error in teardown follows a pass)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _VERBOSE.search(line)
        if m:
            outcome, test = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            out[test] = outcome.lower()
    return out


def _pytest_line(log: Path) -> str | None:
    """pytest's own summary line; for a run killed before it, counts from the -v lines; then the failed tests."""
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    lines = [ln.strip("= \n") for ln in text.splitlines() if _PYTEST.search(ln)]
    results = _verbose_results(text)
    if lines:
        line = lines[-1]
    elif results:
        counts: dict[str, int] = {}
        for outcome in results.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        line = "killed before the end; finished so far (pytest -v lines): " + ", ".join(
            f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])
        )
    else:
        return None
    failed = sorted(
        {m.group(1) for m in map(_FAILED.match, text.splitlines()) if m}
        | {t for t, o in results.items() if o in ("failed", "error")}
    )
    if failed:
        line += f"; failed: {', '.join(failed[:8])}" + (f" (+{len(failed) - 8} more)" if len(failed) > 8 else "")
    return line


_FINDINGS = re.compile(r"(cuBLASLt's GELU epilogue is .*)$")


def _findings(logs: Path) -> list[str]:
    """Warnings the GPU tests raise to report what they measured (e.g. how far cuBLASLt's GELU epilogue is from
    tanh-GELU), once each, from every test log."""
    seen: list[str] = []
    for log in sorted(logs.glob("tests*.log")) if logs.exists() else []:
        for line in log.read_text(errors="replace").splitlines():
            m = _FINDINGS.search(line)
            if m and m.group(1) not in seen:
                seen.append(m.group(1))
    return seen[:5]


def _train(results: Path) -> list[str]:
    out = []
    for path in sorted(results.glob("train*.json")) if results.exists() else []:
        try:
            data = json.loads(path.read_text())
            losses = data.get("losses") or [float("nan")]
            tail = losses[-max(1, len(losses) // 20) :]
            out.append(
                f"- {path.stem}: demo GPT ({data.get('n_params', 0) / 1e6:.2f}M params, {data.get('dtype')}, "
                f"{data.get('engine')}, ZeRO-{data.get('zero_stage')}): {data.get('tokens_per_s', 0):,.0f} "
                f"tokens/s; loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} over {len(losses)} steps; peak "
                f"memory {data.get('mem_mb')} MiB ({data.get('mem_kind')}); wall {data.get('wall_s', 0):.1f} s"
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            out.append(f"- {path.name} unreadable: {exc}")
    return out


def _build_tools(work: Path, env: dict) -> str:
    """nvcc / CUDA toolkit (env.json), ninja and whether build_ext used it (its log), how the tests ran."""
    tools = {}
    if (work / "tools.txt").exists():
        for line in (work / "tools.txt").read_text(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            tools[key] = value
    log = work / "logs" / "build_ext.log"
    used = "build_ext did not run"
    if log.exists():
        text = log.read_text(errors="replace")
        if re.search(r"^\[\d+/\d+\] ", text, flags=re.M):
            used = "build_ext used it"
        elif "distutils backend" in text or "Ninja is required" in text:
            used = "NOT used by build_ext (slow serial build)"
        else:
            used = "build_ext log shows no ninja lines"
    return (
        f"- build: {env.get('cuda_toolkit', 'CUDA toolkit unknown (env step did not run)')}; "
        f"ninja {tools.get('ninja', 'unknown')} ({used}); tests: {tools.get('tests', 'not run')} "
        f"(pytest-xdist {tools.get('pytest-xdist', 'unknown')})"
    )


def render(work: Path) -> str:
    work = Path(work)
    env = {}
    if (work / "env.json").exists():
        try:
            env = json.loads((work / "env.json").read_text())
        except ValueError:
            env = {}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = [
        "# GPU check",
        "",
        f"- date: {env.get('date', now)} (summary written {now})",
        f"- device: {env.get('device', 'unknown (env step did not run)')}",
        f"- versions: {env.get('versions', 'unknown')}",
        _build_tools(work, env),
        f"- settings: {env.get('settings', '')}",
        "",
        "## Steps",
        "",
        "| step | status | time (s) | budget (s) | what |",
        "|---|---|---|---|---|",
    ]
    steps = _steps(work)
    for r in steps:
        out.append(f"| {r['name']} | {r['status']} | {r['seconds']} | {r['budget']} | {r['what']} |")
    skipped = [r["name"] for r in steps if r["status"].startswith("SKIPPED")]
    if skipped:
        out += ["", f"Skipped at the deadline: {', '.join(skipped)}."]
    tests = [
        (r["name"], _pytest_line(work / "logs" / f"{r['name']}.log")) for r in steps if r["name"].startswith("tests")
    ]
    tests = [(n, line) for n, line in tests if line]
    if tests:
        out += ["", "## Tests", ""] + [f"- {n}: {line}" for n, line in tests]
        out += [f"- finding: {w}" for w in _findings(work / "logs")]
    results = work / "results"
    figures = _train(results)
    tables = sorted(results.glob("*.md")) if results.exists() else []
    if figures or tables:
        out += ["", "## Figures", ""] + figures
        for table in tables:
            text = table.read_text(errors="replace").strip().splitlines()
            if text and text[0].startswith("# "):
                text[0] = "### " + text[0][2:]
            out += [""] + text
    return "\n".join(out) + "\n"


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cuda_toolkit() -> str:
    """nvcc's release line, and the toolkit torch's extension builder uses (CUDA_HOME, its version.json)."""
    nvcc = [ln for ln in _run(["nvcc", "--version"]).splitlines() if "release" in ln]
    text = f"nvcc {nvcc[-1].split('tools, ')[-1].strip() if nvcc else 'not on PATH'}"
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        home = Path(CUDA_HOME) if CUDA_HOME else None
    except Exception:  # noqa: BLE001 - torch missing or broken: say so below
        home = None
    if home is None:
        return text + "; CUDA_HOME not found"
    version = ""
    try:
        version = json.loads((home / "version.json").read_text()).get("cuda", {}).get("version", "")
    except (OSError, ValueError, AttributeError):
        pass
    if not version and (home / "version.txt").exists():
        version = (home / "version.txt").read_text(errors="replace").strip()
    if not version:
        version = _run([str(home / "bin" / "nvcc"), "--version"]).splitlines()[-1:] or ["version unknown"]
        version = version[0]
    return f"{text}; CUDA toolkit {version} at {home}"


def record_env(work: Path, settings: str) -> dict:
    """WORK/env.json: date, device (nvidia-smi and torch), versions (python, torch, its CUDA, triton), the CUDA toolkit
    that builds the extension (nvcc, CUDA_HOME), settings. A first env.json (date, python, settings) is written before
    the slow probes (the first torch import on a cold image, nvidia-smi, nvcc), so a step killed during them still
    leaves the date and settings (CUDA_HOME among them) for the summary."""
    versions = [f"python {platform.python_version()}"]
    device = "no CUDA device"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    early = {
        "date": date,
        "device": "unknown (the env step stopped before probing)",
        "versions": versions[0],
        "settings": settings,
    }
    (Path(work) / "env.json").write_text(json.dumps(early, indent=1) + "\n")
    try:
        import torch

        versions.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            device = (
                f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                f"{p.multi_processor_count} SMs, {torch.cuda.device_count()} device(s)"
            )
    except Exception as exc:  # noqa: BLE001 - the record must be written whatever breaks
        versions.append(f"torch not importable ({type(exc).__name__}: {exc})")
    try:
        import triton

        versions.append(f"triton {triton.__version__}")
    except Exception:  # noqa: BLE001
        versions.append("triton not importable")
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if smi:
        device += f"; nvidia-smi: {smi.splitlines()[0]}"
    env_cuda = _cuda_toolkit()
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    versions.append(f"llmpar commit {commit or 'unknown (no git here)'}")
    env = {
        "date": date,
        "device": device,
        "versions": ", ".join(versions),
        "cuda_toolkit": env_cuda,
        "settings": settings,
    }
    (Path(work) / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    return env


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "env":
        for key, value in record_env(Path(argv[1]), argv[2]).items():
            print(f"{key}: {value}")
        return 0
    if len(argv) == 3 and argv[0] == "summary":
        Path(argv[2]).write_text(render(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
