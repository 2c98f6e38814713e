"""Joining Ray: a local cluster by default, an existing one with `ray.address=auto` (or host:port).

The driver calls `init_ray(cfg.ray)` once; everything else is placed with Ray resources. A local
cluster is started without the dashboard and without Ray's auth token (nothing listens beyond
this machine), the way tests and the CPU quickstart want it. `ray.runtime_env` is Ray's own job
runtime environment; `py_modules` extends its `py_modules` with the user's code (e.g. the module of
a `module:Class` environment, envs/registry.py), so every worker, local or remote, imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence


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
    return ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=ray_cfg.include_dashboard,
                    log_to_driver=log_to_driver, configure_logging=False, runtime_env=env)
