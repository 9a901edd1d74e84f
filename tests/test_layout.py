"""The package's shape: every module imports, module-level imports form no cycle, functions stay short."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import medusa

ROOT = Path(medusa.__file__).resolve().parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """medusa modules imported when ``name`` is imported: module-level statements only
    (imports inside functions or ``if TYPE_CHECKING:`` run later or never)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_every_module_imports():
    for info in pkgutil.walk_packages(medusa.__path__, "medusa."):
        importlib.import_module(info.name)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in a directed graph (depth-first, the first one found), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_cycles():
    mods = modules()
    graph = {name: top_level_imports(path, name, set(mods)) for name, path in mods.items()}
    # a package's __init__ runs before any of its submodules (medusa's own is lazy)
    for name in mods:
        parent = name.rpartition(".")[0]
        if parent in graph and parent != "medusa":
            graph[name].add(parent)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_see_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from medusa.b import x\n")
    (tmp_path / "b.py").write_text("import medusa.a\nx = 1\n")
    known = {"medusa.a", "medusa.b"}
    graph = {"medusa.a": top_level_imports(tmp_path / "a.py", "medusa.a", known),
             "medusa.b": top_level_imports(tmp_path / "b.py", "medusa.b", known)}
    assert find_cycle(graph) == ["medusa.a", "medusa.b", "medusa.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


MAX_FUNCTION_LINES = 60


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of each function in ``path`` longer than ``limit`` lines."""
    tree = ast.parse(path.read_text())
    return [f"{node.name} ({node.end_lineno - node.lineno + 1})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_library_functions_read_top_to_bottom():
    """Every function of the library fits on a screen (docstrings included)."""
    found = {name: long for name, path in modules().items() if (long := long_functions(path))}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [f"long ({MAX_FUNCTION_LINES + 1})"]
