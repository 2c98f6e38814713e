"""Shared test infrastructure: markers, a local Ray cluster, vLLM on the CPU, Triton's interpreter.

Environment set here, before anything imports Ray, vLLM or Triton:
- Ray: no auth token, no usage stats, no dashboard (a local cluster for the session).
- Triton: without a GPU, TRITON_INTERPRET=1 so `@triton.jit` kernels run on CPU tensors.
- vLLM: the in-process engine with a small KV cache (rollout/vllm_cpu.py); torch runs on one
  thread while a vLLM test runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (2 CPUs, no dashboard) shared by the session's Ray tests."""
    import ray

    from k3rl.rl.config import RayConfig
    from k3rl.rl.orchestrator.cluster import init_ray

    init_ray(RayConfig(address=None, num_cpus=2), log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny HF Qwen3 (head_dim 32, untied) with a tokenizer trained locally."""
    from k3rl.rollout.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def vllm_cpu():
    """A factory of in-process CPU vLLM engines; torch uses one thread while they live."""
    from k3rl.rollout.vllm_cpu import configure_cpu_env, make_cpu_llm

    configure_cpu_env()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_cpu_llm
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def vllm_engine(tiny_qwen3_dir, vllm_cpu):
    """One in-process VLLMEngine on the tiny Qwen3, shared by the session (tests that change its
    weights put the originals back)."""
    from k3rl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(tiny_qwen3_dir, max_model_len=2048, seed=0)


@pytest.fixture
def nan_poison(monkeypatch):
    """Fresh float memory from torch.empty / empty_like / empty_strided / Tensor.new_empty is filled with
    NaN, so a kernel that skips a write produces NaN instead of passing on whatever the allocator left there.
    Active for the whole test, backward passes included (autouse for every test under tests/kernels/)."""
    empty, empty_like, empty_strided = torch.empty, torch.empty_like, torch.empty_strided
    new_empty = torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: poison(empty_strided(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(new_empty(self, *a, **k)))
    yield
