"""A watchdog that stops what is left of a local Ray cluster once its driver is gone (`kill -9`, OOM).

Ray ties its GCS and raylet to the driver that started them (`PR_SET_PDEATHSIG`), and workers follow their
raylet, but the raylet's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) outlive it: measured with
Ray 2.60, still alive minutes later and deaf to SIGTERM. `rl.orchestrator.cluster.init_ray` starts this file as a small
process of its own (its own session, so a signal to the driver's process group spares it) right after a
LOCAL cluster is up; it never runs for a cluster joined with `ray.address`.

It waits for its parent (the driver) to exit; then every process of this user writing to a file under the
run's Ray session directory (the `/tmp/ray/session_…` Ray made for this `ray.init`) is that run's: the GCS,
raylet, agents, workers and anything they spawned all write their logs there, and no other run writes there
(a reader, say `tail -f` on a log, is not one of them; nor is another driver that joined this cluster with
`ray.address`, which writes its `python-core-driver-*` log there: a user's program, not Ray's).
Those are sent SIGTERM, and SIGKILL after a short grace. If the raylet exits while the driver lives
(`ray.shutdown()`: Ray stops its own processes), the watchdog just exits. It imports psutil only and looks
twice a second whether its parent is still the driver. Whatever it stopped is written to
`logs/k3rl_watchdog.log` in the session directory.

    python rl/orchestrator/ray_watchdog.py SESSION_DIR DRIVER_PID
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil

GRACE_S = 2.0
"""How long a process of the session gets after SIGTERM before SIGKILL (the agents ignore SIGTERM)."""
POLL_S = 0.5
"""How often the parent link and the raylet are looked at (one cheap system call each)."""


DRIVER_LOG = "python-core-driver-"
"""How the log a Ray driver writes into the session directory is named (workers write `python-core-worker-`)."""


def session_processes(session_dir: str | Path, exclude: tuple[int, ...] = ()) -> list[psutil.Process]:
    """This user's processes (other than `exclude`) with a file under `session_dir` open for writing, Ray
    drivers (a `DRIVER_LOG` among those files) left out."""
    root = os.path.realpath(session_dir) + os.sep
    me = os.getuid()
    found = []
    for p in psutil.process_iter(["pid", "uids"]):
        if p.pid in exclude or p.info["uids"] is None or p.info["uids"].real != me:
            continue
        try:
            written = [f.path for f in p.open_files() if f.path.startswith(root) and getattr(f, "mode", "w") != "r"]
            if written and not any(os.path.basename(f).startswith(DRIVER_LOG) for f in written):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stop(procs: list[psutil.Process], grace_s: float = GRACE_S) -> list[psutil.Process]:
    """SIGTERM `procs`, SIGKILL those still alive after `grace_s`; returns the ones that were signalled."""
    signalled = []
    for p in procs:
        try:
            p.terminate()
            signalled.append(p)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(signalled, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return signalled


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(session_dir: str, driver: int, poll_s: float = POLL_S) -> list[psutil.Process]:
    """Wait while `driver` is this process's parent; once it is gone, stop the session's processes and return
    them. Returns [] without stopping anything if the session's raylet exits first (`ray.shutdown()`)."""
    raylet = next((p for p in session_processes(session_dir, exclude=(os.getpid(), driver)) if _name(p) == "raylet"),
                  None)
    # the parent, not the pid, is watched: a dead driver's pid may be reused, the parent link is not
    while os.getppid() == driver:
        if raylet is not None and not _alive(raylet):
            return []
        time.sleep(poll_s)
    stopped: list[psutil.Process] = []
    # a second look catches what a dying process spawned meanwhile (its children inherit its session logs)
    for _ in range(3):
        found = stop(session_processes(session_dir, exclude=(os.getpid(), driver)))
        if not found:
            break
        stopped += found
    return stopped


def main(argv: list[str]) -> int:
    session_dir, driver = argv[0], int(argv[1])
    stopped = watch(session_dir, driver)
    if stopped:
        with open(Path(session_dir) / "logs" / "k3rl_watchdog.log", "a") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} the driver exited without ray.shutdown(); stopped "
                      f"{len(stopped)} process(es) of this session: {', '.join(str(p.pid) for p in stopped)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
