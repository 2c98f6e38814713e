"""rollout/weight_broadcast.py: the packed weights from rank 0 to every other rank of a gloo group (threads of this
process stand in for the learner and two rollout workers; tests/rl/test_trainer.py runs it between Ray actors)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from k3rl.rollout.weight_broadcast import BroadcastGroup, WeightLayout
from k3rl.rollout.weight_transfer import pack_weights


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_ranks(world_size: int, body) -> list:
    """body(group) on every rank of one group, each in its own thread; the results in rank order."""
    address, results, errors = free_address(), [None] * world_size, []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = body(BroadcastGroup(address, rank, world_size, "gloo", timeout_s=60))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def test_every_receiver_gets_every_tensor_bit_for_bit():
    torch.manual_seed(0)
    named = [("a.weight", torch.randn(5, 3)), ("b.bias", torch.randn(7, dtype=torch.float64)),
             ("c.bf16", torch.randn(4, 4).to(torch.bfloat16)), ("d.empty", torch.zeros(0, 3)),
             ("e.int", torch.arange(6, dtype=torch.int64).view(2, 3))]
    packed = pack_weights(named)
    layout = WeightLayout.of(packed)
    assert layout.nbytes == packed.buffer.shape[0]

    def body(group):
        if group.rank == 0:
            group.send(packed)
            return None
        return [(n, t.clone()) for n, t in group.receive(layout)]

    received = run_ranks(3, body)
    for got in received[1:]:
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, t), (_, ref) in zip(got, named):
            assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref)


def test_misuse_is_named():
    packed = pack_weights([("w", torch.ones(3))])
    with pytest.raises(ValueError, match="a buffer of .* bytes for a layout of"):
        WeightLayout.of(packed).with_buffer(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="backend: 'mpi'"):
        BroadcastGroup(free_address(), 0, 2, "mpi")
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        BroadcastGroup(free_address(), 2, 2)

    def body(group):
        with pytest.raises(RuntimeError, match="only rank 0 sends" if group.rank else "does not receive"):
            group.send(packed) if group.rank else group.receive(WeightLayout.of(packed))
        return True

    assert run_ranks(2, body) == [True, True]
