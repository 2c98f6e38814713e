"""The `k3rl` command line, run as a user runs it."""

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
K3RL = [shutil.which("k3rl") or sys.executable, *([] if shutil.which("k3rl") else ["-m", "k3rl.rl.commands.cli"])]


def run(*args):
    return subprocess.run([*K3RL, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_config_prints_resolved_yaml():
    r = run("config", "configs/rl/quickstart.yaml", "learner.lr=3e-5", "ray.address=auto")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["learner"]["lr"] == 3e-5 and cfg["ray"]["address"] == "auto"
    assert cfg["run"]["name"] == "quickstart"
    assert set(cfg) == {"run", "ray", "model", "rl", "algo", "rollout", "env", "learner", "pretrain", "eval", "sft"}


def test_config_unknown_key_fails_naming_it():
    r = run("config", "configs/rl/quickstart.yaml", "no.such.key=1")
    assert r.returncode != 0
    assert "no.such.key" in r.stderr and r.stdout == ""


def test_unknown_command_and_flag():
    r = run("frobnicate")
    assert r.returncode != 0 and "frobnicate" in r.stderr
    r = run("config", "configs/rl/quickstart.yaml", "--no-such-flag")
    assert r.returncode != 0 and "--no-such-flag" in r.stderr


def test_missing_config_file_is_named():
    r = run("config", "configs/rl/nope.yaml")
    assert r.returncode != 0 and "nope.yaml" in r.stderr


def test_help_and_config_do_not_import_torch():
    code = ("import sys, k3rl.rl.commands.cli; k3rl.rl.commands.cli.main(['config', 'configs/rl/quickstart.yaml']); "
            "print('TORCH' if 'torch' in sys.modules else 'LIGHT', file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().endswith("LIGHT")


def test_make_run_calls_a_real_command():
    """`make run` is one of the README's two commands: the k3rl subcommand it calls must exist."""
    import re

    from k3rl.rl.commands.cli import COMMANDS

    recipe = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    called = re.findall(r"k3rl (\w+)", recipe)
    assert called and all(c in COMMANDS for c in called), called
