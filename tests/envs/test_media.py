"""Images in observations (envs/media.py, envs/base.py): what a tool may return, the named error each bad image
becomes, the fitting rule, and the image budgets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from k3rl.envs import media
from k3rl.envs.base import Budget, Env, Episode
from k3rl.envs.tools import tool

P = 14  # the released K3's patch size


class Shows(Env):
    """One tool that returns whatever the test put in `self.result`."""

    def __init__(self, result=None, prompt="Look."):
        self.result, self.prompt = result, prompt

    def reset(self, task):
        return self.prompt

    @tool
    def look(self) -> str:
        """Show the picture."""
        return self.result

    @tool(terminal=True)
    def answer(self, text: str) -> float:
        """Answer."""
        return 1.0


CALL = '<tool_call>{"name": "look", "arguments": {}}</tool_call>'


def observe(result, budget=None, patch=P, steps=1):
    episode = Episode(Shows(result), None, budget or Budget(), image_patch=patch)
    for _ in range(steps):
        step = episode.step(CALL)
    return episode, step


class Broken:
    """Looks like an array (a shape, a dtype) but cannot be read as one."""

    shape, dtype = (4, 4), "uint8"

    def __array__(self, *args, **kwargs):
        raise RuntimeError("device lost")


BAD = {
    "an array that cannot be read": (Broken(), "not_an_image"),
    "an object array": (np.array([[None, 1]], dtype=object), "bad_dtype"),
    "a bool array": (np.ones((4, 4), dtype=bool), "bad_dtype"),
    "a complex array": (np.ones((4, 4), dtype=np.complex64), "bad_dtype"),
    "a 1-D array": (np.zeros(16, dtype=np.uint8), "bad_shape"),
    "a 4-D array": (np.zeros((1, 4, 4, 3), dtype=np.uint8), "bad_shape"),
    "two channels": (np.zeros((4, 4, 2), dtype=np.uint8), "bad_channels"),
    "five channels": (np.zeros((4, 4, 5), dtype=np.uint8), "bad_channels"),
    "a 16-bit PIL mode": (Image.new("I;16", (8, 8)), "bad_mode"),
    "a float PIL mode": (Image.new("F", (8, 8)), "bad_mode"),
    "zero height": (np.zeros((0, 8, 3), dtype=np.uint8), "empty"),
    "zero width": (np.zeros((8, 0), dtype=np.uint8), "empty"),
    "NaN": (np.full((4, 4), np.nan, dtype=np.float32), "nonfinite"),
    "infinity": (np.full((4, 4, 3), np.inf), "nonfinite"),
    "floats above 1": (np.full((4, 4), 1.5), "out_of_range"),
    "negative floats": (np.full((4, 4), -0.1, dtype=np.float32), "out_of_range"),
    "integers above 255": (np.full((4, 4), 300, dtype=np.int64), "out_of_range"),
    "too many pixels": (np.zeros((2049, 2049), dtype=np.uint8), "too_many_pixels"),
    "a 1×300 strip": (np.zeros((1, 300), dtype=np.uint8), "bad_aspect"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_image_is_a_named_error_observation(name):
    value, kind = BAD[name]
    episode, step = observe(["Here:", np.zeros((P, P), dtype=np.uint8), value])
    assert not step.ok and not step.done and step.observation.startswith("Error: image 3 of the result: ")
    assert episode.errors_by_kind == {kind: 1}, step.observation
    assert episode.messages[-1]["content"] == step.observation  # text: no image reached the conversation
    assert episode.image_patches == 0
    episode.step(CALL.replace("look", "answer").replace("{}", '{"text": "x"}'))
    assert episode.done and episode.reward == 1.0  # the episode goes on after the error


def test_bytes_alone_are_text_not_an_image():
    """A value with no image in it is not media: shown as text like any other tool result."""
    episode, step = observe(b"\x89PNG")
    assert step.ok and step.observation == str(b"\x89PNG")


def test_good_images_are_checked_and_fitted():
    gray = np.arange(P * 2 * P * 3, dtype=np.uint8).reshape(2 * P, 3 * P)
    rgba = Image.new("RGBA", (20, 9), (255, 0, 0, 0))  # fully transparent red: white once composited
    floats = torch.full((P, P, 3), 0.5)
    episode, step = observe(["A", gray, "B", rgba, floats, Image.new("P", (P, P))])
    parts = episode.messages[-1]["content"]
    assert step.ok and [type(p).__name__ for p in parts] == ["str", "ImagePart", "str", "ImagePart", "ImagePart",
                                                             "ImagePart"]
    kept = parts[1].pixels  # sides already multiples of the patch: pixel for pixel, grey repeated to RGB
    assert kept.dtype == np.uint8 and kept.shape == (2 * P, 3 * P, 3) and (kept == gray[:, :, None]).all()
    assert parts[1].size == (3 * P, 2 * P)
    assert parts[3].pixels.shape == (P, P, 3) and parts[3].size == (20, 9) and (parts[3].pixels == 255).all()
    assert (parts[4].pixels == 128).all()
    assert episode.image_patches == 6 + 1 + 1 + 1
    assert step.observation == "A[image 42×28]B[image 20×9][image 14×14][image 14×14]"


@pytest.mark.parametrize("size,fitted", [((14, 14), (14, 14)), ((20, 9), (14, 14)), ((22, 30), (28, 28)),
                                         ((100, 50), (98, 56)), ((3, 3), (14, 14))])
def test_fitting_rule(size, fitted):
    """Each side to the nearest multiple of the patch, at least one patch."""
    w, h = size
    image = media.check_image(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
    assert media.fit_to_patches(image, P).shape[:2] == fitted[::-1]


def test_image_budgets():
    img = np.zeros((P, P), dtype=np.uint8)
    episode, step = observe([img] * 5, Budget(max_images_per_turn=3))
    parts = episode.messages[-1]["content"]
    assert sum(isinstance(p, media.ImagePart) for p in parts) == 3 and "2 more images not shown" in parts[-1]
    assert episode.errors_by_kind == {"max_images_per_turn": 1} and not episode.done

    # 2 patches a turn: the third turn's second image would pass 5
    episode, step = observe([img, img], Budget(max_image_patches=5), steps=3)
    assert episode.image_patches == 5 and episode.finish_reason == "max_image_patches" and episode.truncated
    last = episode.messages[-1]["content"]
    assert sum(isinstance(p, media.ImagePart) for p in last) == 1 and "image budget of 5 patches" in last[-1]


def test_a_model_without_image_input_gets_an_error():
    episode, step = observe([np.zeros((P, P), dtype=np.uint8)], patch=None)
    assert not step.ok and episode.errors_by_kind == {"no_image_input": 1}


def test_images_in_the_prompt():
    env = Shows(prompt=["Which digit?", np.zeros((P, P), dtype=np.uint8)])
    episode = Episode(env, None, image_patch=P)
    assert isinstance(episode.messages[1]["content"][1], media.ImagePart)
    with pytest.raises(media.ImageError, match="Shows.reset: image 2 of the result"):
        Episode(Shows(prompt=["Which digit?", np.full((4, 4), np.nan)]), None, image_patch=P)
    with pytest.raises(media.ImageError, match="reads no images"):
        Episode(env, None)
