"""The package's import graph, read from the source: no module imports one that (through others) imports it back,
and the layers import downwards only (the engine may import the executor's interface, never the reverse).

Imports are the ones a module runs when it is imported: module level, outside `if TYPE_CHECKING:`, with the
packages each imported module lies in (Python runs a package's __init__ before its modules), but not the importer's
own packages (their __init__ is running already). Imports inside functions run later, on use, and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvforge

ROOT = Path(kvforge.__file__).parent
# package -> the kvforge packages it must never import (directly or through one of its modules)
NEVER_IMPORTS = {
    "step_data": {"engine", "executor", "server", "router", "llm"},
    "executor": {"engine", "server", "router", "llm"},
    "spec_decode": {"engine", "executor", "server", "router", "llm"},
    "kernels": {"layers", "models", "quantization", "loader", "engine", "executor", "server", "router", "llm"},
    "layers": {"models", "quantization", "loader", "engine", "executor", "server", "router", "llm"},
    "models": {"loader", "engine", "executor", "server", "router", "llm"},
    "engine": {"server", "router", "llm"},
    "structured_output": {"engine", "executor", "server", "router", "llm"},
    "lora": {"loader", "engine", "executor", "server", "router", "llm"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(body: list[ast.stmt], modules: set[str]) -> set[str]:
    """The kvforge modules a module body imports when it runs (see the module's docstring)."""
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= _imported(node.orelse, modules)
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names} & modules
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[handler.body for handler in getattr(node, "handlers", [])]):
                found |= _imported(block, modules)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)}
        direct = _imported(ast.parse(path.read_text()).body, modules)
        with_packages = {".".join(m.split(".")[:k]) for m in direct for k in range(2, m.count(".") + 2)}
        graph[name] = {m for m in with_packages & modules if m != name and (m in direct or m not in own)}
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if the graph has one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_module_imports_itself_back():
    graph = import_graph()
    cycles = [cycle for name in sorted(graph) if (cycle := _cycle_through(graph, name)) is not None]
    assert not cycles, cycles[0]


def test_layers_import_downwards_only():
    graph = import_graph()
    wrong = []
    for name, imported in graph.items():
        package = name.split(".")[1] if "." in name else ""
        for target in imported:
            if target.split(".")[1] in NEVER_IMPORTS.get(package, ()):
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_layers_name_no_quantization_module_even_for_type_hints():
    """The layers own the linear-kernel interface (layers/linear_kernel.py) and the formats implement it: no module of
    kvforge.layers imports kvforge.quantization, not even under `if TYPE_CHECKING:` (a cycle in the types that the
    runtime graph above does not see)."""
    named = []
    for path in sorted((ROOT / "layers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            named += [f"{path.name} imports {m}" for m in modules if m.startswith("kvforge.quantization")]
    assert not named, named
