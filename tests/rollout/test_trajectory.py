"""Trajectories: masks and versions from the builder, Parquet round trip, million-token size; a
1,048,576-token trajectory with routing goes through Parquet, a checkpoint of the buffer and pickle
exactly and without per-token Python objects; files of `datasets` load and `datasets` reads ours."""

import pickle
import tracemalloc
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from k3rl.rollout.trajectory import Trajectory, TrajectoryBuilder, load_trajectories, save_trajectories


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
    trajs[1].episode_id = "g0#3"  # a sequence of a multi-sequence episode (rollout/agent_endpoint.py)
    path = save_trajectories(trajs, tmp_path / "a" / "t.parquet")
    back = load_trajectories(path)
    assert len(back) == 2
    for a, b in zip(trajs, back):
        for name in ("tokens", "loss_mask", "logprobs", "versions", "turn_spans"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.reward, a.rewards, a.metrics, a.info, a.group_id, a.finish_reason, a.episode_id) == \
               (b.reward, b.rewards, b.metrics, b.info, b.group_id, b.finish_reason, b.episode_id)
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


FIELDS = ("tokens", "loss_mask", "logprobs", "versions", "turn_spans", "routed_experts")


def assert_same(a: Trajectory, b: Trajectory):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(x, y, err_msg=name)
    assert (a.prompt_len, a.reward, a.rewards, a.metrics, a.info, a.env, a.task_id, a.group_id, a.finish_reason) == \
           (b.prompt_len, b.reward, b.rewards, b.metrics, b.info, b.env, b.task_id, b.group_id, b.finish_reason)


def million(group_id="g0") -> Trajectory:
    n = 1 << 20
    rng = np.random.default_rng(1)
    mask = (np.arange(n) >= 1000).astype(np.uint8)
    return Trajectory(tokens=rng.integers(0, 160_000, n, dtype=np.int32), loss_mask=mask,
                      logprobs=(-rng.random(n, dtype=np.float32)) * mask, versions=np.where(mask, 7, -1).astype(np.int32),
                      turn_spans=np.array([[1000, n]], np.int32), prompt_len=1000, reward=0.5, rewards={"em": 0.5},
                      env="search", task_id="t0", group_id=group_id, finish_reason="done",
                      routed_experts=rng.integers(-1, 64, (n, 3, 2), dtype=np.int16))


@pytest.fixture
def warm(tmp_path):
    """One small save and load first: pyarrow imports pandas on first use, which tracemalloc would count."""
    load_trajectories(save_trajectories([build(routed=True)], tmp_path / "warm.parquet"))


