"""The package's import graph, read off the source (ast), imports inside functions included: no
module reaches itself, and the engine and scheduler reach models/ through its registry alone."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "freetoken"
# The package's layers, bottom to top (docs/architecture.md draws them): a module imports only from
# its own unit (a top-level module, a package, or a group of serving/) or from a layer below.
LAYERS = [
    {"envs"},
    {"paths", "config"},
    {"core"},
    {"message"},
    {"tokenizer", "structured", "parsing"},
    {"kvcache"},
    {"kernels"},
    {"layers"},
    {"distributed"},
    {"hub"},
    {"models"},
    {"engine"},
    {"scheduler"},
    {"llm", "serving"},
    {"serving.openai"},
    {"serving.pooling"},
    {"serving.adapters"},
    {"serving.playground"},
    {"serving.app"},
    {"serving.launch"},
    {"freetoken", "server"},
    {"cli"},
    {"__main__"},
]
# What engine/ and scheduler/ may import from models/: the registry (the table, load_model,
# LoadedModel). Everything a model and the engine exchange per step lives outside models/.
MODELS_INTERFACE = {"freetoken.models.registry"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str], root: Path = PACKAGE, typing: bool = False) -> set[str]:
    """The package's modules `path` imports anywhere in its body, relative imports resolved
    (`from a import b` counts as a.b where that is a module, else as a); `typing`: those under
    `if TYPE_CHECKING:` too."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (ast.walk(tree) if typing else _runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    edges = set()
    for target in found:
        # `import a.b.c` loads a and a.b too, but their bodies cannot import a.b.c back
        # without already being a cycle through it; the module itself is the edge.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and target.startswith("freetoken"):
            edges.add(target)
    return edges


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`, which only type checkers import."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules, typing=typing) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    root = tmp_path / "freetoken"
    (root / "x").mkdir(parents=True)
    source = root / "x" / "mod.py"
    source.write_text("from . import b\nfrom .c import f\nif TYPE_CHECKING:\n    import freetoken.d\n\n"
                      "def g():\n    import freetoken.d.e\n")
    modules = {"freetoken.x.mod", "freetoken.x.b", "freetoken.x.c", "freetoken.d", "freetoken.d.e"}
    assert imported(source, modules, root) == {"freetoken.x.b", "freetoken.x.c", "freetoken.d.e"}
    assert imported(source, modules, root, typing=True) == {"freetoken.x.b", "freetoken.x.c", "freetoken.d",
                                                            "freetoken.d.e"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_no_import_cycle_through_typing_only_imports_either():
    """A circle that only type checkers walk still says two modules each need the other."""
    assert find_cycle(import_graph(typing=True)) is None


def unit(module: str) -> str:
    """The unit of LAYERS a module belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "freetoken"
    if parts[1] == "serving" and len(parts) > 2 and f"serving.{parts[2]}" in set().union(*LAYERS):
        return f"serving.{parts[2]}"
    return parts[1]


def test_every_import_points_down_the_declared_layers():
    level = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = import_graph(typing=True)
    assert {unit(module) for module in graph} <= set(level), "a unit missing from LAYERS"
    upward = sorted((module, target) for module, targets in graph.items() for target in targets
                    if unit(module) != unit(target) and level[unit(target)] >= level[unit(module)])
    assert upward == []


def test_engine_and_scheduler_reach_models_through_the_registry_only():
    reached = {(module, target) for module, targets in import_graph().items()
               if module.startswith(("freetoken.engine", "freetoken.scheduler"))
               for target in targets
               if target.startswith("freetoken.models") and target not in MODELS_INTERFACE}
    assert reached == set()


def test_no_test_module_imports_another():
    """tests/README.md's rule: shared helpers live in tests/support, tests/fixtures and
    tests/model_fixtures.py, so that a test module is never run (its fixtures collected) twice."""
    tests = PACKAGE.parents[1] / "tests"
    imports = {}
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("tests.") and name.rpartition(".")[2].startswith("test_"):
                    imports.setdefault(path.relative_to(tests).as_posix(), []).append(name)
    assert imports == {}
