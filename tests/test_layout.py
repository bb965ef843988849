"""ops_adv's import structure: floors, no circles, no op importing another op, no tuning stack.

Every `ops_adv` module sits on a floor (`FLOORS`, lowest first) and imports only from floors below
its own, or from its own subpackage on the same floor (models and tools), never an op from an op.
Imports are read with ast, at module level and inside functions (a lazy import is still an edge).
`python tests/test_layout.py [PACKAGE_DIR]` prints the floors and edges of a tree (any tree: modules
this file does not know get the floor of their longest import chain, and circles are shown).
"""
from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ops_adv"
TUNING_STACK = ("ray", "optuna", "sqlalchemy", "alembic", "tuner", "workers", "db")

# (floor name, module patterns), lowest first.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("settings and tables", ("ops_adv._settings", "ops_adv._table")),
    ("dispatch", ("ops_adv._dispatch",)),
    ("custom-operator helper", ("ops_adv._op",)),
    ("ops", ("ops_adv.ops", "ops_adv.ops.*")),
    ("model passes and tools", ("ops_adv.models", "ops_adv.models.*", "ops_adv.tools", "ops_adv.tools.*")),
    ("package and CLI", ("ops_adv", "ops_adv.__main__")),
]
OPS = "ops_adv.ops."


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every .py under the package directory `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str:
    """The module an imported dotted name lives in: itself, or the nearest package above it."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(mods: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module -> {imported ops_adv module: "top" (at import time) or "lazy" (inside a function)}."""
    pkg = next(iter(mods)).split(".")[0]
    graph: dict[str, dict[str, str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges: dict[str, str] = {}

        def visit(node: ast.AST, lazy: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = name.split(".") if is_pkg else name.split(".")[:-1]
                        base = base[: len(base) - child.level + 1]
                        mod = ".".join(base + ([child.module] if child.module else []))
                    else:
                        mod = child.module or ""
                    # `from X import y`: y is a module when X.y is one, else a name in X
                    targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in child.names]
                for t in targets:
                    if t == pkg or t.startswith(pkg + "."):
                        t = _resolve(t, mods)
                        if t != name and edges.get(t) != "top":
                            edges[t] = "lazy" if inner else "top"
                visit(child, inner)

        visit(ast.parse(path.read_text(), str(path)), False)
        graph[name] = edges
    return graph


def top_level_imports(path: Path) -> set[str]:
    """Top-level package names a module imports when it is imported (not inside functions)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                out.add(child.module.split(".")[0])
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def floor_of(module: str) -> int | None:
    for i, (_, patterns) in enumerate(FLOORS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def _subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def violations(graph: dict[str, dict[str, str]]) -> list[str]:
    """Edges that break the floors: upward, sideways between subpackages, or op to op."""
    out = []
    for a, edges in sorted(graph.items()):
        for b, kind in sorted(edges.items()):
            fa, fb = floor_of(a), floor_of(b)
            if a.startswith(OPS) and b.startswith(OPS):
                out.append(f"{a} -> {b} ({kind}): an op module imports another op module")
            elif fa is None or fb is None:
                continue  # reported by test_every_module_has_a_floor
            elif fb > fa or (fb == fa and _subpackage(a) != _subpackage(b)):
                out.append(f"{a} (floor {fa}) -> {b} (floor {fb}, {kind}): not from a lower floor")
    return out


def depth_floors(graph: dict[str, dict[str, str]]) -> dict[str, int]:
    """Each module's longest chain of imports down to a module importing nothing (a circle counts as one)."""
    comp = {v: tuple(c) for c in cycles(graph) for v in c}
    memo: dict[tuple, int] = {}

    def depth(key: tuple) -> int:
        if key not in memo:
            memo[key] = 0
            below = {w for v in key for w in graph.get(v, {})} - set(key)
            memo[key] = 1 + max((depth(comp.get(w, (w,))) for w in below), default=-1)
        return memo[key]

    return {v: depth(comp.get(v, (v,))) for v in graph}


def report(root: Path = PACKAGE) -> str:
    """The floors (FLOORS where every module has one, else the longest import chain, not counting imports
    of the package itself), each module's imports, the circles and the imports against the floors."""
    mods = modules(root)
    graph = imports(mods)
    pkg = root.name
    known = all(floor_of(m) is not None for m in graph)
    if known:
        floors = {m: floor_of(m) for m in graph}
        names = [n for n, _ in FLOORS]
    else:
        floors = depth_floors({a: {b: k for b, k in e.items() if b != pkg} for a, e in graph.items()})
        floors[pkg] = max(floors.values()) + 1
        names = [f"depth {i}" for i in range(floors[pkg])] + ["package"]
    lines = [f"{len(mods)} modules, {sum(len(e) for e in graph.values())} imports between them "
             f"(floors: {'FLOORS of tests/test_layout.py' if known else 'longest import chain'})"]
    for i in reversed(range(len(names))):
        members = sorted(m for m in graph if floors[m] == i)
        if not members:
            continue
        lines.append(f"\nfloor {i}: {names[i]}")
        for m in members:
            n_lines = sum(1 for _ in mods[m].open())
            deps = ", ".join(f"{b}{'' if k == 'top' else ' (lazy)'}" for b, k in sorted(graph[m].items()))
            lines.append(f"  {m} ({n_lines} lines) -> {deps or '-'}")
    circles = cycles(graph)
    two_way = sorted(f"{a} <-> {b}" for a, e in graph.items() for b in e if a < b and a in graph.get(b, {}))
    lines.append("\ncircles (strongly connected modules): " + ("; ".join("{" + ", ".join(c) + "}" for c in circles)
                                                             if circles else "none"))
    lines.append("modules importing each other: " + ("; ".join(two_way) if two_way else "none"))
    bad = sorted(f"{a} -> {b}" for a, e in graph.items() for b in e
                 if floors[b] > floors[a] or (known and violations({a: {b: e[b]}})))
    lines.append("imports up or across the floors: " + ("; ".join(bad) if bad else "none"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the tests


def test_every_module_has_a_floor():
    assert [m for m in modules() if floor_of(m) is None] == []


def test_no_circles():
    assert cycles(imports(modules())) == []


def test_imports_go_down_the_floors_and_no_op_imports_another():
    assert violations(imports(modules())) == []


def test_the_checker_sees_what_it_must_refuse():
    """The graph reads relative, absolute and lazy imports, and the checks flag a circle, an upward and an op-to-op import."""
    g = {"ops_adv._dispatch": {"ops_adv": "lazy"}, "ops_adv.ops.gemm": {"ops_adv.ops.linear": "top"},
         "ops_adv.ops.linear": {"ops_adv.ops.gemm": "lazy"}, "ops_adv": {}}
    assert cycles(g) == [["ops_adv.ops.gemm", "ops_adv.ops.linear"]]
    assert len(violations(g)) == 3
    graph = imports(modules())
    assert graph["ops_adv"]["ops_adv.ops.rms_norm"] == "top"
    assert graph["ops_adv.ops.rms_norm"]["ops_adv._op"] == "top"
    assert graph["ops_adv.models.convert"]["ops_adv.models.record"] == "lazy"


def test_modules_import_no_tuning_stack_at_import_time():
    """Statically, no ops_adv module imports the tuning stack at module level (tune_for_hardware does, inside)."""
    bad = {m: sorted(top_level_imports(p) & set(TUNING_STACK)) for m, p in modules().items()}
    assert {m: v for m, v in bad.items() if v} == {}


def test_importing_every_module_pulls_no_tuning_stack():
    """Every ops_adv module imported (not only what `import ops_adv` loads): nothing of the tuning stack arrives."""
    names = [m for m in modules() if not m.endswith("__main__")]
    code = (f"import importlib, sys\nfor m in {names!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TUNING_STACK!r}))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


if __name__ == "__main__":
    print(report(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE))