@contextmanager
def no_per_token_objects():
    """Fails when the block's Python and numpy allocations (tracemalloc) peak at 6 MiB or more: a Python
    list of 1,048,576 items alone holds 8 MiB of pointers, a copy of the arrays 25 MiB (Arrow's own
    buffers are not counted)."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * 2**20, f"{peak / 2**20:.1f} MiB of Python objects for a 1,048,576-token trajectory"


def test_million_tokens_parquet_round_trip_without_per_token_objects(tmp_path, warm):
    t = million()
    with no_per_token_objects():
        path = save_trajectories([t], tmp_path / "big.parquet")
    with no_per_token_objects():
        (back,) = load_trajectories(path)
    assert_same(t, back)
    assert not back.tokens.flags.writeable  # a view of the Arrow buffer, as `ray.get` gives


def test_million_tokens_buffer_checkpoint_round_trip(tmp_path, warm):
    from k3rl.rl import checkpoint as ckpt
    from k3rl.rl.orchestrator.buffer import TrajectoryBuffer

    buffer = TrajectoryBuffer()
    small = build(routed=True)
    buffer.add([million("g1")])
    buffer.add([small])
    manager = ckpt.CheckpointManager(tmp_path / "checkpoints")
    with no_per_token_objects():
        with manager.begin(3) as tmp:
            ckpt.save_trainer_state(tmp, buffer.state_dict())
    with no_per_token_objects():
        state = ckpt.load_trainer_state(ckpt.find_latest(tmp_path / "checkpoints"), restore_rng_state=False)
    resumed = TrajectoryBuffer()
    resumed.load_state_dict(state)
    assert len(resumed) == 2 and resumed.num_trajectories == 2
    for a, b in zip(buffer.trajectories(), resumed.trajectories()):
        assert_same(a, b)


def test_million_tokens_pickle_round_trip(tmp_path):
    """Ray pickles trajectories (protocol 5, arrays out of band); loaded read-only views pickle too."""
    t = million()
    for traj in (t, load_trajectories(save_trajectories([t], tmp_path / "t.parquet"))[0]):
        buffers = []
        payload = pickle.dumps(traj, protocol=5, buffer_callback=buffers.append)
        assert len(payload) < 4096
        assert_same(t, pickle.loads(payload, buffers=buffers))
        payload = pickle.dumps(traj, protocol=5)
        assert len(payload) < 26 * 2**20
        assert_same(t, pickle.loads(payload))


def test_files_of_datasets_load_and_datasets_reads_ours(tmp_path):
    """Files written by `datasets` (before pyarrow wrote them) load; `datasets` reads ours with the same features."""
    from datasets import Dataset, load_dataset

    trajs = [build(routed=True), build()]
    old = tmp_path / "old.parquet"
    Dataset.from_list([t.to_row() for t in trajs]).to_parquet(str(old))
    no_routing = tmp_path / "old-no-routing.parquet"
    Dataset.from_list([trajs[1].to_row()]).to_parquet(str(no_routing))
    for a, b in zip(trajs, load_trajectories(old)):
        assert_same(a, b)
    assert_same(trajs[1], load_trajectories(no_routing)[0])

    new = save_trajectories(trajs, tmp_path / "new.parquet")
    ours = load_dataset("parquet", data_files=str(new), split="train", cache_dir=str(tmp_path / "cache"))
    theirs = load_dataset("parquet", data_files=str(old), split="train", cache_dir=str(tmp_path / "cache"))
    # `datasets` types an all-null column `null`; ours are typed lists (images: none in these rows)
    images = ("images", "image_shapes")
    assert ({k: v for k, v in ours.features.items() if k not in images}
            == {k: v for k, v in theirs.features.items() if k not in images})
    assert all(str(ours.features[k]).startswith("List") for k in images)
    assert ours.remove_columns(list(images)).to_list() == theirs.remove_columns(list(images)).to_list()
    assert save_trajectories([], tmp_path / "empty.parquet") and load_trajectories(tmp_path / "empty.parquet") == []


def test_row_groups_split_many_trajectories(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from k3rl.rollout import trajectory

    monkeypatch.setattr(trajectory, "_ROW_GROUP_VALUES", 60)
    trajs = [build(routed=i % 2 == 0) for i in range(7)]
    path = save_trajectories(trajs, tmp_path / "t.parquet")
    assert pq.ParquetFile(path).num_row_groups > 1
    for a, b in zip(trajs, load_trajectories(path)):
        assert_same(a, b)


def test_inconsistent_lengths_are_named():
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(np.zeros(3, np.int32), np.zeros(2, np.uint8), np.zeros(3, np.float32), np.zeros(3, np.int32),
                   np.zeros((0, 2), np.int32), 3)
    with pytest.raises(ValueError, match="logprobs"):
        TrajectoryBuilder([1]).append_sampled([1, 2], [0.0], 0)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_trajectories("nope.parquet")


def test_an_episodes_sequences_count_once_in_their_group():
    """rl/train/advantages.py `compute_advantages`: the sequences of one episode (shared `episode_id`) are one sample
    of their group, with the episode's reward, and each gets that episode's advantage; the rest is GRPO's."""
    from k3rl.rl.algos import get_algo
    from k3rl.rl.train.advantages import compute_advantages

    def seq(group, episode, reward):
        t = build()
        t.group_id, t.episode_id, t.reward = group, episode, reward
        return t

    # group g: episode a (3 sequences, reward 1), b (1 sequence, 0), c (plain trajectory, 0); group h alone
    batch = [seq("g", "a", 1.0), seq("g", "b", 0.0), seq("g", "a", 1.0), seq("g", "", 0.0), seq("g", "a", 1.0),
             seq("h", "", 1.0)]
    algo = get_algo("grpo")
    got = compute_advantages(algo, batch)
    want = algo.advantages(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)).float().numpy()  # a, b, c
    np.testing.assert_allclose(got, [want[0], want[1], want[0], want[2], want[0], 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="episode 'a' of group 'g': its sequences carry different rewards"):
        compute_advantages(algo, batch[:2] + [seq("g", "a", 0.5)])


def with_images(seed=0) -> Trajectory:
    """`build()` whose prompt and tool output each showed images (fitted RGB pixels beside the tokens)."""
    rng = np.random.default_rng(seed)
    b = TrajectoryBuilder([1, 2, 3])
    b.append_images([rng.integers(0, 256, (28, 14, 3), dtype=np.uint8)])
    b.append_sampled([10, 11], [-0.5, -1.5], version=4)
    b.append_context([7, 8, 9])
    b.append_images([rng.integers(0, 256, (14, 42, 3), dtype=np.uint8), np.zeros((14, 14, 3), dtype=np.uint8)])
    b.append_sampled([12], [-0.25], version=5)
    return b.finish(reward=1.0, group_id="g0", task_id="t0")


def test_images_round_trip_bit_exact(tmp_path, warm):
    """Pixels beside the tokens: Parquet (text-only and image trajectories in one file), the buffer's checkpoint,
    and pickling keep every byte; no per-pixel Python objects."""
    from k3rl.rl import checkpoint as ckpt
    from k3rl.rl.orchestrator.buffer import TrajectoryBuffer

    t = with_images()
    assert [p.shape for p in t.pixels()] == [(28, 14, 3), (14, 42, 3), (14, 14, 3)]
    assert t.images.dtype == np.uint8 and t.images.size == 28 * 14 * 3 + 14 * 42 * 3 + 14 * 14 * 3
    trajs = [build(), t, with_images(1)]
    with no_per_token_objects():
        back = load_trajectories(save_trajectories(trajs, tmp_path / "t.parquet"))
    assert back[0].images is None and back[0].pixels() == []
    for a, b in zip(trajs[1:], back[1:]):
        assert a.images.tobytes() == b.images.tobytes() and (a.image_shapes == b.image_shapes).all()
        assert all((p == q).all() for p, q in zip(a.pixels(), b.pixels()))
    buffer = TrajectoryBuffer()
    buffer.add(trajs)
    manager = ckpt.CheckpointManager(tmp_path / "checkpoints")
    with manager.begin(1) as tmp:
        ckpt.save_trainer_state(tmp, buffer.state_dict())
    resumed = TrajectoryBuffer()
    resumed.load_state_dict(ckpt.load_trainer_state(ckpt.find_latest(tmp_path / "checkpoints"),
                                                    restore_rng_state=False))
    assert [None if x.images is None else x.images.tobytes() for x in resumed.trajectories()] == \
           [None if x.images is None else x.images.tobytes() for x in trajs]
    assert pickle.loads(pickle.dumps(t, protocol=5)).images.tobytes() == t.images.tobytes()


def test_bad_images_are_named():
    with pytest.raises(ValueError, match=r"\[H, W, 3\] uint8"):
        TrajectoryBuilder([1]).append_images([np.zeros((14, 14), dtype=np.uint8)])
    t = with_images()
    with pytest.raises(ValueError, match="values for image shapes"):
        Trajectory(t.tokens, t.loss_mask, t.logprobs, t.versions, t.turn_spans, t.prompt_len, images=t.images[:-1],
                   image_shapes=t.image_shapes)
    with pytest.raises(ValueError, match="come together"):
        Trajectory(t.tokens, t.loss_mask, t.logprobs, t.versions, t.turn_spans, t.prompt_len, images=t.images)
