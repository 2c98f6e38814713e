"""Images in observations: what an environment may show, how each image is checked, and how it is fitted to patches.

A tool's result (and `reset`'s prompt) may be text, an image, or a list of both, in order. An image is a
`PIL.Image.Image` (modes 1, L, LA, P, RGB, RGBA) or an array [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] — uint8, an
integer type with values in 0..255, or floats in [0, 1] (numpy, or anything `np.asarray` takes that has a `shape`,
e.g. a CPU torch tensor). Every image is checked (`check_image`): a bad one is an `ImageError` whose `kind` names
what is wrong, and the episode shows the model an `Error:` observation instead of the image (envs/base.py).

Fitting (`fit_to_patches`), the one rule every image follows before the model sees it: converted to RGB (alpha
composited on white, grey repeated), then resized (bicubic) so that each side is the nearest multiple of the patch
size p, at least p — an image whose sides are multiples of p is kept pixel for pixel. The model reads it as
(H/p)·(W/p) patches in raster order (model/vision.py); the renderer marks their places with that many placeholder
tokens (rollout/chat.py). The released K3 processor also merges 2×2 patches after a ViT; the native patch path has no
tower and no merge (docs/model_spec.md §9).

Budgets (envs/base.py `Budget`): `max_image_pixels` per image (before fitting; more is the error
`too_many_pixels`), `max_images_per_turn` (the extra images of a turn are left out, with a note), and
`max_image_patches` per episode (the image that would pass it is left out and the episode ends, truncated
`max_image_patches`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_ASPECT = 200
"""Longest side ÷ shortest side beyond which an image is refused (`bad_aspect`): it would fit no patch grid sensibly."""

PIL_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")


class ImageError(ValueError):
    """A value that cannot be shown as an image; `kind` names why (`not_an_image`, `bad_mode`, `bad_dtype`,
    `bad_shape`, `bad_channels`, `empty`, `nonfinite`, `out_of_range`, `too_many_pixels`, `bad_aspect`,
    `no_image_input`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def is_image(value: Any) -> bool:
    """Whether `value` is meant as an image: a PIL image, or an array-like with a shape that is not text."""
    if _is_pil(value):
        return True
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (str, bytes))


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, Image.Image)


def check_image(value: Any, max_pixels: int | None = None) -> np.ndarray:
    """`value` as an RGB uint8 array [H, W, 3], or `ImageError` naming what is wrong."""
    if _is_pil(value):
        if value.mode not in PIL_MODES:
            raise ImageError("bad_mode", f"image mode {value.mode!r} is not one of {', '.join(PIL_MODES)}")
        w, h = value.size
        _check_size(h, w, max_pixels)
        rgba = np.asarray(value.convert("RGBA"), dtype=np.uint8)
        return _composite(rgba)
    if not is_image(value):
        raise ImageError("not_an_image", f"a {type(value).__name__} is not an image (a PIL image or an [H, W(, C)] "
                                         "array)")
    try:
        array = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 — whatever the object's conversion raises
        raise ImageError("not_an_image", f"a {type(value).__name__} could not be read as an array: {exc}") from exc
    if array.dtype == bool or array.dtype.kind not in "uif":
        raise ImageError("bad_dtype", f"image dtype {array.dtype} is not uint8, an integer type or a float type")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise ImageError("bad_shape", f"an image must be [H, W] or [H, W, C], got shape {list(array.shape)}")
    h, w, c = array.shape
    if c not in (1, 3, 4):
        raise ImageError("bad_channels", f"an image needs 1, 3 or 4 channels, got {c} (shape {list(array.shape)})")
    _check_size(h, w, max_pixels)
    if array.dtype.kind == "f":
        if not bool(np.isfinite(array).all()):
            raise ImageError("nonfinite", "a float image holds NaN or infinite values")
        lo, hi = float(array.min()), float(array.max())
        if lo < 0.0 or hi > 1.0:
            raise ImageError("out_of_range", f"a float image must lie in [0, 1], got values in [{lo:g}, {hi:g}]")
        array = np.rint(array * 255.0).astype(np.uint8)
    elif array.dtype != np.uint8:
        lo, hi = int(array.min()), int(array.max())
        if lo < 0 or hi > 255:
            raise ImageError("out_of_range", f"an integer image must lie in 0..255, got values in [{lo}, {hi}]")
        array = array.astype(np.uint8)
    if c == 1:
        array = np.repeat(array, 3, axis=2)
    elif c == 4:
        array = _composite(array)
    return np.ascontiguousarray(array)


