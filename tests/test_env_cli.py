"""`llmpar env` and the command-line entry point."""

import json
import subprocess
import sys

import torch

from llmpar import cli, env_report


def test_env_report_collects_versions_devices_and_backends():
    data = env_report.collect()
    assert data["torch"] == torch.__version__
    assert data["devices"]["cuda_available"] == torch.cuda.is_available()
    assert data["distributed"]["available"] and data["distributed"]["gloo"] is True
    assert data["op_backends"]["torch"]["available"] is True
    text = env_report.format_report(data)
    for needle in ("llmpar environment", "torch", "distributed gloo", "op backend torch"):
        assert needle in text


def test_env_command_prints_json():
    out = subprocess.run(
        [sys.executable, "-m", "llmpar.cli", "env", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["llmpar"] and data["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")


def test_a_broken_subcommand_does_not_break_the_others(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("llmpar.env_report", "llmpar.no_such_module"))
    assert cli.main(["no_such_module"]) == 2
    assert "could not be imported" in capsys.readouterr().err
    parser = cli.build_parser()
    assert parser.parse_args(["env"]).command == "env"
