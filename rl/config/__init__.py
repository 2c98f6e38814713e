"""Job configuration: one typed schema per command, composed of shared section dataclasses (as torchtitan does),
read from YAML recipes and dotted command-line overrides.

Every k3rl command reads `CONFIG.yaml` followed by `key=value` overrides
(`k3rl train configs/rl/quickstart.yaml learner.lr=1e-5 ray.address=auto`); a YAML file sets any subset of its
schema. A recipe may start from other recipes with `base:` (a path or a list of paths, relative to the file),
merged in order before the file's own values.

Mistakes are caught before any work starts: an unknown key names its full dotted path and lists the valid keys at
that level; a value of the wrong type names the key, the value and the type the schema expects; a key of an earlier
recipe names where it moved. The package: `sections.py` (run, ray, rl, algo, rollout, env, eval), `learner.py`,
`pretrain.py`, `schemas.py` (the commands' schemas), `checks.py` (their value checks), `moved.py`, `loader.py`; the
YAML + override machinery is util/yaml_config.py.
"""

from k3rl.rl.config.checks import validate
from k3rl.rl.config.learner import LearnerSection, LearnerSettings, PretrainLearner, SFTLearner, StageLearner, learner_overrides
from k3rl.rl.config.loader import check_model_code, load_config, load_model_config, to_yaml
from k3rl.rl.config.moved import MOVED_KEYS
from k3rl.rl.config.pretrain import DataSource, OptimizerHandoff, PlanConfig, PretrainConfig, StageConfig
from k3rl.rl.config.schemas import EvalJob, JobConfig, PretrainJob, QuickstartJob, SFTConfig, SFTJob, TrainJob
from k3rl.rl.config.sections import (
    AlgoSection,
    BadRows,
    DType,
    EngineName,
    EnvSection,
    EvalConfig,
    LRSchedule,
    Mode,
    Optimizer,
    PartialResume,
    RayConfig,
    Recompute,
    RLConfig,
    RolloutConfig,
    RunConfig,
    WeightSync,
)
from k3rl.util.yaml_config import ConfigError

__all__ = [
    "MOVED_KEYS", "AlgoSection", "BadRows", "ConfigError", "DType", "DataSource", "EngineName", "EnvSection", "EvalConfig",
    "EvalJob", "JobConfig", "LRSchedule", "LearnerSection", "LearnerSettings", "Mode", "Optimizer", "OptimizerHandoff",
    "PartialResume", "PlanConfig", "Recompute", "PretrainConfig", "PretrainJob", "PretrainLearner", "QuickstartJob", "RLConfig",
    "RayConfig", "RolloutConfig", "RunConfig", "SFTConfig", "SFTJob", "SFTLearner", "StageConfig", "StageLearner",
    "TrainJob", "WeightSync", "check_model_code", "learner_overrides", "load_config", "load_model_config", "to_yaml", "validate",
]
