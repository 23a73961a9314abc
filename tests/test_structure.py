"""The package's shape: no import cycle (imports inside functions count). That ``import moh_dit``
and every command's help load no torch: tests/test_cli.py."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"moh_dit": ROOT / "moh_dit", "moh_dit.pipelines": ROOT / "pipelines"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules that ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        for target in targets:
            # `from moh_dit import x` names the package; resolve to the deepest module that exists
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ that re-exports its submodules is not a cycle with them: the edge
    # submodule -> its own package (e.g. `from . import x` resolved to the package) is ignored.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
