"""Every environment variable is read through freetoken/envs.py, and docs/server.md lists each."""

from __future__ import annotations

import re
from pathlib import Path

from freetoken import envs

ROOT = Path(__file__).resolve().parents[1]


def declared() -> set[str]:
    return {value.name for value in vars(envs).values() if isinstance(value, envs.Env)} | {
        env.name for env in envs.ISA_CAPS}


def test_only_envs_reads_the_environment():
    readers = {path.relative_to(ROOT).as_posix() for path in (ROOT / "python" / "freetoken").rglob("*.py")
               if re.search(r"os\.(environ|getenv)", path.read_text())}
    assert readers == {"python/freetoken/envs.py"}


def test_docs_list_every_variable_declared():
    table = (ROOT / "docs" / "server.md").read_text().split("## Environment variables")[1].split("\n## ")[0]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", "".join(re.findall(r"^\| ([^|]+) \|", table, re.M))))
    assert documented == declared()


def test_an_empty_value_is_unset(monkeypatch):
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "")
    assert envs.HUGE_PAGES.get() is None
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "0")
    assert envs.HUGE_PAGES.get() == "0"
