"""The learner on trajectories that carry images (rollout/trajectory.py `images`, rl/train/batching.py patches), in
float64 on a tiny K3 with image input: log π of every sampled token equals a full forward with the same pixels; a
batch that mixes text-only and image trajectories gives the same loss and gradients whole, as separate micro-batches,
as prefix trees (images in shared prompts) and segment by segment; placeholders are never trained; a tree shares a
prompt only where its images are the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3rl.model.vision import image_patches, pixel_values_of
from k3rl.rl.train.batching import to_train_sequence
from k3rl.rl.train.prefix_tree import build_tree
from k3rl.rollout.trajectory import TrajectoryBuilder
from tests.model.k3_factory import make_config, make_model
from tests.rl.test_segments import V, assert_same, make_learner, step_grads

P, BEGIN, CONTENT, PAD, END = 4, 5, 6, 7, 8  # patch size and the media tokens of this tiny vocabulary


@pytest.fixture(scope="module")
def k3_images(tmp_path_factory):
    config = make_config(num_hidden_layers=4, kda_layers=(1, 2, 3), media_placeholder_token_id=PAD,
                         image_patch_size=P, image_num_channels=3)
    model = make_model(config, seed=5)
    path = tmp_path_factory.mktemp("k3-images")
    model.save_pretrained(path, safe_serialization=True)
    return path


def media_run(pixels) -> list[int]:
    """The tokens of one image (rollout/chat.py's layout, a one-token header)."""
    n = (pixels.shape[0] // P) * (pixels.shape[1] // P)
    return [BEGIN, 40, CONTENT, *[PAD] * n, END]


def text(rng, n):
    return rng.integers(10, V, n).tolist()


def trajectory(rng, prompt, images, turns, group, reward):
    """`prompt`: a list of token lists and images (RGB uint8); `turns`: [(sampled n, tool-output parts)]."""
    def parts(items):
        tokens, shown = [], []
        for item in items:
            if isinstance(item, np.ndarray):
                tokens += media_run(item)
                shown.append(item)
            else:
                tokens += item
        return tokens, shown

    tokens, shown = parts(prompt)
    b = TrajectoryBuilder(tokens)
    b.append_images(shown)
    for n, observation in turns:
        b.append_sampled(text(rng, n), (-rng.random(n)).tolist(), 0)
        if observation:
            tokens, shown = parts(observation)
            b.append_context(tokens)
            b.append_images(shown)
    return b.finish(reward=reward, group_id=group, task_id=group)


def image(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def batch(seed=0):
    """Group a: 3 samples of a prompt with a 16×16 image (16 patches); one sees a 2-image tool result. Group b: the
    same prompt tokens with another image (same placeholders, other pixels). Group c: text only."""
    rng = np.random.default_rng(seed)
    head, tail = text(rng, 20), text(rng, 6)
    pa, pb = image(rng, 16, 16), image(rng, 16, 16)
    out = [trajectory(rng, [head, pa, tail], None, [(12, None)], "a", 1.0),
           trajectory(rng, [head, pa, tail], None, [(5, [text(rng, 3), image(rng, 4, 8), text(rng, 2),
                                                         image(rng, 12, 4)]), (9, None)], "a", 0.0),
           trajectory(rng, [head, pa, tail], None, [(14, None)], "a", 0.5),
           trajectory(rng, [head, pb, tail], None, [(10, None)], "b", 1.0),
           trajectory(rng, [head, pb, tail], None, [(7, None)], "b", 0.0)]
    prompt = text(rng, 30)
    out += [trajectory(rng, [prompt], None, [(11, None)], "c", 1.0),
            trajectory(rng, [prompt], None, [(8, None)], "c", 0.0)]
    return out


def full_logprobs(model, t) -> torch.Tensor:
    """log π of each next token of `t` from one forward with all its images."""
    pixels = np.concatenate([image_patches(p, P) for p in t.pixels()]) if t.images is not None else None
    ids = torch.from_numpy(t.tokens.astype(np.int64))[None]
    values = None if pixels is None else pixel_values_of(torch.from_numpy(pixels), torch.float64)
    with torch.no_grad():
        logits = model(ids, pixel_values=values).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def test_logprobs_equal_a_full_forward_with_the_pixels(k3_images):
    learner = make_learner(k3_images)
    trajectories = batch()
    scored = learner.score(trajectories)
    for t, got in zip(trajectories, scored):
        want = full_logprobs(learner.model, t)[t.loss_mask[1:].astype(bool)]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    # the pixels matter: the same tokens with the other group's image score differently
    swapped = trajectories[0]
    swapped.images = trajectories[3].images.copy()
    assert not np.allclose(learner.score([swapped])[0], scored[0])


def test_placeholders_are_never_trained(k3_images):
    learner = make_learner(k3_images)
    for t in batch():
        s = to_train_sequence(t, 1.0, learner._media)
        assert not s.mask[s.targets == PAD].any()  # no placeholder is a trained token
        if t.images is None:
            assert s.patch_at is None and s.patches is None
            continue
        assert ((s.patch_at >= 0) == (s.inputs == PAD)).all() and int((s.patch_at >= 0).sum()) == len(s.patches)


def test_mixed_batch_same_update_whole_separate_tree_and_segments(k3_images):
    learner = make_learner(k3_images)
    learner.cfg.micro_batch_tokens = 10_000
    trajectories = batch()
    whole = step_grads(learner, trajectories, None, share_prefix=False)
    assert len(whole[2]) == 1 and whole[2][0].mb.patch_table is not None
    learner.cfg.micro_batch_tokens = 1  # every sequence its own micro-batch
    separate = step_grads(learner, trajectories, None, share_prefix=False)
    assert len(separate[2]) == len(trajectories)
    assert_same(separate, whole)
    learner.cfg.micro_batch_tokens = 10_000
    for seg in (None, 16, 11):  # 11: segments cut through an image's placeholders
        tree = step_grads(learner, trajectories, seg, share_prefix=True)
        assert sorted(u.tree.patch_table is not None for u in tree[2]) == [False, True]  # groups a + b, group c
        assert_same(tree, whole)


def test_a_tree_shares_a_prompt_only_where_its_images_agree(k3_images):
    learner = make_learner(k3_images)
    seqs = [to_train_sequence(t, 0.0, learner._media) for t in batch()[:5]]
    tree = build_tree(seqs, torch.device("cpu"), None)
    # the 20 shared text tokens and the media run's start are one span; group a's image and group b's diverge at the
    # first placeholder (same token, other patch): each group's image and the prompt's rest (16 + 1 + 6 positions)
    # is a span of its own, under which its samples' leaves hang
    shapes = [(n.parent, n.start, tuple(n.ids.shape)) for n in tree.nodes]
    assert shapes[0] == (-1, 0, (1, 23))
    assert sorted(s for s in shapes if s[0] == 0) == [(0, 23, (1, 23)), (0, 23, (1, 23))]
    assert sorted(s[2][0] for s in shapes if s[0] > 0) == [2, 3]
    assert tree.patch_table.shape == (16 * 5 + 2 + 3, 3, P, P)


def test_a_wrong_patch_count_is_named(k3_images):
    learner = make_learner(k3_images)
    t = batch()[0]
    t.tokens = np.r_[t.tokens[:30], [PAD], t.tokens[30:]].astype(np.int32)
    for name in ("loss_mask", "logprobs", "versions"):
        setattr(t, name, np.r_[getattr(t, name)[:30], getattr(t, name)[:1] * 0, getattr(t, name)[30:]])
    with pytest.raises(ValueError, match="17 image placeholders .* but 16 patches in its 1 images"):
        learner.score([t])
    with pytest.raises(ValueError, match="reads none"):
        to_train_sequence(batch()[0], 0.0, None)


def test_demonstrations_carry_their_images():
    """SFT rows of an environment that shows images (rl/orchestrator/demonstrations.py): the pixels beside the ids,
    one patch per placeholder once they are a trajectory (rl/train/supervised.py `as_trajectory`)."""
    from k3rl.envs.registry import tokenizer_texts
    from k3rl.model.init import train_builtin_tokenizer
    from k3rl.rl.config import load_model_config
    from k3rl.rl.orchestrator.demonstrations import collect_demonstrations
    from k3rl.rl.train.supervised import as_trajectory

    tok = train_builtin_tokenizer(load_model_config("configs/model/tiny.yaml"), tokenizer_texts())
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    report = collect_demonstrations("digits", 4, 0, tok, {"serve": "context", "records": 3}, image_patch=14)
    assert len(report.rows) == 4
    for row in report.rows:
        t = as_trajectory(row["input_ids"], row["assistant_masks"], row["images"], row["image_shapes"])
        assert [p.shape for p in t.pixels()] == [(28, 28, 3)] * 3
        s = to_train_sequence(t, 0.0, (pad, 14))
        assert len(s.patches) == 12 == int((s.patch_at >= 0).sum())
    with pytest.raises(Exception, match="no_image_input|reads no images"):
        report = collect_demonstrations("digits", 1, 0, tok, {"serve": "context"})


def test_a_placeholder_the_model_sampled_is_an_ordinary_token(k3_images):
    """Only placeholders in the context take patches; one among the sampled tokens (a model that writes
    `<|media_pad|>`) is embedded like any token — in the learner as in a full forward with that image mask."""
    learner = make_learner(k3_images)
    t = batch()[0]
    sampled = np.flatnonzero(t.loss_mask)[3]
    t.tokens = t.tokens.copy()
    t.tokens[sampled] = PAD
    s = to_train_sequence(t, 0.0, learner._media)
    assert len(s.patches) == 16 and s.patch_at[sampled] == -1
    pixels = np.concatenate([image_patches(p, P) for p in t.pixels()])
    ids = torch.from_numpy(t.tokens.astype(np.int64))[None]
    mask = (ids == PAD) & torch.from_numpy(t.loss_mask == 0)[None]
    with torch.no_grad():
        logits = learner.model(ids, pixel_values=torch.from_numpy(pixels), image_mask=mask).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][t.loss_mask[1:].astype(bool)]
    np.testing.assert_allclose(learner.score([t])[0], want.numpy(), rtol=1e-10, atol=1e-12)
