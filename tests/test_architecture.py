"""The project's structure, held by its own imports: packages form a DAG in a written order, no file-import
cycle (``TYPE_CHECKING`` imports included), and no nursery stored on an object outside a shrink-only list.

Read with the standard library's ``ast`` only, so the rules hold however a module is loaded."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PACKAGE_ORDER = ("index", "tokenization", "events", "mesh", "sim", "autoscale", "gateway", "cluster", "bench", "chaos")
"""Lowest first: a package imports only itself and packages before it. ``index`` and ``tokenization`` are the
sans-IO core; ``events`` and ``mesh`` feed it; ``sim`` plays the engine; ``autoscale`` owns the protocols it
needs; ``gateway`` assembles a replica; ``cluster`` starts processes; ``bench`` and ``chaos`` drive them."""

STORED_NURSERIES = {
    ("autoscale/providers/base.py", "_nursery"),
    ("autoscale/loop.py", "_nursery"),
    ("gateway/route_planner.py", "_background"),
}
"""Nurseries kept on an object instead of passed to the task that spawns into them. Only shrinks: each entry
is a task tree that cannot be read from one place (the composition root takes them over)."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGE_ORDER:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """Every project module ``path`` imports anywhere (function bodies and ``TYPE_CHECKING`` blocks too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                yield name


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(path, known)) - {name} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def stored_nurseries(path: Path) -> set[str]:
    """Attributes assigned a nursery: a name bound by ``open_nursery()`` or a parameter typed ``Nursery``."""
    stored = set()
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        nurseries = {arg.arg for arg in function.args.args + function.args.kwonlyargs
                     if arg.annotation is not None and "Nursery" in ast.unparse(arg.annotation)}
        for node in ast.walk(function):
            if isinstance(node, ast.With | ast.AsyncWith):
                nurseries |= {item.optional_vars.id for item in node.items
                              if "open_nursery" in ast.unparse(item.context_expr)
                              and isinstance(item.optional_vars, ast.Name)}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in nurseries:
                stored |= {target.attr for target in node.targets if isinstance(target, ast.Attribute)}
    return stored


def test_no_file_import_cycle():
    assert cycles(import_graph()) == []


def test_packages_import_only_packages_before_them():
    rank = {package: i for i, package in enumerate(PACKAGE_ORDER)}
    upward = defaultdict(set)
    for module, targets in import_graph().items():
        for target in targets:
            low, high = module.split(".")[0], target.split(".")[0]
            if rank[high] > rank[low]:
                upward[f"{low} -> {high}"].add(f"{module} imports {target}")
    assert dict(upward) == {}


def test_nurseries_are_stored_only_where_listed():
    stored = {(str(path.relative_to(ROOT)), attribute) for path in modules().values()
              for attribute in stored_nurseries(path)}
    assert stored <= STORED_NURSERIES, "a new stored nursery: pass it to the task that spawns into it"
    assert stored >= STORED_NURSERIES, "a listed nursery is gone: take it off the list"


def test_the_checks_see_a_cycle_and_a_stored_nursery(tmp_path):
    """The rules above could fail: a two-module cycle is found, and so is ``self.x = nursery``."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    source = tmp_path / "keeper.py"
    source.write_text("import trio\nclass K:\n    async def run(self):\n"
                      "        async with trio.open_nursery() as n:\n            self.kept = n\n")
    assert stored_nurseries(source) == {"kept"}
