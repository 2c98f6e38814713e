"""Process hygiene: a driver killed with SIGKILL (no `ray.shutdown`, no atexit) leaves no process of the local
Ray cluster it started behind. GCS, raylet, workers and actors go with it (Ray's fate-sharing); Ray's agents
(`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) outlive their raylet, and the run's watchdog
(rl/orchestrator/ray_watchdog.py) stops them: an async `k3rl train` run killed mid-step leaves nothing of its Ray session
alive 15 s later. With the watchdog killed too, the next local start (`rl.orchestrator.cluster.init_ray`) reaps them.

"Of the run" is checked two ways: the driver's process tree taken before the kill, and every process holding
a file under the run's Ray session directory (where each of its processes keeps its logs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.rl.test_trainer import child_env, overrides, task_files, write_config  # noqa: F401 (task_files)

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
RUN = ("ray::LearnerWorker", "ray::RolloutWorker", *AGENTS)
DRIVER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import ray
from k3rl.rl.orchestrator.cluster import init_ray
from k3rl.rl.config import RayConfig

init_ray(RayConfig(address=None, num_cpus=1), log_to_driver=False)

@ray.remote(num_cpus=0)
class Actor:
    def pid(self):
        return os.getpid()

actor = Actor.remote()
print(ray.get(actor.pid.remote()), flush=True)
time.sleep(600)
"""


def holding(session_dir: Path) -> list[psutil.Process]:
    """Processes with an open file under `session_dir` (every process of a Ray session logs there)."""
    root = str(session_dir) + os.sep
    found = []
    for p in psutil.process_iter():
        try:
            if _alive(p) and any(f.path.startswith(root) for f in p.open_files()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def session_of(tree: list[psutil.Process]) -> Path:
    """The Ray session directory of a driver's process tree (where its raylet writes `logs/raylet.out`)."""
    raylet = next(p for p in tree if p.name() == "raylet")
    return Path(next(f.path for f in raylet.open_files() if f.path.endswith("/logs/raylet.out"))).parents[1]


def wait_gone(tree: list[psutil.Process], session_dir: Path, within_s: float, but: set[int] = frozenset()) -> list[str]:
    """Poll until nothing of `tree` is alive and nothing holds a file of `session_dir` (`but` those pids); what
    is left after `within_s` (command lines), [] if nothing."""
    deadline = time.monotonic() + within_s
    while True:
        left = {p.pid: p for p in tree if _alive(p)} | {p.pid: p for p in holding(session_dir)}
        if set(left) <= but or time.monotonic() > deadline:
            return [_name(p) for p in left.values()]
        time.sleep(0.5)


def test_a_killed_async_driver_leaves_no_ray_process_of_its_run(tiny_qwen3_dir, task_files, tmp_path):
    items = overrides(tmp_path, tiny_qwen3_dir, task_files, "killed", mode="async", max_staleness=1, steps=50,
                      save_every=0, eval_every=0)
    config = write_config(tmp_path / "job.yaml", items)
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "k3rl.rl.commands.train", str(config)], cwd=REPO, env=child_env(),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    session_dir = None
    try:
        # once the run's learner and rollout worker are up (both actors' processes, the agents beside them)
        deadline = time.monotonic() + 180
        while not _running(driver.pid, RUN) and driver.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.2)
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        tree = psutil.Process(driver.pid).children(recursive=True)
        session_dir = session_of(tree)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        left = wait_gone(tree, session_dir, 15)
        assert not left, f"alive 15 s after kill -9 of the driver: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
        for p in holding(session_dir) if session_dir is not None else []:
            p.kill()


def test_with_the_watchdog_killed_too_the_next_local_start_reaps_the_agents(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=str(REPO)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    session_dir = None
    try:
        actor_pid = int(driver.stdout.readline())  # the cluster and an actor are up
        tree = psutil.Process(driver.pid).children(recursive=True)
        if actor_pid not in {p.pid for p in tree}:
            tree.append(psutil.Process(actor_pid))
        programs = [os.path.basename(p.cmdline()[0]) for p in tree if p.cmdline()]  # whatever the checkout's path
        assert "gcs_server" in programs and "raylet" in programs, programs
        agents = [p for p in tree if _name(p).startswith(AGENTS)]
        assert agents, [_name(p) for p in tree]
        session_dir = session_of(tree)
        watchdogs = [p for p in tree if "ray_watchdog.py" in " ".join(p.cmdline())]
        assert len(watchdogs) == 1, [_name(p) for p in tree]
        watchdogs[0].kill()
        while _alive(watchdogs[0]):  # a zombie until its parent, the driver, dies
            time.sleep(0.1)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        # without the watchdog the agents outlive their raylet; the next local start reaps them
        left = wait_gone(tree, session_dir, 15, but={p.pid for p in agents})
        assert left and all(name.startswith(AGENTS) for name in left), left
        from k3rl.rl.orchestrator.cluster import orphaned_agents, reap_orphaned_agents

        alive = {p.pid for p in agents if _alive(p)}
        assert alive <= {p.pid for p in orphaned_agents()}
        assert alive <= set(reap_orphaned_agents())
        assert not wait_gone(tree, session_dir, 10)
    finally:
        if driver.poll() is None:
            driver.kill()
        if _group_alive(driver.pid):  # whatever a failed check left behind
            os.killpg(driver.pid, signal.SIGKILL)
        for p in holding(session_dir) if session_dir is not None else []:
            p.kill()


def _running(pid: int, titles: tuple[str, ...]) -> bool:
    """Whether a process of each title runs under `pid`."""
    try:
        names = [_name(p) for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    return all(any(n.startswith(t) for n in names) for t in titles)


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()[:2])[:80]
    except psutil.Error:
        return f"pid {p.pid}"


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
