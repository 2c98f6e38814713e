"""Process hygiene: a driver killed with SIGKILL (no `ray.shutdown`, no atexit) leaves no process of the local
Ray cluster it started behind for long. GCS, raylet, workers and actors go with it (Ray's fate-sharing);
Ray's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) outlive their raylet, and the next local start
(`rl.cluster.init_ray`) reaps them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
DRIVER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import ray
from rl.cluster import init_ray
from rl.config import RayConfig

init_ray(RayConfig(address=None, num_cpus=1), log_to_driver=False)

@ray.remote(num_cpus=0)
class Actor:
    def pid(self):
        return os.getpid()

actor = Actor.remote()
print(ray.get(actor.pid.remote()), flush=True)
time.sleep(600)
"""


def test_a_killed_driver_leaves_no_local_cluster_behind(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=str(REPO)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        actor_pid = int(driver.stdout.readline())  # the cluster and an actor are up
        tree = psutil.Process(driver.pid).children(recursive=True)
        if actor_pid not in {p.pid for p in tree}:
            tree.append(psutil.Process(actor_pid))
        names = {p.pid: " ".join(p.cmdline()[:2])[:80] for p in tree}  # for messages and the agents' prefixes
        programs = [os.path.basename(p.cmdline()[0]) for p in tree if p.cmdline()]  # whatever the checkout's path
        assert any(name in ("gcs_server", "raylet") for name in programs), names
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            alive = [p for p in tree if _alive(p)]
            if all(names[p.pid].startswith(AGENTS) for p in alive):
                break
            time.sleep(1)
        assert all(names[p.pid].startswith(AGENTS) for p in alive), \
            f"left behind after kill -9 of the driver: {[names[p.pid] for p in alive]}"
        if alive:  # the agents outlived their raylet: the next local start reaps them
            from rl.cluster import orphaned_agents, reap_orphaned_agents

            assert {p.pid for p in alive} <= {p.pid for p in orphaned_agents()}
            reaped = reap_orphaned_agents()
            assert {p.pid for p in alive} <= set(reaped)
            gone_by = time.monotonic() + 10
            while [p for p in tree if _alive(p)] and time.monotonic() < gone_by:
                time.sleep(0.2)
            assert not [names[p.pid] for p in tree if _alive(p)]
    finally:
        if driver.poll() is None:
            driver.kill()
        if _group_alive(driver.pid):  # whatever a failed check left behind
            os.killpg(driver.pid, signal.SIGKILL)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
