"""The `digits` environment (envs/visual.py): real handwritten digits as the only carrier of the answer."""

from __future__ import annotations

import numpy as np
import pytest

from k3rl.envs import make
from k3rl.envs.base import Episode
from k3rl.envs.media import ImagePart, message_text
from k3rl.envs.visual import SPLITS, _scans, stamp


@pytest.mark.parametrize("serve", ["search", "context"])
def test_the_oracle_solves_every_task(serve):
    env = make("digits", serve=serve)
    for task in env.tasks(20, seed=3):
        episode = Episode(env, task, image_patch=14)
        policy = env.oracle(task)
        while not episode.done:
            episode.step(policy([dict(m) for m in episode.messages]))
        assert episode.reward == 1.0 and episode.info["em"] == 1.0
        images = [p for m in episode.messages if isinstance(m["content"], list) for p in m["content"]
                  if isinstance(p, ImagePart)]
        assert len(images) == (1 if serve == "search" else env.records)
        assert all(p.pixels.shape == (28, 28, 3) for p in images)


def test_only_the_image_says_the_digit():
    """Two tasks alike but for the stamps: every text the model reads is the same, so a text-only policy answers the
    same for both — and over many tasks, a constant guess is right about 1 time in 10."""
    env = make("digits")
    task = env.tasks(1, seed=0)[0]
    labels = _scans()[1]
    other_digit = lambda s: int(np.flatnonzero(labels != labels[s])[0])  # noqa: E731 — a scan of another digit
    other = {**task, "records": [[r, o, other_digit(s)] for r, o, s in task["records"]]}
    other["answer"] = str(int(labels[other["records"][other["asked"]][2]]))
    texts = []
    for t in (task, other):
        episode = Episode(env, t, image_patch=14)
        episode.step(env.oracle(t)([dict(m) for m in episode.messages]))
        texts.append([message_text(m["content"]) for m in episode.messages])
    assert texts[0] == texts[1] and task["answer"] != other["answer"]
    answers = [t["answer"] for t in env.tasks(500, seed=1)]
    best = max(answers.count(d) for d in set(answers)) / len(answers)
    assert 0.08 < best < 0.16  # a text-only policy can do no better than the most common digit


def test_splits_are_disjoint_scans_and_stamps_are_real_digits():
    train = {s for t in make("digits", split="train").tasks(200, seed=0) for _, _, s in t["records"]}
    test = {s for t in make("digits", split="test").tasks(200, seed=0) for _, _, s in t["records"]}
    assert not train & test and max(train) < SPLITS["train"][1] <= min(test)
    by_seed = make("digits")  # the default: held-out seeds (the trainer's eval.seed) show test scans
    assert {s for t in by_seed.tasks(100, seed=0) for _, _, s in t["records"]} <= set(range(1400))
    assert {s for t in by_seed.tasks(100, seed=1_000_003) for _, _, s in t["records"]} <= set(range(1400, 1797))
    img = stamp(0, 28)
    assert img.dtype == np.uint8 and img.shape == (28, 28, 3) and img.min() < 100 and img.max() == 255


def test_a_text_only_model_is_told_it_cannot_see():
    env = make("digits")
    task = env.tasks(1)[0]
    episode = Episode(env, task)  # no image_patch: the model reads no images
    step = episode.step(env.oracle(task)([dict(m) for m in episode.messages]))
    assert not step.ok and episode.errors_by_kind == {"no_image_input": 1}


def test_bad_arguments_are_named():
    for kwargs, match in [({"serve": "file"}, "serve"), ({"split": "dev"}, "split"), ({"records": 0}, "records"),
                          ({"size": 4}, "size")]:
        with pytest.raises(ValueError, match=match):
            make("digits", **kwargs)