def _check_size(h: int, w: int, max_pixels: int | None) -> None:
    if h <= 0 or w <= 0:
        raise ImageError("empty", f"an image of {w}×{h} pixels is empty")
    if max_pixels is not None and h * w > max_pixels:
        raise ImageError("too_many_pixels", f"an image of {w}×{h} = {h * w} pixels is over the budget of "
                                            f"{max_pixels} pixels per image")
    if max(h, w) > MAX_ASPECT * min(h, w):
        raise ImageError("bad_aspect", f"an image of {w}×{h} pixels is more than {MAX_ASPECT} times longer than "
                                       "wide")


def _composite(rgba: np.ndarray) -> np.ndarray:
    """RGBA uint8 [H, W, 4] → RGB on white."""
    alpha = rgba[:, :, 3:4].astype(np.uint16)
    rgb = (rgba[:, :, :3].astype(np.uint16) * alpha + 255 * (255 - alpha) + 127) // 255
    return rgb.astype(np.uint8)


def fit_to_patches(image: np.ndarray, patch: int) -> np.ndarray:
    """A checked image (RGB uint8 [H, W, 3]) resized so that each side is the nearest multiple of `patch`, at least
    one patch (bicubic; unchanged when both sides already are)."""
    h, w = image.shape[:2]
    H, W = (max(patch, int(round(side / patch)) * patch) for side in (h, w))
    if (H, W) == (h, w):
        return image
    from PIL import Image

    return np.asarray(Image.fromarray(image, "RGB").resize((W, H), Image.Resampling.BICUBIC), dtype=np.uint8)


def num_patches(image: np.ndarray, patch: int) -> int:
    """Patches of a fitted image [H, W, 3]."""
    return (image.shape[0] // patch) * (image.shape[1] // patch)


@dataclass
class ImagePart:
    """A fitted image as a part of a message's content: RGB uint8 [H, W, 3], sides multiples of the patch size;
    `size` is the original (width, height), which the renderer writes into the media header."""

    pixels: np.ndarray
    size: tuple[int, int]


def content_parts(value: Any) -> list[Any] | None:
    """A tool result or prompt as content parts (strings and images, in order), or None when it holds no image
    (plain text, or a value shown as JSON)."""
    if is_image(value):
        return [value]
    if isinstance(value, (list, tuple)) and any(is_image(v) for v in value):
        return list(value)
    return None


def data_url(image: ImagePart) -> str:
    """The image as a PNG `data:` URL, as OpenAI's chat API takes it in an `image_url` content part."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.pixels, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def openai_content(content: Any, wrap: Callable[[str], str] | None = None, clean: Callable[[str], str] = str
                   ) -> Any:
    """A message's content for an OpenAI-compatible server: text as it is (`clean`ed, then `wrap`ped), content with
    images as `text` and `image_url` parts (each text part `clean`ed, the whole wrapped around them)."""
    if not isinstance(content, list):
        text = clean(content)
        return wrap(text) if wrap is not None else text
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} if isinstance(p, ImagePart)
             else {"type": "text", "text": clean(p)} for p in content]
    if wrap is not None:
        head, _, tail = wrap("\x00").partition("\x00")
        parts = [{"type": "text", "text": head}, *parts, {"type": "text", "text": tail}]
    return parts


def message_text(content: Any) -> str:
    """The text of a message's content, an image shown as `[image W×H]` (logs, transcripts, token estimates)."""
    if isinstance(content, str) or content is None:
        return content or ""
    out = []
    for part in content:
        if isinstance(part, ImagePart):
            out.append(f"[image {part.size[0]}×{part.size[1]}]")
        elif isinstance(part, dict):
            out.append(part.get("text", "[image]") if part.get("type", "text") == "text" else "[image]")
        else:
            out.append(str(part))
    return "".join(out)


__all__ = ["ImageError", "ImagePart", "MAX_ASPECT", "check_image", "content_parts", "data_url", "fit_to_patches",
           "is_image", "message_text", "num_patches", "openai_content"]
