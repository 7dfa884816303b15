"""summary.md of a bench/gpu_check.sh run, rendered from its work folder (after every step), and the env record.

    python3 bench/gpu_check_summary.py env WORK "SETTINGS"      # WORK/env.json: device, versions, date; prints them
    python3 bench/gpu_check_summary.py summary WORK DEST/summary.md

WORK holds steps.tsv (name, status, seconds, budget, what: one row per step of the plan, in order), env.json (device
and versions, from the env step), logs/<step>.log and results/ (bench tables *.md, train.json). Standard library only:
it must run even where torch does not import.
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


def _pytest_line(log: Path) -> str | None:
    if not log.exists():
        return None
    lines = [ln.strip("= \n") for ln in log.read_text(errors="replace").splitlines() if _PYTEST.search(ln)]
    return lines[-1] if lines else None


def _train(results: Path) -> list[str]:
    path = results / "train.json"
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        losses = data.get("losses") or [float("nan")]
        tail = losses[-max(1, len(losses) // 20):]
        return [f"- demo GPT ({data.get('n_params', 0) / 1e6:.2f}M params, {data.get('dtype')}, {data.get('engine')}, "
                f"ZeRO-{data.get('zero_stage')}): {data.get('tokens_per_s', 0):,.0f} tokens/s; loss {losses[0]:.3f} "
                f"-> {sum(tail) / len(tail):.3f} over {len(losses)} steps; peak memory {data.get('mem_mb')} MiB "
                f"({data.get('mem_kind')}); wall {data.get('wall_s', 0):.1f} s"]
    except (ValueError, TypeError, KeyError) as exc:
        return [f"- train.json unreadable: {exc}"]


def render(work: Path) -> str:
    work = Path(work)
    env = {}
    if (work / "env.json").exists():
        try:
            env = json.loads((work / "env.json").read_text())
        except ValueError:
            env = {}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = ["# GPU check", "", f"- date: {env.get('date', now)} (summary written {now})",
           f"- device: {env.get('device', 'unknown (env step did not run)')}",
           f"- versions: {env.get('versions', 'unknown')}",
           f"- settings: {env.get('settings', '')}", "", "## Steps", "",
           "| step | status | time (s) | budget (s) | what |", "|---|---|---|---|---|"]
    steps = _steps(work)
    for r in steps:
        out.append(f"| {r['name']} | {r['status']} | {r['seconds']} | {r['budget']} | {r['what']} |")
    skipped = [r["name"] for r in steps if r["status"].startswith("SKIPPED")]
    if skipped:
        out += ["", f"Skipped at the deadline: {', '.join(skipped)}."]
    tests = [(r["name"], _pytest_line(work / "logs" / f"{r['name']}.log")) for r in steps
             if r["name"].startswith("tests")]
    tests = [(n, line) for n, line in tests if line]
    if tests:
        out += ["", "## Tests", ""] + [f"- {n}: {line}" for n, line in tests]
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


def record_env(work: Path, settings: str) -> dict:
    """WORK/env.json: date, device (nvidia-smi and torch), versions (python, torch, CUDA, triton, nvcc, driver)."""
    versions = [f"python {platform.python_version()}"]
    device = "no CUDA device"
    try:
        import torch

        versions.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            device = (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                      f"{p.multi_processor_count} SMs, {torch.cuda.device_count()} device(s)")
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
    nvcc = _run(["nvcc", "--version"]).splitlines()
    versions.append(f"nvcc {nvcc[-1].split(',')[0] if nvcc else 'not found'}")
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    versions.append(f"llmpar commit {commit or 'unknown (no git here)'}")
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device,
           "versions": ", ".join(versions), "settings": settings}
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
