"""The package's shape: every module imports, imports form no cycle (function-level ones
included) and point down the layers, functions stay short."""

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


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Every module name an import statement may load (a package and its named submodules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def imports(path: Path, name: str, known: set[str], top_level_only: bool = False) -> set[str]:
    """medusa modules that ``name`` imports: every import statement, those inside functions and
    ``if TYPE_CHECKING:`` included, or with ``top_level_only`` the module-level statements only
    (what runs when ``name`` is imported)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {t for t in _targets(node, package) if t in known and t != name}
    return out


def top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """medusa modules imported when ``name`` is imported: module-level statements only
    (imports inside functions or ``if TYPE_CHECKING:`` run later or never)."""
    return imports(path, name, known, top_level_only=True)


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


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    mods = modules()
    graph = {name: imports(path, name, set(mods), top_level_only) for name, path in mods.items()}
    # a package's __init__ runs before any of its submodules (medusa's own is lazy)
    for name in mods:
        parent = name.rpartition(".")[0]
        if parent in graph and parent != "medusa":
            graph[name].add(parent)
    return graph


def test_no_import_cycles():
    cycle = find_cycle(import_graph(top_level_only=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_behind_function_level_imports():
    """An import moved into a function still ties the two modules together: none may close a cycle."""
    cycle = find_cycle(import_graph(top_level_only=False))
    assert cycle is None, "import cycle (function-level imports counted): " + " -> ".join(cycle or [])


# The layers, bottom up: each may import only those below it (and its own package).
# entry points -> bench, chat -> api -> autotune -> decoding / training / peers -> hub -> models -> runtime (+ errors, config)
ABOVE = {
    "medusa.errors": ("medusa.config", "medusa.runtime", "medusa.models", "medusa.decoding", "medusa.training",
                      "medusa.hub", "medusa.peers", "medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.config": ("medusa.runtime", "medusa.models", "medusa.decoding", "medusa.training", "medusa.hub",
                      "medusa.peers", "medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.runtime": ("medusa.models", "medusa.decoding", "medusa.training", "medusa.hub", "medusa.peers",
                       "medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.models": ("medusa.decoding", "medusa.training", "medusa.hub", "medusa.peers", "medusa.autotune",
                      "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.decoding": ("medusa.peers", "medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.training": ("medusa.peers", "medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.hub": ("medusa.peers", "medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.peers": ("medusa.autotune", "medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.autotune": ("medusa.api", "medusa.bench", "medusa.chat"),
    "medusa.api": ("medusa.bench", "medusa.chat"),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``module -> import`` for each import that points up the layers (:data:`ABOVE`)."""
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for layer, above in ABOVE.items()
                  if _within(name, layer) for target in targets if any(_within(target, up) for up in above))


def test_imports_point_down_the_layers():
    found = layer_violations(import_graph(top_level_only=False))
    assert not found, f"imports from a layer above: {found}"


def test_the_layer_check_sees_an_upward_import(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from medusa.decoding.engine import Engine\n")
    known = {"medusa.models.m", "medusa.decoding.engine"}
    graph = {"medusa.models.m": imports(tmp_path / "m.py", "medusa.models.m", known)}
    assert top_level_imports(tmp_path / "m.py", "medusa.models.m", known) == set()
    assert layer_violations(graph) == ["medusa.models.m -> medusa.decoding.engine"]
    assert layer_violations({"medusa.decoding.x": {"medusa.models.y", "medusa.runtime.hf"}}) == []
    assert layer_violations({"medusa.runtime.hf": {"medusa.models.heads"}}) == ["medusa.runtime.hf -> medusa.models.heads"]


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


def test_entry_point_functions_read_top_to_bottom():
    """The entry points (infer/, train/, scripts/) are thin: their functions fit on a screen too."""
    found = {str(path.relative_to(ROOT.parent)): long for folder in ("infer", "train", "scripts")
             for path in sorted((ROOT.parent / folder).rglob("*.py")) if (long := long_functions(path))}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [f"long ({MAX_FUNCTION_LINES + 1})"]


MAX_MODULE_LINES = 450


def test_library_modules_stay_small():
    """No module of the library outgrows one job: at most MAX_MODULE_LINES lines each."""
    found = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not found, f"modules over {MAX_MODULE_LINES} lines: {found}"


def early_returns(path: Path) -> list[str]:
    """``test_*`` functions of ``path`` with a bare ``return`` in their own body (not in a nested
    function): a test that stops early on hardware it needs passes without saying so, where
    ``pytest.skip(reason)`` shows in the report."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            stack = list(node.body)
            while stack:
                child = stack.pop()
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    continue
                if isinstance(child, ast.Return) and child.value is None:
                    found.append(f"{node.name}:{child.lineno}")
                stack.extend(ast.iter_child_nodes(child))
    return found


def test_tests_skip_with_a_reason_instead_of_returning_early():
    found = {path.name: hits for path in sorted((ROOT.parent / "tests").glob("test_*.py")) if (hits := early_returns(path))}
    assert not found, f"tests that return early (use pytest.skip(reason)): {found}"


def test_the_early_return_check_sees_one(tmp_path):
    (tmp_path / "test_m.py").write_text("def test_a():\n    def inner():\n        return\n    if True:\n        return\n")
    assert early_returns(tmp_path / "test_m.py") == ["test_a:5"]


# The command-line modules (infer/, train/, scripts/) parse arguments, call the library and
# print; the logic they call lives in medusa/, where it is tested and reused.
MAX_CLI_LINES = 300


def long_cli_modules(root: Path, limit: int = MAX_CLI_LINES) -> dict[str, int]:
    """``folder/file.py -> lines`` for each command-line module of ``root`` over ``limit`` lines."""
    return {str(path.relative_to(root)): n for folder in ("infer", "train", "scripts")
            for path in sorted((root / folder).glob("*.py")) if (n := len(path.read_text().splitlines())) > limit}


def test_command_line_modules_stay_thin():
    found = long_cli_modules(ROOT.parent)
    assert not found, f"command-line modules over {MAX_CLI_LINES} lines (move their logic into medusa/): {found}"


def test_the_cli_size_check_sees_a_long_module(tmp_path):
    (tmp_path / "infer").mkdir()
    (tmp_path / "infer" / "short.py").write_text("x = 1\n" * MAX_CLI_LINES)
    (tmp_path / "infer" / "long.py").write_text("x = 1\n" * (MAX_CLI_LINES + 1))
    assert long_cli_modules(tmp_path) == {"infer/long.py": MAX_CLI_LINES + 1}


def test_the_loop_modules_never_call_back_into_the_engine():
    """One step (medusa/decoding/batch.py) over sequences (medusa/decoding/run.py) that know the
    passes they run on, never the engine: the engine builds them and calls down, nothing calls
    back up (no import, no ``engine`` object handed in)."""
    graph = import_graph(top_level_only=False)
    root = Path(medusa.__file__).parent
    for module in ("medusa.decoding.run", "medusa.decoding.batch"):
        assert "medusa.decoding.engine" not in graph[module], module
        tree = ast.parse((root / "decoding" / f"{module.rsplit('.', 1)[1]}.py").read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.arg for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for a in n.args.args}
        assert not {"engine", "Engine"} & names, f"{module} holds an engine: {sorted({'engine', 'Engine'} & names)}"
