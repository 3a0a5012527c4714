"""The planner's layout is its architecture: subpackages by subsystem, imports in one direction.

core <- costmodel <- hetero <- schedule, and costmodel <- geo <- hetero (`planner plan` prices
pipeline stages with the geo search beside the ILP: planner/geo/cluster_plan.py). `contracts.cli` (argument parsing and
printing shared by every CLI) is imported only by the `*command` modules. Every import counts,
also those inside functions, and no module cycle exists anywhere in `planner` (read from the
source with `ast`, so a lazy import cannot hide one).
"""
from __future__ import annotations

import ast
import pathlib

PLANNER = pathlib.Path(__file__).resolve().parents[2] / "planner"

# What each subsystem may import besides itself.
ALLOWED = {
    "core": set(),
    "costmodel": {"core"},
    "hetero": {"core", "costmodel", "geo"},
    "schedule": {"core", "costmodel", "hetero", "geo"},
    "geo": {"core", "costmodel"},
}
TOP_LEVEL = {"__init__", "__main__"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PLANNER.rglob("*.py"):
        rel = path.relative_to(PLANNER.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The planner modules `path` imports (resolving `from planner.x import y` to the module y where
    y is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("planner") and name in modules:
                found.add(name)
    return found


def _subsystem(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_planner_top_level_holds_only_the_entry_points():
    top = {p.stem for p in PLANNER.glob("*.py")}
    assert top == TOP_LEVEL, f"modules at planner/ top level besides the entry points: {sorted(top - TOP_LEVEL)}"
    packages = {p.name for p in PLANNER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), packages


def _violations(name: str, targets: set[str]) -> list[str]:
    sub = _subsystem(name)
    bad = []
    for target in targets:
        tsub = _subsystem(target)
        if target == "contracts.cli":
            if not (name.endswith("command") or name == "planner.__main__"):
                bad.append(f"{name} -> contracts.cli (only command modules parse arguments)")
            continue
        if sub in ALLOWED and tsub != sub and tsub not in ALLOWED[sub] and target != "planner":
            bad.append(f"{name} -> {target}")
        if name == "contracts.cli" and tsub not in ("core", ""):
            bad.append(f"{name} -> {target}")
    return bad


def test_imports_go_one_way_between_subsystems():
    modules = _modules()
    bad = [v for name, path in modules.items() for v in _violations(name, _imports(path, modules))]
    assert not bad, "imports against the layout:\n" + "\n".join(sorted(bad))


def test_no_import_cycle_between_planner_modules():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name, "planner"} for name, path in modules.items()}
    # a package's __init__ importing its own modules is not a cycle of design; none do today
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_layout_check_catches_a_wrong_way_import(tmp_path):
    """The checker itself: a core module importing the scheduler is reported."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from planner.schedule.options import Pool\n")
    targets = _imports(fake, _modules())
    assert targets == {"planner.schedule.options"}
    assert _violations("planner.core.memory", targets) == ["planner.core.memory -> planner.schedule.options"]
    assert _violations("planner.schedule.simulate", targets) == []
    assert _violations("planner.core.memory", {"contracts.cli"})
