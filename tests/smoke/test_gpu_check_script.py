"""bench/gpu_check.sh, the one prepared GPU check, in its CPU dry mode: every step's imports with the packages the
GPU image lacks blocked, the CUDA tests collected, bench/kda_gpu.py's CPU smoke mode; one summary with a row per
step. (bench/gpu_model.py's smoke mode, the fourth step, is tests/smoke/test_gpu_model_script.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench/gpu_check.sh"


def run(tmp_path, *args, **env):
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "TMPDIR": str(tmp_path), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=600)


@pytest.mark.triton
def test_dry_run_passes_its_steps_and_writes_one_summary(tmp_path):
    proc = run(tmp_path, "--dry-run", GPU_CHECK_STEPS="env pytest kda_gpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = (tmp_path / "gpu_check.md").read_text()
    rows = dict(re.findall(r"^\| (\w+) \| (pass|fail[^|]*|timeout[^|]*) \|", summary, flags=re.M))
    assert rows == {"env": "pass", "pytest": "pass", "kda_gpu": "pass"}
    assert "imports ok" in summary
    collected = int(re.search(r"(\d+) tests collected", (tmp_path / "gpu_check.log").read_text()).group(1))
    assert collected >= 60  # the parity, SiTU and AttnRes tests, none lost to an import the GPU image lacks
    assert (tmp_path / "kda_gpu.json").exists()


def test_a_failing_step_is_recorded_and_fails_the_run(tmp_path):
    proc = run(tmp_path, "--dry-run", GPU_CHECK_STEPS="env", PYTHON="/nonexistent/python")
    assert proc.returncode == 1
    assert re.search(r"^\| env \| fail \(exit \d+\) \|", (tmp_path / "gpu_check.md").read_text(), flags=re.M)


def test_bad_flag_and_unknown_step_are_named(tmp_path):
    proc = run(tmp_path, "--wet-run")
    assert proc.returncode == 2 and "usage: bench/gpu_check.sh" in proc.stderr
    proc = run(tmp_path, "--dry-run", GPU_CHECK_STEPS="env kda_cpu")
    assert proc.returncode == 2 and "unknown step 'kda_cpu'" in proc.stderr
