"""`freetoken` / `ft`: the command list, --version, and `serve --help`."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import freetoken
from freetoken import cli

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_command_with_a_sentence(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: freetoken")
    for name, text in cli.COMMANDS.items():
        assert re.search(rf"^  {name}\s+\S.*\.", out, re.M), out
        assert text in out
    assert "--version" in out


def test_no_command_or_an_unknown_one_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().err
    assert cli.main(["srve"]) == 2
    assert "unknown command 'srve'" in capsys.readouterr().err


def test_version_is_the_package_version(capsys):
    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out.strip() == f"freetoken {metadata.version('freetoken')}"


def test_version_falls_back_to_the_source_tree(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.version() == freetoken.__version__


def test_source_version_matches_pyproject():
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared and freetoken.__version__ == declared.group(1)


@pytest.mark.parametrize("script", ["freetoken", "ft"])
def test_console_scripts_print_the_version(script):
    exe = Path(sys.executable).parent / script
    if not exe.exists():
        pytest.skip(f"{script} is not installed next to {sys.executable}")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"freetoken {cli.version()}"


def test_serve_help_shows_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "usage: freetoken serve" in out
    assert ("--shutdown-timeout SHUTDOWN_TIMEOUT seconds in-flight requests may finish after "
            "SIGTERM/SIGINT before they are ended with a 503 (default: 30.0)") in out
    assert "largest request body accepted; larger bodies get 413 (default: 33554432)" in out
    assert "most prompts one /v1/completions request may carry (default: 1024)" in out
