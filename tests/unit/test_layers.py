"""The repository's layers, read from the source: every import points down, and no modules import each other
in a cycle. Function-level imports count as much as top-level ones, and so do module names handed to
`importlib.import_module` as literals (the CLIs' COMMANDS tables). The layers are in docs/ARCHITECTURE.md
("Layers"); this test is their only enforcement.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Rank of each top-level package (or top-level module): a module may import its own package and any package of
# a lower rank. Equal ranks of different packages may not import each other (models and planner are siblings).
RANKS = {
    "contracts": 0,  # torch-free shared contracts
    "models": 1, "planner": 1,  # the torch runtime; the torch-free planners
    "profiler": 2,
    "executor": 3,
    "ui": 4,
    "app": 5, "gpumix": 5,  # the dashboard's router; the `gpumix` command
    "testkit": 6,  # helpers of tests and benches
    "bench": 7,
    "tests": 8,
}
TORCH_FREE = ("contracts", "planner")
# Inside planner: what each subsystem may import besides itself and contracts (pipeline stages are priced with
# the geo search beside the ILP, so hetero sits above geo); `planner.entry`, the one planning entry, above all.
PLANNER_SUBSYSTEMS = {
    "core": set(),
    "costmodel": {"core"},
    "geo": {"core", "costmodel"},
    "hetero": {"core", "costmodel", "geo"},
    "schedule": {"core", "costmodel", "hetero", "geo", "entry"},
    "entry": {"core", "costmodel", "geo", "hetero"},
    "__main__": {"core", "costmodel", "geo", "hetero", "schedule", "entry"},
}
SKIP_DIRS = {".git", ".venv", "data", "build", "node_modules", "__pycache__"}


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the tree by dotted name (a package by its own name)."""
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The tree's module that importing `name` loads last (its longest prefix that is a module), None if none."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(path: pathlib.Path, module: str) -> set[str]:
    """Dotted names `path` imports anywhere (functions included), and string literals given to import_module
    or kept as values of a COMMANDS table."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            # `from pkg import name`: the module pkg.name where that is one, else pkg (resolved below)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
        elif (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMANDS" for t in node.targets)
              and isinstance(node.value, ast.Dict)):
            names.update(v.value for v in node.value.values if isinstance(v, ast.Constant))
    return names


def import_graph(root: pathlib.Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules of the tree it imports, module -> every dotted name it imports)."""
    modules = module_files(root)
    edges: dict[str, set[str]] = defaultdict(set)
    raw: dict[str, set[str]] = {}
    for module, path in modules.items():
        raw[module] = imported_names(path, module)
        for name in raw[module]:
            target = _resolve(name, modules)
            if target and target != module:
                edges[module].add(target)
    return edges, raw


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """'a -> b (why)' for each import that points up or sideways between packages."""
    bad = []
    for a, targets in sorted(edges.items()):
        top_a = a.split(".")[0]
        for b in sorted(targets):
            top_b = b.split(".")[0]
            if top_a == top_b:
                continue
            if top_a not in RANKS or top_b not in RANKS:
                bad.append(f"{a} -> {b} (a package the layers do not name: add it to RANKS and ARCHITECTURE.md)")
            elif RANKS[top_b] >= RANKS[top_a]:
                bad.append(f"{a} -> {b} ({top_a} is rank {RANKS[top_a]}, {top_b} rank {RANKS[top_b]})")
    return bad


def _is_cli(module: str) -> bool:
    last = module.split(".")
    return (last[-1].endswith("command") or last[-1] == "__main__" or "commands" in last
            or last[0] in ("gpumix", "bench", "tests", "testkit"))


