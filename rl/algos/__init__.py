"""Training objectives behind one interface (`base.Algorithm`), selected by name: `get_algo("grpo", eps_high=0.28)`.

The RL algorithms (grpo, dr_grpo, rloo, ppo, gspo, cispo) and the supervised `nll` objective (SFT and
next-token pretraining: rl/algos/nll.py), so the learner trains every objective the same way.

Exports the interface (`Algorithm`, `AlgoConfig`, `LossInputs`), the registry `ALGOS` and
`get_algo`. Imports torch only (no Ray, no vLLM).
"""

from __future__ import annotations

from k3rl.rl.algos.base import AlgoConfig, Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.cispo import CISPO
from k3rl.rl.algos.dr_grpo import DrGRPO
from k3rl.rl.algos.grpo import GRPO
from k3rl.rl.algos.gspo import GSPO
from k3rl.rl.algos.nll import NLL
from k3rl.rl.algos.ppo import PPO
from k3rl.rl.algos.rloo import RLOO

ALGOS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (GRPO, DrGRPO, RLOO, PPO, GSPO, CISPO, NLL)}


def get_algo(name: str, **cfg) -> Algorithm:
    """The algorithm registered as `name`, configured by `cfg` (its Config's fields).

    An unknown name, or a setting the algorithm does not have, is a ValueError listing the valid ones.
    """
    if name not in ALGOS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(ALGOS))}")
    return ALGOS[name].from_kwargs(**cfg)


__all__ = ["ALGOS", "AlgoConfig", "Algorithm", "ClipConfig", "LossInputs", "get_algo"]
