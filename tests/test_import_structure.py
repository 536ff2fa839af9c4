"""The package's import structure, read from the source as static tools read it: the step
contract keeps the scheduling policy and the device engine apart, there are no import cycles,
and no module reaches into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Folder on disk -> the package it installs as (pyproject's package-dir).
ROOTS = {"lang": "radixlm", "srt": "radixlm.srt", "radix": "radixlm.radix"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file, lazy and
    TYPE_CHECKING ones included, resolved to our module names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if submodules:  # `from . import x`: the module x itself
                out += [(m, [], node.lineno) for m in submodules]
                names = [n for n in names if f"{target}.{n}" not in MODULES]
            if names:
                out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
    return [(t, n, line) for t, n, line in out if t in MODULES]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _edges_between(src_prefix: str, dst_prefix: str) -> list[str]:
    return [f"{src} -> {dst} (line {line})" for src, imports in GRAPH.items() if src.startswith(src_prefix)
            for dst, _, line in imports if dst.startswith(dst_prefix)]


def test_the_policy_and_the_device_engine_meet_only_at_the_contract():
    assert _edges_between("radixlm.srt.executor", "radixlm.srt.scheduler") == []
    assert _edges_between("radixlm.srt.scheduler", "radixlm.srt.executor") == []
    for side in ("radixlm.srt.scheduler", "radixlm.srt.executor", "radixlm.srt.server"):
        assert _edges_between("radixlm.srt.core", side) == [], f"the contract imports {side}"


def test_the_radix_cache_and_the_language_stay_apart_from_the_runtime():
    assert _edges_between("radixlm.radix", "radixlm.srt") == []
    lang = [m for m in MODULES if m.startswith("radixlm.") and not m.startswith(("radixlm.srt", "radixlm.radix"))]
    # Besides the CLI, the language reuses only the server's pure-Python chat and tool-call code
    # (lang/tools.py: the same rendering, constraint and parsing as /v1/chat/completions).
    shared = (".srt.launch", "-> radixlm.srt.server.chat ", "-> radixlm.srt.server.tool_calls.")
    assert [e for m in lang for e in _edges_between(m, "radixlm.srt") if not any(s in e for s in shared)] == []


def test_there_are_no_import_cycles():
    """Tarjan's strongly connected components over every import (lazy ones too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dst, _, _ in GRAPH[node]:
            if dst == node:
                continue
            if dst not in index:
                visit(dst)
                low[node] = min(low[node], low[dst])
            elif dst in on_stack:
                low[node] = min(low[node], index[dst])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert cycles == []


def test_no_module_imports_another_modules_private_names():
    private = [f"{src} takes {name} from {dst} (line {line})" for src, imports in GRAPH.items()
               for dst, names, line in imports for name in names
               if name.startswith("_") and not name.startswith("__") and dst != src]
    assert private == []


def test_every_source_folder_is_a_package_of_the_wheel():
    """A folder left out of pyproject's package list works in an editable install and is
    missing from a built wheel (tool_calls and responses were, once)."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {folder: name for name, folder in config["package-dir"].items()}
    missing = []
    for folder, name in roots.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.parent.relative_to(REPO / folder).parts
            if "__pycache__" in parts:
                continue
            package = ".".join((name, *parts))
            if package not in listed and package not in missing:
                missing.append(package)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
