"""Packed weights (rollout/weight_transfer.py): every tensor comes back bit-exact with its name, dtype and shape,
through Ray's object store too (read-only views an engine copies from), and an engine loads them."""

from __future__ import annotations

import pytest
import torch

from k3rl.rollout.weight_transfer import ALIGN, pack_weights


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 10, generator=g)
    return [
        ("w.fp32", torch.randn(3, 5, generator=g)),
        ("w.bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("w.fp64", torch.randn(2, 2, generator=g, dtype=torch.float64)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 4)),
        ("ids", torch.arange(5, dtype=torch.int64)),
        ("flags", torch.tensor([True, False, True])),
        ("transposed", wide.t()),  # not contiguous
        ("odd.fp16", torch.randn(3, generator=g).to(torch.float16)),  # 6 bytes: the next tensor starts aligned
    ]


def check_same(named, packed):
    got = list(packed)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (name, want), (_, t) in zip(named, got):
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t, want), name


def test_round_trip_is_bit_exact_for_every_dtype_and_shape():
    named = sample_tensors()
    packed = pack_weights(named)
    assert len(packed) == len(named) and all(o % ALIGN == 0 for o in packed.offsets)
    check_same(named, packed)
    named[0][1].add_(1.0)  # the pack is a copy: later training steps do not reach it
    assert not torch.equal(dict(packed)["w.fp32"], named[0][1])


@pytest.mark.ray
def test_through_the_object_store_an_engine_loads_every_tensor(ray_cluster, tiny_qwen3_dir):
    named = sample_tensors()
    back = ray_cluster.get(ray_cluster.put(pack_weights(named)))
    check_same(named, back)

    from k3rl.rollout.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(tiny_qwen3_dir)
    new = [(n, torch.randn_like(t)) for n, t in engine.model.state_dict().items()]
    engine.load_weights(ray_cluster.get(ray_cluster.put(pack_weights(new))), version=3)
    state = engine.model.state_dict()
    assert engine.version == 3 and all(torch.equal(state[n], t) for n, t in new)


def test_a_kept_buffer_is_refilled_and_a_wrong_sized_one_replaced():
    named = sample_tensors()
    first = pack_weights(named)
    named[0][1].mul_(2.0)
    again = pack_weights(named, reuse=first.buffer)
    assert again.buffer is first.buffer
    check_same(named, again)
    fresh = pack_weights(named[:2], reuse=first.buffer)
    assert fresh.buffer is not first.buffer
    check_same(named[:2], fresh)
