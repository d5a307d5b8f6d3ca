"""The layout's rules, read from the code's own import statements (every one: module level,
inside functions and under ``TYPE_CHECKING``).

- No import cycles between the product's modules.
- Folders stand in layers and import only the layers below them: ``producer/`` is
  client <- ops <- stack <- gateway <- tools <- cli, ``workers/`` is
  models <- batching <- consumer; ``shared/`` imports neither side, the workers import no
  producer code, and the client, ops, stack and gateway import no worker code.
- ``workers/batching`` imports neither Celery nor kombu (checked by reading its imports and by
  importing all of it in a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("shared", "workers", "producer")

LAYERS = {
    "producer": ["client", "ops", "stack", "gateway", "tools", "cli"],
    "workers": ["models", "batching", "consumer"],
}
NO_WORKERS = ("producer.client", "producer.ops", "producer.stack", "producer.gateway")


def _modules() -> dict[str, Path]:
    out = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imported(path: Path, name: str) -> Iterator[str]:
    """Every module name ``path`` imports (``from pkg import sub`` counts as ``pkg.sub`` when
    ``sub`` is a module, else as ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                yield full if full in MODULES else module


def _owner(module: str) -> str | None:
    """The product module that ``module`` names (itself or the package it is in)."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = {_owner(m) for m in _imported(path, name)}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


GRAPH = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _layer(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in LAYERS.get(parts[0], ()):
        return parts[0], LAYERS[parts[0]].index(parts[1])
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_the_layout() -> None:
    # A few edges known to exist: the graph is read, not empty.
    assert "producer.client.fleet" in GRAPH["producer.client"]
    assert "workers.batching.batcher" in GRAPH["workers.consumer.engine"]
    assert len(MODULES) > 150


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_folders_import_only_the_layers_below_them() -> None:
    upward = []
    for module, deps in GRAPH.items():
        here = _layer(module)
        for dep in deps:
            there = _layer(dep)
            if here and there and here[0] == there[0] and there[1] > here[1]:
                upward.append(f"{module} -> {dep}")
    assert upward == []


def test_the_sides_keep_apart() -> None:
    crossing = [
        f"{m} -> {d}"
        for m, deps in GRAPH.items()
        for d in deps
        if (m.startswith("shared") and not d.startswith("shared"))
        or (m.startswith("workers") and d.startswith("producer"))
        or (m.startswith(NO_WORKERS) and d.startswith("workers"))
    ]
    assert crossing == []


def test_batching_imports_neither_celery_nor_kombu() -> None:
    batching = sorted(m for m in MODULES if m.startswith("workers.batching."))
    assert len(batching) >= 8
    read = [
        f"{m} imports {i}"
        for m in batching
        for i in _imported(MODULES[m], m)
        if i.split(".")[0] in ("celery", "kombu")
    ]
    assert read == []
    code = (
        f"import sys; import {', '.join(batching)}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"
