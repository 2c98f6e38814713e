"""rl/orchestrator/ray_watchdog.py without Ray: a fake session directory, a "driver" that starts the watchdog and dies, a member
writing a log there (stopped) and a reader of that log (left alone). With a real cluster:
tests/smoke/test_ray_hygiene.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from k3rl.rl.orchestrator.ray_watchdog import session_processes

REPO = Path(__file__).parents[2]


def hold(path: Path, mode: str) -> subprocess.Popen:
    """A process keeping `path` open in `mode` until killed."""
    code = f"import time; f = open({str(path)!r}, {mode!r}); print('ok', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ok"
    return proc


def test_a_dead_drivers_session_writers_are_stopped_and_its_readers_kept(tmp_path):
    """Stopped: a process writing a log of the session. Kept: a reader of it, and another driver joined to the
    cluster (writing its own python-core-driver log there)."""
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    log = session / "logs" / "worker.out"
    log.write_text("")
    member, reader = hold(log, "a"), hold(log, "r")
    joined = hold(session / "logs" / "python-core-driver-01000000_123.log", "a")
    try:
        assert {p.pid for p in session_processes(session)} == {member.pid}
        driver = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(REPO)!r})
            from k3rl.rl.orchestrator.cluster import start_watchdog
            print(start_watchdog({str(session)!r}).pid, flush=True)
        """)
        out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60)
        watchdog = psutil.Process(int(out.stdout))  # its driver has exited
        member.wait(15)
        assert reader.poll() is None and joined.poll() is None
        watchdog.wait(15)
        stopped = (session / "logs/k3rl_watchdog.log").read_text()
        assert f"stopped 1 process(es) of this session: {member.pid}" in stopped
    finally:
        for proc in (member, reader, joined):
            proc.kill()
            proc.wait()


def test_the_watchdog_leaves_when_the_session_ends_first(tmp_path):
    """`ray.shutdown()` while the driver lives: the raylet exits, the watchdog leaves without stopping anything."""
    session = tmp_path / "session_y"
    (session / "logs").mkdir(parents=True)
    raylet = session / "logs" / "raylet.out"
    raylet.write_text("")
    named = tmp_path / "raylet"  # a process named raylet (its executable's name), writing the session's log
    named.symlink_to(shutil.which("sleep"))
    with open(raylet, "a") as out:
        fake = subprocess.Popen([str(named), "600"], stdout=out)
    time.sleep(0.5)
    other = hold(session / "logs" / "agent.out", "a")
    watchdog = subprocess.Popen([sys.executable, str(REPO / "rl/orchestrator/ray_watchdog.py"), str(session),
                                 str(psutil.Process().pid)])
    try:
        time.sleep(1.5)  # it has found the raylet
        fake.kill()
        fake.wait()
        assert watchdog.wait(15) == 0
        assert other.poll() is None and not (session / "logs/k3rl_watchdog.log").exists()
    finally:
        for proc in (fake, other, watchdog):
            proc.kill()
            proc.wait()
