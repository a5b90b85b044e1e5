"""docs/architecture.md's module table names every module of the package, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "freetoken"


def _modules() -> set[str]:
    """Source files as paths under python/freetoken/; an empty __init__.py is no module."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*")
            if path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts
            and not (path.name == "__init__.py" and not path.read_text().strip())}


def test_the_module_table_lists_exactly_the_packages_modules():
    rows = re.findall(r"^\| `([\w/]+\.(?:py|c|h))` \|", (ROOT / "docs" / "architecture.md").read_text(),
                      flags=re.M)
    assert len(rows) == len(set(rows)), "a module listed twice"
    assert sorted(_modules() - set(rows)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(rows) - _modules()) == [], "docs/architecture.md lists modules that are gone"


def test_the_request_walks_name_files_that_exist():
    """"A request's path" walks a chat and a scoring request through the layout: every file it
    names is one of the package's."""
    walk = (ROOT / "docs" / "architecture.md").read_text().split("## A request's path")[1].split("\n## ")[0]
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", walk))
    assert len(named) >= 12
    assert sorted(name for name in named if not (PACKAGE / name).is_file()) == []
