"""The table of long-context families: name → module, and the options their generators take.

Each family module (needle.py, multihop.py, aggregate.py, ith.py) defines ``NAME``,
``SUMMARY``, ``OPTIONS`` (its own options with their defaults), ``generate(rng, names,
opt) -> Spec`` and ``solve(question) -> Solver``. A new family is a new module listed here.
"""

from __future__ import annotations

from k3rl.envs.longctx import aggregate, ith, multihop, needle

_MODULES = {m.NAME: m for m in (needle, multihop, aggregate, ith)}

FAMILIES = {name: m.SUMMARY for name, m in _MODULES.items()}
"""Family name → one-line summary (what ``k3rl envs`` shows)."""
GENERATORS = {name: m.generate for name, m in _MODULES.items()}
SOLVERS = {name: m.solve for name, m in _MODULES.items()}
DEFAULTS = {"unanswerable_rate": 0.1}
"""Every option a task or an environment may set, with its default (any family accepts all of them)."""
for _module in _MODULES.values():
    DEFAULTS.update(_module.OPTIONS)
