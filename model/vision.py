"""Native image-patch input of K3 (docs/model_spec.md Part A "Multimodal input", §9 "Merging into text").

    pixel_values → raster-ordered p×p patches → linear projection to the hidden size
                 → written, in order, into the embedding rows at the media placeholder tokens

A patch is flattened channel-major `(c, i, j)`, so `proj.weight` [d, C·p·p] is the weight of a
bias-free `Conv2d(C, d, p, stride=p)` reshaped, the layout of the released ViT's
`patch_embed.proj` [1024, 3, 14, 14]. `pixel_values` is either a tensor [N, C, H, W] or a list of
[C, H, W] images (sides multiples of p, images may differ in size); a tensor of single patches
[N_patches, C, p, p] (the released processor's output) is the special case H = W = p.
The number of patches must equal the number of placeholder tokens in the batch; anything else
raises ValueError with both counts. Departure from the released model: no ViT tower, no 2×2
merge and no projector MLP (optional in Part A; the checkpoint name is `model.patch_embed.proj`).

Pixel scale: an image the toolkit shows (envs/media.py, RGB uint8) enters as its values / 255, in [0, 1]: uint8
`pixel_values` are scaled so in the projection's dtype (`pixel_values_of` does the same outside); patches of one image
are cut by `image_patches` ([n, C, p, p] uint8, raster order).
"""

from __future__ import annotations

import torch
from torch import nn


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, H, W] → [(H/p)·(W/p), C·p·p], patches in raster order, each flattened as (c, i, j)."""
    if image.ndim != 3:
        raise ValueError(f"pixel_values: each image must be [C, H, W], got shape {list(image.shape)}")
    C, Hh, Ww = image.shape
    if Hh % patch or Ww % patch:
        raise ValueError(f"pixel_values: image sides {Hh}×{Ww} must be multiples of image_patch_size={patch}")
    x = image.reshape(C, Hh // patch, patch, Ww // patch, patch)  # [C, h, p, w, p]
    return x.permute(1, 3, 0, 2, 4).reshape((Hh // patch) * (Ww // patch), C * patch * patch)


def image_patches(pixels, patch: int):
    """An RGB uint8 image [H, W, 3] (numpy; sides multiples of `patch`) → its patches [n, 3, p, p] uint8 in raster
    order, the order its placeholders take them."""
    import numpy as np

    h, w, c = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"an image of {h}×{w} pixels is not whole patches of {patch} (envs/media.py fit_to_patches)")
    x = np.asarray(pixels).reshape(h // patch, patch, w // patch, patch, c)  # [h', p, w', p, C]
    return np.ascontiguousarray(x.transpose(0, 2, 4, 1, 3).reshape(-1, c, patch, patch))


def pixel_values_of(patches: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 patches [n, C, p, p] → the model's `pixel_values` (values / 255)."""
    return patches.to(dtype) / 255.0


def image_inputs(table: torch.Tensor | None, patch_ids: torch.Tensor | None) -> dict:
    """The model's image arguments for the placeholders that `patch_ids` ([B, T], -1 elsewhere) marks, from a patch
    table [M, C, p, p] uint8: `pixel_values` [n, C, p, p] (row-major; uint8, scaled by the projection) and
    `image_mask` [B, T] (a placeholder token outside it, e.g. one a model sampled, stays an ordinary token); {} when
    none — any slice of a batch's columns takes its own."""
    if table is None or patch_ids is None:
        return {}
    mask = patch_ids >= 0
    if not bool(mask.any()):
        return {}
    return {"pixel_values": table[patch_ids[mask]], "image_mask": mask}


class PatchEmbed(nn.Module):
    """Patch projection [d, C·p·p] and the fusion into the token embeddings."""

    def __init__(self, config) -> None:
        super().__init__()
        self.patch, self.channels = config.image_patch_size, config.image_num_channels
        self.placeholder = config.media_placeholder_token_id
        self.proj = nn.Linear(self.channels * self.patch ** 2, config.hidden_size, bias=False)

    def embed(self, pixel_values: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """pixel_values → patch embeddings [N_patches, d]."""
        images = list(pixel_values) if isinstance(pixel_values, (list, tuple)) or pixel_values.ndim == 4 else None
        if images is None:
            raise ValueError(f"pixel_values: expected [N, C, H, W] or a list of [C, H, W], got {list(pixel_values.shape)}")
        for img in images:
            if img.ndim == 3 and img.shape[0] != self.channels:
                raise ValueError(f"pixel_values: images need image_num_channels={self.channels} channels, "
                                 f"got shape {list(img.shape)}")
        if torch.is_tensor(pixel_values) and pixel_values.shape[-2:] == (self.patch, self.patch):
            patches = pixel_values.reshape(pixel_values.shape[0], -1)  # single patches: patchify is a reshape
        else:
            patches = torch.cat([patchify(img, self.patch) for img in images])  # [N_patches, C·p·p]
        if patches.dtype == torch.uint8:
            return self.proj(pixel_values_of(patches, self.proj.weight.dtype))
        return self.proj(patches.to(self.proj.weight.dtype))

    def fuse(self, input_ids: torch.Tensor, embeddings: torch.Tensor,
             pixel_values: torch.Tensor | list[torch.Tensor], image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Replace the rows of `embeddings` [B, T, d] at placeholder tokens (or at `image_mask` [B, T], which must
        mark placeholders only) by the patch embeddings, in order."""
        at = input_ids == self.placeholder  # [B, T]
        if image_mask is not None:
            if bool((image_mask & ~at).any()):
                raise ValueError("image_mask: marks a position that holds no media placeholder token")
            at = image_mask
        feats = self.embed(pixel_values)  # [N, d]
        n_slots = int(at.sum())
        if n_slots != feats.shape[0]:
            raise ValueError(f"pixel_values: {feats.shape[0]} image patches but {n_slots} media placeholder "
                             f"tokens (id {self.placeholder}) in input_ids; they must match one to one")
        return embeddings.masked_scatter(at[..., None], feats.to(embeddings.dtype))
