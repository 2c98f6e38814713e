"""Trajectories: masks and versions from the builder, Parquet round trip, million-token size."""

import numpy as np
import pytest

from rollout.trajectory import Trajectory, TrajectoryBuilder, load_trajectories, save_trajectories


def build(routed=False):
    b = TrajectoryBuilder([1, 2, 3])
    b.append_sampled([10, 11], [-0.5, -1.5], version=4,
                     routed_experts=np.array([[[1, 2]], [[3, 4]]]) if routed else None)
    b.append_context([7, 8, 9])
    b.append_sampled([12], [-0.25], version=5, routed_experts=np.array([[[5, 6]]]) if routed else None)
    return b.finish(reward=1.0, rewards={"em": 1.0}, metrics={"tool_calls": 1.0}, info={"k": "v"},
                    env="search", task_id="t0", group_id="g0", finish_reason="done")


def test_builder_masks_versions_spans():
    t = build()
    assert t.tokens.tolist() == [1, 2, 3, 10, 11, 7, 8, 9, 12]
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert t.versions.tolist() == [-1, -1, -1, 4, 4, -1, -1, -1, 5]
    np.testing.assert_allclose(t.logprobs[t.loss_mask == 1], [-0.5, -1.5, -0.25])
    assert t.turn_spans.tolist() == [[3, 5], [8, 9]] and t.prompt_len == 3
    assert t.num_sampled == 3 and t.min_version == 4


def test_parquet_round_trip(tmp_path):
    trajs = [build(routed=True), build()]
    path = save_trajectories(trajs, tmp_path / "a" / "t.parquet")
    back = load_trajectories(path)
    assert len(back) == 2
    for a, b in zip(trajs, back):
        for name in ("tokens", "loss_mask", "logprobs", "versions", "turn_spans"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.reward, a.rewards, a.metrics, a.info, a.group_id, a.finish_reason) == \
               (b.reward, b.rewards, b.metrics, b.info, b.group_id, b.finish_reason)
    np.testing.assert_array_equal(back[0].routed_experts[3:5], [[[1, 2]], [[3, 4]]])
    assert (back[0].routed_experts[:3] == -1).all() and back[1].routed_experts is None


def test_million_tokens_cost_a_few_megabytes(tmp_path):
    n = 1_000_000
    b = TrajectoryBuilder(list(range(1000)))
    b.append_sampled(np.random.default_rng(0).integers(0, 160000, n - 1000).tolist(), [-1.0] * (n - 1000), 0)
    t = b.finish()
    nbytes = sum(getattr(t, f).nbytes for f in ("tokens", "loss_mask", "logprobs", "versions"))
    assert len(t) == n and nbytes < 14 * 2**20
    path = save_trajectories([t], tmp_path / "big.parquet")
    assert path.stat().st_size < 16 * 2**20
    assert len(load_trajectories(path)[0]) == n


def test_inconsistent_lengths_are_named():
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(np.zeros(3, np.int32), np.zeros(2, np.uint8), np.zeros(3, np.float32), np.zeros(3, np.int32),
                   np.zeros((0, 2), np.int32), 3)
    with pytest.raises(ValueError, match="logprobs"):
        TrajectoryBuilder([1]).append_sampled([1, 2], [0.0], 0)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_trajectories("nope.parquet")
