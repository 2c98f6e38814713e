"""Joining Ray: a local cluster by default, an existing one with `ray.address=auto` (or host:port).

The driver calls `init_ray(cfg.ray)` once; everything else is placed with Ray resources. A local
cluster is started without the dashboard and without Ray's auth token (nothing listens beyond
this machine), the way tests and the CPU quickstart want it.
"""

from __future__ import annotations

import os


def init_ray(ray_cfg, log_to_driver: bool = True):
    """Start or join a Ray cluster according to the `ray:` config section; return ray's context."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    if ray_cfg.address:
        return ray.init(address=ray_cfg.address, log_to_driver=log_to_driver)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return ray.init(num_cpus=ray_cfg.num_cpus, include_dashboard=ray_cfg.include_dashboard,
                    log_to_driver=log_to_driver, configure_logging=False)
