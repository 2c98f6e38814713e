"""The modules of envs/ import one another without a cycle, and envs/search.py never reaches the
long-context package (the long-context families build on search, not the other way round).

The graph is read from the source (``ast``): every ``import`` statement, at module level or inside
a function, is an edge; importing ``a.b.c`` from outside package ``a.b`` also runs ``a/b/__init__.py``,
so it is an edge to that package as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in sorted((ROOT / "envs").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        edges = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                mod = ".".join(parts[:i])
                # an enclosing package of the importer is already being imported: no edge to it
                if mod in files and mod != name and not name.startswith(mod + "."):
                    edges.add(mod)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_is_read():
    graph = import_graph()
    assert {"envs", "k3rl.envs.search", "k3rl.envs.longctx", "k3rl.envs.longctx.needle", "k3rl.envs.search_oracle"} <= set(graph)
    assert "k3rl.envs.search_oracle" in graph["k3rl.envs.search"]
    assert "k3rl.envs.longctx.task" in graph["k3rl.envs.longctx.needle"]
    assert "k3rl.envs.search" in _reach(graph, "k3rl.envs.longctx")


def test_envs_has_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_search_does_not_reach_the_long_context_package():
    reached = _reach(import_graph(), "k3rl.envs.search")
    assert not {m for m in reached if m == "k3rl.envs.longctx" or m.startswith("k3rl.envs.longctx.")}, sorted(reached)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