def planner_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports against planner's own order of subsystems, and argument parsing outside the CLI modules."""
    bad = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            if b == "contracts.cli" and not _is_cli(a):
                bad.append(f"{a} -> contracts.cli (only command modules parse arguments)")
            pa, pb = a.split("."), b.split(".")
            if pa[0] != "planner" or pb[0] != "planner" or len(pa) < 2 or len(pb) < 2 or pa[1] == pb[1]:
                continue
            if b == "planner.entry" and _is_cli(a):  # the CLIs are planner's top: they plan through the entry
                continue
            if pa[1] not in PLANNER_SUBSYSTEMS or pb[1] not in PLANNER_SUBSYSTEMS[pa[1]]:
                bad.append(f"{a} -> {b} (planner.{pa[1]} may import {sorted(PLANNER_SUBSYSTEMS.get(pa[1], ()))})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    nodes = sorted(set(edges) | {b for t in edges.values() for b in t})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_every_import_points_down(graph):
    edges, _ = graph
    bad = layer_violations(edges)
    assert not bad, "imports against the layers (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_planner_subsystems_import_one_way(graph):
    edges, _ = graph
    bad = planner_violations(edges)
    assert not bad, "imports against planner's layout:\n" + "\n".join(bad)
    tops = {m.split(".")[1] for m in edges if m.startswith("planner.")}
    assert tops <= set(PLANNER_SUBSYSTEMS), f"planner modules outside its subsystems: {sorted(tops - set(PLANNER_SUBSYSTEMS))}"


def test_no_module_cycle(graph):
    edges, _ = graph
    found = cycles(edges)
    assert not found, "modules importing each other in a cycle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_contracts_and_planner_never_import_torch(graph):
    _, raw = graph
    bad = sorted(f"{m} imports {n}" for m, names in raw.items() if m.split(".")[0] in TORCH_FREE
                 for n in names if n.split(".")[0] == "torch")
    assert not bad, "\n".join(bad)


def test_the_graph_covers_every_package(graph):
    edges, _ = graph
    tops = {m.split(".")[0] for m in module_files(ROOT)}
    assert tops <= set(RANKS), f"packages the layers do not name: {sorted(tops - set(RANKS))}"
    # the checks below only mean something if lazy imports are read: the executor imports the profiler lazily
    assert any(b.startswith("profiler.") for a, t in edges.items() if a.startswith("executor.") for b in t)


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checks_find_an_upward_import_and_a_cycle_hidden_in_functions(tmp_path):
    root = _tree(tmp_path, {
        "contracts/__init__.py": "",
        "contracts/a.py": "def f():\n    from planner import b\n",  # upward, lazily
        "planner/__init__.py": "",
        "planner/b.py": "def g():\n    import planner.c\n",
        "planner/c.py": "from . import b\n",  # b -> c -> b, through a relative import
        "planner/d.py": "import importlib\nimportlib.import_module('executor.e')\n",  # by name
        "executor/__init__.py": "",
        "executor/e.py": "from planner import d\n",
    })
    edges, _ = import_graph(root)
    bad = layer_violations(edges)
    assert any(v.startswith("contracts.a -> planner.b") for v in bad), bad
    assert any(v.startswith("planner.d -> executor.e") for v in bad), bad
    assert not any(v.startswith("executor.e") for v in bad), bad  # a downward import is fine
    assert sorted(cycles(edges)) == [["executor.e", "planner.d"], ["planner.b", "planner.c"]]


def test_the_planner_check_finds_a_wrong_way_import(tmp_path):
    edges = {"planner.core.memory": {"planner.schedule.options", "contracts.specs"},
             "planner.schedule.simulate": {"planner.hetero.solve"}, "planner.geo.atlas": {"contracts.cli"}}
    assert planner_violations(edges) == [
        "planner.core.memory -> planner.schedule.options (planner.core may import [])",
        "planner.geo.atlas -> contracts.cli (only command modules parse arguments)"]


def test_a_sibling_package_import_is_refused(tmp_path):
    root = _tree(tmp_path, {"models/__init__.py": "", "models/m.py": "from planner.p import x\n",
                            "planner/__init__.py": "", "planner/p.py": "x = 1\n"})
    edges, _ = import_graph(root)
    assert layer_violations(edges) == ["models.m -> planner.p (models is rank 1, planner rank 1)"]
