"""An agent written only against the `openai` package trains with `k3rl train` (README "Train your own agent"):
the README's `run(client, task)` is cut out of README.md and saved as `my_agent.py` in a directory of the user's
own; `env.name=my_agent:run` names it. In-process on the session's local Ray cluster, each step's trajectories
are checked: every call landed in its own episode (its prompt holds its task's word) with the tokens the engine
sampled; then the `k3rl train` command runs it against that cluster through `ray.address`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.rl.test_user_env import K3RL, recipe, user_env

REPO = Path(__file__).parents[2]
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger"]


def readme_agent() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (code,) = [b for b in blocks if "def run(client, task)" in b]
    assert len([line for line in code.splitlines() if line.strip()]) <= 30
    return code


@pytest.fixture(autouse=True)
def forget_my_agent():
    """The registry imports the user's `my_agent` into this process: each test gets its own file's."""
    sys.modules.pop("my_agent", None)
    yield
    sys.modules.pop("my_agent", None)


@pytest.fixture
def agent_dir(tmp_path):
    d = tmp_path / "my_project"
    d.mkdir()
    (d / "my_agent.py").write_text(readme_agent())
    rows = [{"id": f"w{i}", "word": w, "number": 10 + i} for i, w in enumerate(WORDS)]
    (d / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (d / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    return d


def agent_recipe(d: Path, model_dir: Path, name: str) -> Path:
    return recipe(d, model_dir, name, env__name="my_agent:run", env__tasks_path="words.jsonl",
                  eval__tasks_path="held_out.jsonl", rollout__num_workers=1)


@pytest.mark.ray
def test_an_openai_agent_trains_and_every_call_lands_in_its_episode(ray_cluster, agent_dir, tiny_qwen3_dir,
                                                                    monkeypatch):
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    monkeypatch.chdir(agent_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the registry puts the current directory on it
    tokenizer = None
    seen = []

    def check(trainer, result):
        nonlocal tokenizer
        from transformers import AutoTokenizer

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(tiny_qwen3_dir)
        trajectories = result.taken.trajectories
        seen.append(len(trajectories))
        episodes = Counter(t.episode_id for t in trajectories)
        # 2 tasks × 2 samples a step, each an episode of its own id, named after its group and sample
        assert len(episodes) == 4 and all(e.startswith(t.group_id + "#") for t in trajectories for e in [t.episode_id])
        for t in trajectories:
            task = next(json.loads(line) for line in (agent_dir / "words.jsonl").read_text().splitlines()
                        if json.loads(line)["id"] == t.task_id)
            prompt = tokenizer.decode(t.tokens[:t.turn_spans[0][0]])
            assert task["word"] in prompt and all(w not in prompt for w in WORDS if w != task["word"])
            assert t.finish_reason == "done" and t.num_sampled > 0
            assert np.all(t.versions[t.loss_mask.astype(bool)] == result.step - 1)

    cfg = load_config(agent_recipe(agent_dir, tiny_qwen3_dir, "agent"), [], schema=JobConfig)
    run_dir = Trainer(cfg, callbacks=[check]).train()
    assert len(seen) == 2 and all(n >= 4 for n in seen)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


@pytest.mark.ray
def test_k3rl_train_runs_an_openai_agent_through_ray_address(ray_cluster, agent_dir, tiny_qwen3_dir):
    address = ray_cluster.get_runtime_context().gcs_address
    out = subprocess.run([str(K3RL), "train", str(agent_recipe(agent_dir, tiny_qwen3_dir, "remote")),
                          f"ray.address={address}"], cwd=agent_dir, env=user_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (agent_dir / "runs" / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_partial_rollouts_of_an_agent_are_refused_by_name(agent_dir, tiny_qwen3_dir, monkeypatch):
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    monkeypatch.chdir(agent_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = load_config(agent_recipe(agent_dir, tiny_qwen3_dir, "partial"), ["rollout.partial_rounds=2"],
                      schema=JobConfig)
    with pytest.raises(ConfigError, match="an agent function's episodes run whole"):
        Trainer(cfg)
