"""bench/gpu_model.py, the whole-model GPU bench, runs its every step on the CPU (`--smoke-cpu`: Triton interpreted,
tiny shapes) with every check passing and every Triton entry point called, importing none of the packages the GPU
image lacks; without a GPU and without `--smoke-cpu` it says so and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench/gpu_model.py"
ABSENT_ON_GPU_IMAGE = ("ray", "vllm", "trl", "datasets", "bm25s", "faiss", "openai", "sentence_transformers")
STEPS = ("forward_backward", "learner", "decode", "train_time")
FAMILIES = ("chunk_kda", "fused_recurrent_kda", "attn_res", "moe", "situ")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("K3RL_DISABLE_TRITON", "K3RL_FORCE_TRITON")}


@pytest.mark.triton
@pytest.mark.slow
def test_smoke_cpu_runs_every_step_through_triton(tmp_path):
    # the script as `python bench/gpu_model.py --smoke-cpu --out tmp`, with the GPU image's missing packages unimportable
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({ABSENT_ON_GPU_IMAGE!r})); "
            f"sys.argv = [{str(SCRIPT)!r}, '--smoke-cpu', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_model.json").read_text())
    assert (tmp_path / "gpu_model.md").read_text().count("| yes |") > 20
    assert tuple(result["steps"]) == STEPS and result["ok"]
    for name, step in result["steps"].items():
        assert step["error"] is None, step["error"]
        assert step["checks"] and all(c["ok"] for c in step["checks"]), (name, [c for c in step["checks"] if not c["ok"]])
    assert all(result["triton_calls"].get(f, 0) > 0 for f in FAMILIES), result["triton_calls"]
    assert result["steps"]["learner"]["info"]["driver"] == "rl.train.learner.Learner"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole bench")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], env=clean_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "needs a CUDA GPU" in r.stdout
    assert not (tmp_path / "gpu_model.json").exists()
