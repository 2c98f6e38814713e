"""Every kernel test runs with fresh memory NaN-poisoned (tests/conftest.py `nan_poison`: torch.empty,
empty_like, empty_strided and Tensor.new_empty, backward passes included), so a kernel or a PyTorch path that
returns or reads an element it never wrote fails its comparison instead of passing on leftover memory."""

import pytest


@pytest.fixture(autouse=True)
def _poison_fresh_memory(nan_poison):
    yield
