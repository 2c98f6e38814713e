"""Fixtures shared by the tests of rl/."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory):
    """A random tiny K3 directory (4 layers: 3 KDA + 1 MLA, with its tokenizer), built once by `k3rl init`'s
    function; the `k3rl eval` tests evaluate it."""
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.sft import init_model

    cfg = load_config(REPO / "configs/model/tiny.yaml", ["model.num_hidden_layers=4",
                                                         "model.linear_attn_config.kda_layers=[1,2,3]",
                                                         "model.linear_attn_config.full_attn_layers=[4]"], JobConfig)
    return init_model(cfg.model, tmp_path_factory.mktemp("eval-k3") / "model", seed=0)
