"""An environment of the user's own, outside the package, trains with one `k3rl train` command.

The README's `Guess` example is cut out of README.md and saved as `guess_env.py` in a temporary
directory (not on PYTHONPATH); `env.name=guess_env:Guess` names it. The driver imports it from the
current directory and ships the file to the Ray workers (`py_modules`), on a local cluster started
by the driver (two rollout workers) and on a cluster started with `ray start --head`
(`ray.address`). Also: an unknown environment is a named config error before anything is written,
an installed package's `k3rl.envs` entry point resolves, and held-out tasks equal to a training task
are counted. The user's directory also holds their own `model.py`, `rl.py`, `envs.py`, `rollout.py`
and `util.py`, which k3rl (installed as `k3rl.*`) must not import.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[2]
K3RL = Path(sys.executable).with_name("k3rl")


def readme_guess() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (code,) = [b for b in blocks if "class Guess" in b]
    return code


@pytest.fixture
def user_dir(tmp_path):
    d = tmp_path / "my_project"
    d.mkdir()
    (d / "guess_env.py").write_text(readme_guess())
    # the user's own modules named like k3rl's folders: the driver imports from this directory, k3rl is k3rl.*
    for name in ("model", "rl", "envs", "rollout", "util"):
        (d / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    (d / "train.jsonl").write_text("".join(json.dumps({"id": f"g{i}", "secret": 10 * i + 7}) + "\n" for i in range(4)))
    # the first held-out task is a training task in disguise (another id, same content)
    (d / "eval.jsonl").write_text(json.dumps({"id": "e0", "secret": 7}) + "\n" + json.dumps({"id": "e1", "secret": 55}) + "\n")
    return d


def recipe(d: Path, model_dir: Path, name: str, **extra) -> Path:
    cfg = {"run": {"name": name, "output_dir": str(d / "runs")},
           "ray": {"num_cpus": 2},
           "rl": {"model_path": str(model_dir), "steps": 2, "tasks_per_step": 2, "group_size": 2, "save_every": 0},
           "env": {"name": "guess_env:Guess", "tasks_path": "train.jsonl"},
           "eval": {"tasks_path": "eval.jsonl", "every": 2},
           "rollout": {"max_new_tokens": 16, "max_turns": 2, "max_context_tokens": 1024, "num_workers": 2,
                       "num_cpus": 0.5},
           "learner": {"lr": 1e-4, "num_cpus": 0.5}}
    for key, value in extra.items():
        section, leaf = key.split("__")
        cfg.setdefault(section, {})[leaf] = value
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def user_env() -> dict:
    """The user's shell: no PYTHONPATH pointing at their project, no Ray address inherited."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}


def train(d: Path, config: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(K3RL), "train", str(config), *overrides], cwd=d, env=user_env(), capture_output=True,
                          text=True, timeout=600)


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_unknown_environment_is_named_before_anything_is_written(user_dir, tiny_qwen3_dir):
    out = train(user_dir, recipe(user_dir, tiny_qwen3_dir, "typo"), "env.name=guess")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "env.name: unknown environment 'guess'" in out.stderr and "module.path:ClassName" in out.stderr
    out = train(user_dir, recipe(user_dir, tiny_qwen3_dir, "typo"), "env.name=guess_env:Gues")
    assert out.returncode == 2 and "has no attribute 'Gues'" in out.stderr
    out = train(user_dir, recipe(user_dir, tiny_qwen3_dir, "typo"), "env.name=gess_env:Guess")
    assert out.returncode == 2 and "cannot import module 'gess_env'" in out.stderr
    assert not (user_dir / "runs").exists()


def test_resolve_module_class_and_entry_point(user_dir, monkeypatch):
    from k3rl.envs import Env
    from k3rl.envs.registry import list_envs, make, resolve, user_module_path

    monkeypatch.chdir(user_dir)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(user_dir))])
    entry = resolve("guess_env:Guess")
    assert issubclass(entry.target, Env) and entry.summary == "Find a secret number in 1..100 by probing."
    assert user_module_path("guess_env:Guess") == (user_dir / "guess_env.py").resolve()
    assert user_module_path("needle") is None and user_module_path("k3rl.envs.search:SearchEnv") is None
    # an installed distribution declaring the entry point (a .dist-info on sys.path)
    site = user_dir / "site"
    info = site / "my_envs-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[k3rl.envs]\nnumber-guess = guess_env:Guess\n")
    monkeypatch.syspath_prepend(str(site))
    env = make("number-guess")
    assert env.reset({"secret": 3}).startswith("I picked a number")
    assert "number-guess" in [e.name for e in list_envs()]


@pytest.mark.ray
def test_user_environment_trains_on_a_local_cluster_of_two_workers(user_dir, tiny_qwen3_dir):
    out = train(user_dir, recipe(user_dir, tiny_qwen3_dir, "local"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps_logged(user_dir / "runs" / "local") == [0, 1, 2]
    assert "held-out tasks: dropped 1 of 2 that equal a training task, 1 left" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
def test_user_environment_trains_on_a_cluster_started_with_ray_start(user_dir, tiny_qwen3_dir, tmp_path):
    port = _free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="k3rl-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = user_env() | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                             f"--temp-dir={temp_dir}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}'); ray.shutdown()"],
                                   env=env, capture_output=True, timeout=120)
            if probe.returncode == 0:
                break
            assert head.poll() is None, head.stdout.read()[-3000:]
            assert time.time() < deadline - 1, probe.stderr[-3000:]
            time.sleep(1)
        out = subprocess.run([str(K3RL), "train", str(recipe(user_dir, tiny_qwen3_dir, "remote")),
                              f"ray.address={address}"], cwd=user_dir, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert steps_logged(user_dir / "runs" / "remote") == [0, 1, 2]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
