"""One-file copies of the package's modules, for pipeline folders that carry their own code.

diffusers loads a custom pipeline or component from a ``.py`` file inside the folder it
loads (``trust_remote_code=True``). It copies only the *direct* relative imports of that
file next to it (the imports of those imports are not followed for local folders), and from
a Hub repository it downloads only the component's own file from a model subfolder. So each
file that travels with an exported folder must stand alone: :func:`bundle_module` writes a
module and every module of the package it imports, transitively, into one source text,
dependencies first, with their imports of one another removed.

The text is the package's own source, line for line, apart from those import lines; nothing
is hand-maintained. Two modules that define the same top-level name differently cannot
share one namespace, so that is an error here rather than a silent override.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BundleError", "Bundle", "bundle_module", "package_imports"]

PACKAGE = "moh_dit"


class BundleError(ValueError):
    """The modules cannot be joined into one file (a name clash, an unsupported import)."""


@dataclass(frozen=True)
class Bundle:
    """A bundled module: its source text and the package modules in it, in order."""

    source: str
    modules: tuple[str, ...]


def _module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise BundleError(f"cannot find the source file of {name}; bundling needs the package's .py files.")
    return Path(spec.origin)


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def _import_target(node: ast.ImportFrom, module: str) -> str | None:
    """The absolute module an ``ImportFrom`` in ``module`` reads from, if it is in the package."""
    if node.level:
        base = module.split(".")
        if _is_package(module):
            base.append("")  # a package's own level-1 imports are relative to itself
        parent = ".".join(base[: len(base) - node.level])
        target = f"{parent}.{node.module}" if node.module else parent
    else:
        target = node.module or ""
    return target if target == PACKAGE or target.startswith(PACKAGE + ".") else None


def package_imports(name: str, tree: ast.Module | None = None) -> list[tuple[ast.stmt, str]]:
    """Every import statement of module ``name`` (at any depth; from ``tree``, its parsed
    source, if given) that reads from the package, with the module it reads from.
    ``import moh_dit...`` and ``from moh_dit import x`` are refused: they bind a package
    object that a single file cannot provide."""
    if tree is None:
        tree = ast.parse(_module_file(name).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == PACKAGE or a.name.startswith(PACKAGE + ".") for a in node.names):
                raise BundleError(f"{name}, line {node.lineno}: `import {PACKAGE}...` cannot be bundled; "
                                  "use `from .module import name`.")
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(node, name)
            if target is None:
                continue
            if target == PACKAGE or _is_package(target):
                raise BundleError(f"{name}, line {node.lineno}: importing from the package {target} itself cannot "
                                  "be bundled; import from the module that defines the name.")
            found.append((node, target))
    return found


def _dependency_order(entry: str) -> list[str]:
    """``entry`` and the package modules it needs, each after the modules it imports."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise BundleError(f"import cycle through {name}; a bundle needs an order of definition.")
        visiting.add(name)
        for _, target in package_imports(name):
            visit(target)
        visiting.discard(name)
        order.append(name)

    visit(entry)
    return order


def _bindings(tree: ast.Module, skip: set[int]) -> dict[str, str]:
    """Top-level names a module binds -> what binds them (an import's source, or a definition)."""
    names: dict[str, str] = {}

    def scan(body: list[ast.stmt]) -> None:
        for node in body:
            if id(node) in skip:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = f"definition line {node.lineno}"
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names[leaf.id] = f"assignment line {node.lineno}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = f"import {a.name}"
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for a in node.names:
                    names[a.asname or a.name] = f"from {'.' * node.level}{node.module} import {a.name}"
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, part, []):
                        scan(child.body if isinstance(child, ast.ExceptHandler) else [child])

    scan(tree.body)
    names.pop("__all__", None)
    return names


def _strip_imports(source: str, name: str, imports: list[tuple[ast.stmt, str]], tree: ast.Module) -> str:
    """``source`` without its package imports and its ``from __future__`` line. An import that
    renames (``import a as b``) leaves ``b = a``; one inside a block leaves ``pass``."""
    lines = source.splitlines()
    edits = [(node, None) for node in tree.body
             if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
    edits += [(node, target) for node, target in imports]
    top = {id(node) for node in tree.body}
    for node, _ in sorted(edits, key=lambda e: -e[0].lineno):
        first, last = node.lineno - 1, node.end_lineno - 1
        if lines[first][: node.col_offset].strip() or lines[last][node.end_col_offset:].strip():
            raise BundleError(f"{name}, line {node.lineno}: an import shares its line with other code.")
        aliases = [f"{a.asname} = {a.name}" for a in getattr(node, "names", []) if a.asname and a.asname != a.name]
        if not aliases and id(node) not in top:
            aliases = ["pass"]
        lines[first : last + 1] = [" " * node.col_offset + text for text in aliases]
    return "\n".join(lines).rstrip() + "\n"


def _exported_names(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def bundle_module(entry: str, version: str = "") -> Bundle:
    """Module ``entry`` of the package and every package module it imports, as one source text.

    Modules come dependencies first, each under a comment naming its file; their imports of
    one another (and their ``from __future__`` lines, replaced by one at the top) are removed,
    and ``__all__`` is the union of theirs. Raises :class:`BundleError` if two modules bind
    the same top-level name differently, or an import cannot be resolved to a module.
    """
    order = _dependency_order(entry)
    seen: dict[str, tuple[str, str]] = {}
    parts, exported = [], []
    for name in order:
        path = _module_file(name)
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        imports = package_imports(name, tree)
        for bound, how in _bindings(tree, {id(node) for node, _ in imports}).items():
            earlier = seen.get(bound)
            if earlier is not None and (earlier[1] != how or not how.startswith(("import", "from"))):
                raise BundleError(f"{name} and {earlier[0]} both define the top-level name {bound!r} "
                                  f"({how}; {earlier[1]}); rename one so that they can share one file.")
            seen[bound] = (name, how)
        exported += [n for n in _exported_names(tree) if n not in exported]
        shown = f"{PACKAGE}/{path.relative_to(_module_file(PACKAGE).parent)}" if path.is_relative_to(
            _module_file(PACKAGE).parent) else path.name
        parts.append(f"# {'=' * 86}\n# {name} ({shown})\n# {'=' * 86}\n\n" + _strip_imports(source, name, imports, tree))
    names = ", ".join(order)
    header = (
        f'"""{order[-1]} and the modules it imports, in one file, generated by moh_dit.hub.bundle'
        f"{f' (moh-dit {version})' if version else ''}.\n\n"
        f"Modules, in order: {names}.\nEach is the package's source with its imports of the others removed, so that "
        "diffusers can load\nthis file by itself (trust_remote_code=True) without moh-dit installed. Do not edit it: "
        'change the\npackage and export again.\n"""\n\nfrom __future__ import annotations\n\n'
    )
    text = header + "\n\n".join(parts) + f"\n\n__all__ = {exported!r}\n"
    _check_standalone(text, entry)
    return Bundle(source=text, modules=tuple(order))


def _check_standalone(text: str, entry: str) -> None:
    """The bundle must compile and must not import the package or anything relative."""
    tree = ast.parse(text)
    compile(tree, f"<bundle of {entry}>", "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == PACKAGE):
            raise BundleError(f"the bundle of {entry} still imports {'.' * node.level}{node.module} "
                              f"(line {node.lineno}).")
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
            raise BundleError(f"the bundle of {entry} still imports {PACKAGE} (line {node.lineno}).")
