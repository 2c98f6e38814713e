"""Prefix-tree training (rl/train/prefix_tree.py) against the same sequences run apart, in float64: the loss and every
parameter gradient of a step are the same on a batch whose shared prefixes nest — a system prompt shared across
tasks, a task's prompt, a first turn (sampled: loss rows inside a shared span) and a tool output several samples
agree on, the restarts of a compacted episode — for K3 (one graph, segments of several sizes, routing replay, a
sequence-level objective) and a tiny Qwen3 (its KV cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3rl.rl.train.batching import to_train_sequence
from k3rl.rl.train.prefix_tree import build_tree, plan_trees
from k3rl.rollout.trajectory import TrajectoryBuilder
from tests.rl.test_segments import V, assert_same, k3_nope, k3_path, make_learner, step_grads  # noqa: F401


class Parts:
    """Random spans of tokens, each with its behaviour log-probs and routing, drawn once and reused: sequences built
    from the same parts agree on them exactly (tokens and recorded routing), as samples of one policy that took the
    same turn do. Each part starts with its own token (its number), so that different parts never agree by chance."""

    def __init__(self, seed: int, routed: bool):
        self.rng, self.routed, self.made = np.random.default_rng(seed), routed, {}

    def __call__(self, name: str, n: int):
        if name not in self.made:
            route = self.rng.integers(0, 4, size=(n, 3, 2)) if self.routed else None
            tokens = [len(self.made) + 1, *self.rng.integers(1, V, n - 1).tolist()]
            self.made[name] = (tokens, (-self.rng.random(n)).tolist(), route)
        return self.made[name]


def nested_batch(seed=0, routed=False):
    """Nine trajectories whose prefixes nest (names: context spans UPPER, sampled ones lower):

        SYS(20) TASK(20) first(20) OUT1(18) r1(15)       group a: a task's samples; three take the same first turn,
        SYS     TASK     first     OUT1     r2(12)                two of those get the same tool output
        SYS     TASK     first     OUT2(20) r3(10)
        SYS     TASK     other(25)
        SYS     TASK     SUMMARY(30) r5(15)               the restart of a compacted episode of a: [system, task, summary]
        SYS     TASK2(30) c1(10)                          group c: another task under the same system prompt
        SYS     TASK2     c2(14)
        SHORT(9) b1(30)  /  SHORT b2(11)                  group b: a prompt too short to share
    """
    part = Parts(seed, routed)

    def make(spans, group, reward):
        b = TrajectoryBuilder(part(*spans[0])[0])
        for name, n in spans[1:]:
            tokens, logprobs, route = part(name, n)
            if name.isupper():
                b.append_context(tokens)
            else:
                b.append_sampled(tokens, logprobs, 0, route)
        return b.finish(reward=reward, group_id=group, task_id=group)

    sys_task = [("SYS", 20), ("TASK", 20)]
    return [make([*sys_task, ("first", 20), ("OUT1", 18), ("r1", 15)], "a", 1.0),
            make([*sys_task, ("first", 20), ("OUT1", 18), ("r2", 12)], "a", 0.0),
            make([*sys_task, ("first", 20), ("OUT2", 20), ("r3", 10)], "a", 0.5),
            make([*sys_task, ("other", 25)], "a", 0.0),
            make([*sys_task, ("SUMMARY", 30), ("r5", 15)], "a", 1.0),
            make([("SYS", 20), ("TASK2", 30), ("c1", 10)], "c", 1.0),
            make([("SYS", 20), ("TASK2", 30), ("c2", 14)], "c", 0.0),
            make([("SHORT", 9), ("b1", 30)], "b", 1.0),
            make([("SHORT", 9), ("b2", 11)], "b", 0.0)]


def sequences(trajectories):
    return [to_train_sequence(t, float(i)) for i, t in enumerate(trajectories)]


def shape(tree):
    return [(n.parent, n.start, tuple(n.ids.shape)) for n in tree.nodes]


def test_plan_and_build_nested_tree():
    seqs = sequences(nested_batch())
    trees, rest = plan_trees(seqs, token_budget=10_000)
    assert rest == [7, 8]  # the 9-token prompt is shorter than MIN_SHARED
    (members,) = trees
    assert sorted(members) == list(range(7))
    tree = build_tree([seqs[i] for i in members], torch.device("cpu"), None)
    # SYS; under it TASK (its last position predicts each sample's first token), whose leaves are `other` and the
    # compacted restart; `first` (the three samples that took it agree until their tool outputs), whose leaf is r3's
    # sample, and OUT1 with the leaves r1, r2; then TASK2 with c1, c2. Each node lists its leaf batch before its
    # children; each sequence keeps what no other shares as a row of a leaf batch.
    assert shape(tree) == [(-1, 0, (1, 20)), (0, 20, (1, 20)), (1, 40, (2, 44)), (1, 40, (1, 20)), (3, 60, (1, 29)),
                           (3, 60, (1, 18)), (5, 78, (2, 14)), (0, 20, (1, 30)), (7, 50, (2, 13))]
    total = sum(len(seqs[i].inputs) for i in members)
    assert tree.computed_tokens == 20 + 20 + (24 + 44) + 20 + 29 + 18 + (14 + 11) + 30 + (9 + 13) == total - 288
    # every loss token takes the pair of its position and target: the 20 tokens of `first` three samples share are
    # scored once (position 39 predicts first's first token for all three)
    n = sum(int(seqs[i].mask.sum()) for i in members)
    assert tree.gather.numel() == n and tree.targets.numel() == n - 2 * 20
    for k, s in enumerate([seqs[i] for i in members]):
        own = tree.gather[sum(int(seqs[i].mask.sum()) for i in members[:k]):][:int(s.mask.sum())]
        assert tree.targets[own].tolist() == s.targets[s.mask].tolist()


def test_plan_respects_budget_and_max_seqs():
    seqs = sequences(nested_batch())
    for budget in (150, 200, 400):
        trees, rest = plan_trees(seqs, token_budget=budget)
        for members in trees:
            tree = build_tree([seqs[i] for i in members], torch.device("cpu"), None)
            assert min(tree.root_len, budget // 2) + tree.computed_tokens - tree.root_len <= budget
        assert sorted([i for m in trees for i in m] + rest) == list(range(9))
    trees, _ = plan_trees(seqs, token_budget=10_000, max_seqs=2)
    assert max(len(m) for m in trees) == 2
    # different recorded routing on the same tokens is not shared
    routed = sequences(nested_batch(routed=True))
    routed[1].routed = routed[1].routed.copy()
    routed[1].routed[45] = (routed[1].routed[45] + 1) % 4
    tree = build_tree(routed[:2], torch.device("cpu"), (3, 2))
    assert shape(tree)[:2] == [(-1, 0, (1, 45)), (0, 45, (2, 47))]


@pytest.mark.parametrize("segment_tokens", [None, 16, 23])
def test_tree_equals_separate_k3(k3_path, segment_tokens):
    learner = make_learner(k3_path)
    trajectories = nested_batch(routed=True)  # routing replay: shared spans carry the same recorded routing
    separate = step_grads(learner, trajectories, None, share_prefix=False)
    tree = step_grads(learner, trajectories, segment_tokens, share_prefix=True)
    assert [len(u.tree.nodes) for u in tree[2] if u.tree is not None] == [9]
    assert_same(tree, separate)


def test_tree_equals_separate_sequence_level_objective(k3_nope):
    learner = make_learner(k3_nope, algo="gspo")
    trajectories = nested_batch()
    separate = step_grads(learner, trajectories, None, share_prefix=False)
    assert_same(step_grads(learner, trajectories, 19, share_prefix=True), separate)
    assert_same(step_grads(learner, trajectories, None, share_prefix=True), separate)


def test_tree_counts_each_shared_span_once(k3_nope):
    learner = make_learner(k3_nope)
    trajectories = nested_batch()
    separate = step_grads(learner, trajectories, None, share_prefix=False)
    tree = step_grads(learner, trajectories, None, share_prefix=True)
    saved = sum(len(t.tokens) - 1 for t in trajectories[:7]) - tree[2][0].computed_tokens
    assert [s - t for s, t in zip(separate[3], tree[3])] == [saved] * len(tree[3])


def test_tree_equals_separate_hf(tiny_qwen3_dir):
    learner = make_learner(tiny_qwen3_dir)
    trajectories = nested_batch()
    tree = step_grads(learner, trajectories, None, share_prefix=True)
    assert [len(u.tree.nodes) for u in tree[2] if u.tree is not None] == [9]
    # 1e-6: Qwen3's RMSNorm and RoPE compute in float32 even in a float64 model (a wrong branch is off by O(1))
    assert_same(tree, step_grads(learner, trajectories, None, share_prefix=False), rtol=1e-6)
