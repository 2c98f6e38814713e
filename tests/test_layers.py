"""The import graph follows the layers: ``util < kernels < model < envs < rollout < rl < commands``.

The graph is read from the source with ``ast``: every ``import`` statement, at module level or inside a
function, is an edge; importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``, so it is an
edge to those packages as well (except the importer's own enclosing packages, which are already running).

Layers, lowest first (a module may import its own layer and the ones below it):

- ``k3rl.util``: the utility floor (atomic directory writes, the YAML + dotted-override loader);
- ``k3rl.kernels``: Triton kernels and their PyTorch references;
- ``k3rl.model``: the network, and its checkpoint formats in ``k3rl.model.formats``;
- ``k3rl.envs``: environments, tools, corpora, long-context families;
- ``k3rl.rollout``: engines, chat rendering, the agent loop, rollout workers;
- ``k3rl.rl``, itself in sub-layers: the floor (``config``, ``metrics``, ``checkpoint``, ``algos``) <
  ``train`` < ``eval`` < ``orchestrator`` < ``pretrain``;
- ``k3rl.rl.commands``: the ``k3rl`` launchers; nothing imports them.

Two more rules: ``rl.train`` and ``rl.orchestrator`` meet only at the learner group's public interface
(``k3rl.rl.train.group``), and ``envs.search`` never reaches the long-context package (the families build on
search, not the other way round). No module imports the folders by their bare names (``import model``): they
exist only as ``k3rl.*`` once installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("util", "kernels", "model", "envs", "rollout", "rl")
BARE = set(FOLDERS)

# (prefix, rank): a module's rank is that of its longest matching prefix
RANKS = [
    ("k3rl.util", 0),
    ("k3rl.kernels", 10),
    ("k3rl.model", 20),
    ("k3rl.envs", 30),
    ("k3rl.rollout", 40),
    ("k3rl.rl", 50),  # the rl floor: config, metrics, checkpoint, algos (and the package itself)
    ("k3rl.rl.train", 51),
    ("k3rl.rl.eval", 52),
    ("k3rl.rl.orchestrator", 53),
    ("k3rl.rl.pretrain", 54),
    ("k3rl.rl.commands", 60),
]
# the learner group is what the orchestrator may see of rl.train
TRAIN_INTERFACE = {"k3rl.rl.train", "k3rl.rl.train.group"}


def rank(module: str) -> tuple[str, int]:
    best = max((p for p, _ in RANKS if module == p or module.startswith(p + ".")), key=len)
    return best, dict(RANKS)[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["k3rl", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def source_files() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def imports(name: str, source: str, is_package: bool, modules: set[str]) -> tuple[set[str], list[str]]:
    """(first-party modules `name` imports, bare imports of the folders) read from `source`."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    bare: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            bare += [n for n in names if n.split(".")[0] in BARE]
            targets.update(names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            elif base.split(".")[0] in BARE:
                bare.append(base)
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in modules and mod != name and not name.startswith(mod + "."):
                edges.add(mod)
    return edges, bare


def import_graph(extra: dict[str, str] | None = None) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """The graph of the tree; `extra` maps a module name to source lines appended to it (for the self-test)."""
    files = source_files()
    modules = set(files)
    graph, bare = {}, {}
    for name, path in files.items():
        source = path.read_text() + "\n" + (extra or {}).get(name, "")
        graph[name], bare[name] = imports(name, source, path.name == "__init__.py", modules)
    return graph, bare


def violations(graph: dict[str, set[str]], bare: dict[str, list[str]]) -> list[str]:
    found = []
    for src, targets in sorted(graph.items()):
        layer, r = rank(src)
        for dst in sorted(targets):
            dst_layer, dst_r = rank(dst)
            if dst_r > r:
                found.append(f"{src} imports {dst}: layer {layer} may not import the higher layer {dst_layer}")
            if layer == "k3rl.rl.train" and dst_layer == "k3rl.rl.orchestrator":
                found.append(f"{src} imports {dst}: rl.train never imports the orchestrator")
            if layer == "k3rl.rl.orchestrator" and dst_layer == "k3rl.rl.train" and dst not in TRAIN_INTERFACE:
                found.append(f"{src} imports {dst}: the orchestrator sees rl.train only through k3rl.rl.train.group")
        found += [f"{src} imports {b!r} by its bare name; write k3rl.{b}" for b in bare.get(src, [])]
    for start in ("k3rl.envs.search",):
        reached = reach(graph, start)
        found += [f"{start} reaches {m}: search is below the long-context families" for m in sorted(reached)
                  if m.startswith("k3rl.envs.longctx")]
    if (loop := cycle(graph)) is not None:
        found.append("import cycle: " + " -> ".join(loop))
    return found


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None. Package __init__ re-exports count: `a/__init__.py` importing `a.b`
    while `a.b` imports `a` is a cycle only if `a.b` does so for a name `a` defines itself, which the
    graph cannot tell, so edges from a package to its own submodules are left out."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
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


def test_the_graph_is_read():
    graph, _ = import_graph()
    assert {"k3rl.model.modeling", "k3rl.envs.search", "k3rl.rl.commands.cli", "k3rl.rl.train.learner"} <= set(graph)
    assert "k3rl.model.config" in graph["k3rl.model.modeling"]
    assert "k3rl.envs.longctx.task" in graph["k3rl.envs.longctx.needle"]
    assert "k3rl.envs.search" in reach(graph, "k3rl.envs.longctx")


def test_the_tree_keeps_the_layers():
    found = violations(*import_graph())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, line, expect", [
    # the model reaching up to the job loader, inside a function (model/cli.py did this)
    ("k3rl.model.init", "def f():\n    from k3rl.rl.config import ConfigError", "may not import the higher layer k3rl.rl"),
    # a library module importing a command (rl/eval_runners.py did this)
    ("k3rl.rl.eval.runners", "import k3rl.rl.commands.eval", "may not import the higher layer k3rl.rl.commands"),
    # envs importing a command module (envs/search.py did this)
    ("k3rl.envs.search", "from k3rl.rl.commands.corpus import main", "may not import the higher layer"),
    ("k3rl.rl.train.learner", "from k3rl.rl.orchestrator.buffer import Taken", "never imports the orchestrator"),
    ("k3rl.rl.orchestrator.trainer", "from k3rl.rl.train.optim import build_optimizers", "only through k3rl.rl.train.group"),
    ("k3rl.rollout.worker", "import model", "by its bare name"),
    ("k3rl.envs.search", "import k3rl.envs.longctx.needle", "search is below the long-context families"),
    # a circle inside one layer
    ("k3rl.model.config", "from k3rl.model.modeling import K3ForCausalLM", "import cycle"),
])
def test_a_wrong_way_import_fails_the_check(module, line, expect):
    """The check is not vacuous: adding one wrong import to a real module makes it fail, naming it."""
    found = violations(*import_graph({module: line}))
    assert any(expect in f for f in found), found
