"""Joining Ray: a local cluster by default, an existing one with `ray.address=auto` (or host:port).

The driver calls `init_ray(cfg.ray)` once; everything else is placed with Ray resources. A local
cluster is started without the dashboard and without Ray's auth token (nothing listens beyond
this machine), the way tests and the CPU quickstart want it. `ray.runtime_env` is Ray's own job
runtime environment; `py_modules` extends its `py_modules` with the user's code (e.g. the module of
a `module:Class` environment, envs/registry.py), so every worker, local or remote, imports it.

Process hygiene: when a driver is killed (SIGKILL, OOM) its local cluster's GCS, raylet and workers
die with it, but Ray's per-node agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) outlive their
raylet (measured: still alive minutes later, and they ignore SIGTERM). So a local cluster comes with a
watchdog (rl/orchestrator/ray_watchdog.py), a small process that waits for the driver to exit and then stops every
process holding a file in this run's Ray session directory — a kill -9 of the driver leaves nothing of
the run within seconds (tests/smoke/test_ray_hygiene.py). A joined cluster
(`ray.address`) gets none: its processes are not the driver's. As a second line (the watchdog itself
killed), `init_ray` reaps orphans before starting a local cluster — agent processes of this user whose
raylet is gone (re-parented away from any raylet) — and says how many it found. Agents of a live
cluster, e.g. one started with `ray start`, have their raylet as parent and are left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def runtime_env(ray_cfg, py_modules: Sequence[str | Path] = ()) -> dict | None:
    """`ray.runtime_env` as a plain dict, with `py_modules` added (deduplicated); None when empty."""
    from omegaconf import OmegaConf

    env = getattr(ray_cfg, "runtime_env", None) or {}
    env = OmegaConf.to_container(env, resolve=True) if OmegaConf.is_config(env) else dict(env)
    modules = list(env.get("py_modules") or [])
    for m in map(str, py_modules):
        if m not in modules:
            modules.append(m)
    if modules:
        env["py_modules"] = modules
    return env or None


_AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
_AGENT_SCRIPTS = ("dashboard/agent.py", "runtime_env/agent/main.py")


def orphaned_agents() -> list:
    """Ray agent processes of this user whose raylet has died (their parent is no raylet), as psutil processes."""
    import psutil

    me = os.getuid()
    found = []
    for p in psutil.process_iter(["pid", "uids", "cmdline", "ppid"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["uids"] is None or p.info["uids"].real != me or not cmd:
                continue
            if not (cmd[0].startswith(_AGENT_TITLES) or any(s in " ".join(cmd[:3]) for s in _AGENT_SCRIPTS)):
                continue
            parent = psutil.Process(p.info["ppid"]) if p.info["ppid"] else None
            parent_cmd = " ".join(parent.cmdline()[:1]) if parent is not None else ""
            if "raylet" not in parent_cmd:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def reap_orphaned_agents(timeout_s: float = 5.0) -> list[int]:
    """Terminate (then kill) the agents `orphaned_agents` finds; returns their pids."""
    from k3rl.rl.orchestrator.ray_watchdog import stop

    procs = orphaned_agents()
    stop(procs, grace_s=timeout_s)
    return [p.pid for p in procs]


def init_ray(ray_cfg, log_to_driver: bool = True, py_modules: Sequence[str | Path] = ()):
    """Start or join a Ray cluster according to the `ray:` config section; return ray's context.
    If this process is already connected, the connection is kept (and its runtime env with it)."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    env = runtime_env(ray_cfg, py_modules)
    if ray_cfg.address:
        return ray.init(address=ray_cfg.address, log_to_driver=log_to_driver, runtime_env=env)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    reaped = reap_orphaned_agents()
    if reaped:
        print(f"k3rl: stopped {len(reaped)} Ray agent process(es) left behind by a killed driver "
              f"(pids {', '.join(map(str, reaped[:8]))})", file=sys.stderr)
    ctx = ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=ray_cfg.include_dashboard,
                   log_to_driver=log_to_driver, configure_logging=False, runtime_env=env)
    _watchdogs.append(start_watchdog(ray._private.worker._global_node.get_session_dir_path()))
    return ctx


_watchdogs: list = []
"""The watchdogs this process started (held so that Python does not warn about a running child it dropped)."""


def start_watchdog(session_dir: str) -> subprocess.Popen:
    """Start rl/orchestrator/ray_watchdog.py for the local cluster of `session_dir`, watching this process (the driver).
    Its own session (a Ctrl-C or a kill of the driver's process group spares it), no inherited stdio."""

    script = Path(__file__).with_name("ray_watchdog.py")
    return subprocess.Popen([sys.executable, str(script), session_dir, str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
