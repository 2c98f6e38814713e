"""Episodes that show images, through the agent loop and the native engine (rollout/agent_loop.py,
rollout/torch_engine.py) on a tiny float64 K3 with image input: each trajectory carries the pixels of its media runs,
one patch per placeholder, and the log-probs the engine sampled with equal a full forward of the trajectory with
those pixels — with state reuse across turns (images in later turns' observations fed on top of a kept state), and
without; prefill segments cut through images. A group whose first turn is the same prompt but other pixels is not
sampled as one prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import k3rl.envs.tools as T
from k3rl.envs import tool
from k3rl.envs.base import Budget
from k3rl.model.vision import image_patches, pixel_values_of
from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
from k3rl.rollout.engine import SamplingParams
from k3rl.rollout.torch_engine import TorchEngine
from tests.model.k3_factory import make_config, make_model
from tests.rollout.test_state_reuse import Probe, every_text_is_a_call

P = 4


class Pictures(Probe):
    """tests/rollout/test_state_reuse.py's `Probe` with pictures: the task shows one, `look` one or two more between
    text; `answer` ends from the third turn on."""

    def reset(self, task):
        self.turn, self.rng = 0, np.random.default_rng(task["seed"])
        return [f"Task {task['id']}: what is drawn here? ", self.picture(), " Look around."]

    def picture(self):
        h, w = (P * int(x) for x in self.rng.integers(1, 4, 2))
        return self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

    @tool
    def look(self, k: int):
        """Look.

        Args:
            k: how far
        """
        self.turn += 1
        return [f"view {k}: ", self.picture()] + ([" and ", self.picture()] if k % 2 else [])


@pytest.fixture(scope="module")
def tokenizer():
    from k3rl.envs.registry import tokenizer_texts
    from k3rl.model.init import train_builtin_tokenizer
    from k3rl.rl.config import load_model_config

    return train_builtin_tokenizer(load_model_config("configs/model/tiny.yaml"), tokenizer_texts())


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = make_config(num_hidden_layers=4, kda_layers=(1, 2, 4), vocab_size=len(tokenizer), rope_theta=300.0,
                      media_placeholder_token_id=tokenizer.convert_tokens_to_ids("<|media_pad|>"),
                      image_patch_size=P, image_num_channels=3)
    return make_model(cfg, seed=1)


def run(model, tokenizer, reuse_state, prefill_tokens=64):
    engine = TorchEngine(model, tokenizer, seed=0, reuse_state=reuse_state, prefill_tokens=prefill_tokens)
    loop = AgentLoop(engine, tokenizer, Pictures, SamplingParams(temperature=1.0, max_tokens=12),
                     budget=Budget(max_turns=5), max_context_tokens=4096)
    requests = [EpisodeRequest({"id": i, "seed": 10 + i}, f"t{i}", f"g{i}", j) for i in range(2) for j in range(2)]
    return loop.run(requests), engine


def full_logprobs(model, t) -> np.ndarray:
    """log π of every sampled token of `t` from one forward with all its images."""
    patches = np.concatenate([image_patches(p, P) for p in t.pixels()])
    ids = torch.from_numpy(t.tokens.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids, pixel_values=pixel_values_of(torch.from_numpy(patches), torch.float64)).logits[0, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
    return lp[t.loss_mask[1:].astype(bool)]


def test_image_episodes_sample_what_a_full_forward_scores(model, tokenizer, monkeypatch):
    monkeypatch.setattr(T, "parse", every_text_is_a_call)
    reused, engine = run(model, tokenizer, reuse_state=True)
    assert engine.stats.resumed_prompts > 0  # later turns' images went on top of kept states
    full, _ = run(model, tokenizer, reuse_state=False, prefill_tokens=7)  # segments cut through media runs
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert max(len(a.image_shapes) for a in reused) >= 3  # the task's picture and tool results' in later turns
    for a, b in zip(reused, full):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-9)
        assert a.images.tobytes() == b.images.tobytes()
        assert int((a.tokens == pad).sum()) == sum((h // P) * (w // P) for h, w in a.image_shapes)
        # trajectories keep log-probs in float32: equal to the float64 forward up to that rounding
        np.testing.assert_allclose(a.logprobs[a.loss_mask.astype(bool)], full_logprobs(model, a), rtol=2.0**-23, atol=0)


def test_same_tokens_other_pixels_are_not_one_prompt(model, tokenizer):
    engine = TorchEngine(model, tokenizer, seed=0)
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, params, **kw: calls.append((len(prompts), params.n)) or generate(prompts, params,
                                                                                                      **kw)
    from k3rl.rollout.engine import sample_contexts

    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    prompt = np.array([5, 6, pad, pad, 7])
    a = np.zeros((2, 3, P, P), dtype=np.uint8)
    sample_contexts(engine, [prompt, prompt, prompt], SamplingParams(max_tokens=2), images=[a, a, a + 1])
    assert sorted(calls) == [(1, 1), (1, 2)]
    with pytest.raises(ValueError, match="prompt 0 has 2 image placeholders but 1 patches"):
        engine.generate([prompt], SamplingParams(max_tokens=2), images=[a[:1]])


def test_a_model_that_reads_images_never_samples_a_media_token(model, tokenizer):
    from k3rl.rollout.chat import MEDIA_TOKENS
    from k3rl.rollout.torch_engine import sample_tokens

    engine = TorchEngine(model, tokenizer)
    media = set(tokenizer.convert_tokens_to_ids(list(MEDIA_TOKENS)))
    assert set(engine._banned.tolist()) == media
    logits = torch.zeros(64, len(tokenizer))
    logits[:, sorted(media)] = 30.0  # the media tokens hold nearly all the mass
    tokens, logprobs = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(0), engine._banned)
    assert not set(tokens.tolist()) & media and (logprobs < -25).all()  # the raw distribution's log-probs
