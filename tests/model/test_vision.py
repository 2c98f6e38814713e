"""Native image-patch input: patchify order equals a stride-p Conv2d, the patch embeddings land
on the placeholder rows in order (other rows untouched), and a count mismatch is a named error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3_factory import make_config

from k3rl.model.vision import PatchEmbed, patchify


def test_patch_projection_equals_strided_conv():
    cfg = make_config(media_placeholder_token_id=7, image_patch_size=4, image_num_channels=3)
    torch.manual_seed(0)
    embed = PatchEmbed(cfg).double()
    img = torch.randn(3, 8, 12, dtype=torch.float64)
    conv = F.conv2d(img[None], embed.proj.weight.view(cfg.hidden_size, 3, 4, 4), stride=4)  # [1, d, 2, 3]
    torch.testing.assert_close(embed.embed([img]), conv[0].flatten(1).T)  # raster order
    assert patchify(img, 4).shape == (6, 48)


def test_fuse_writes_placeholder_rows_in_order():
    cfg = make_config(media_placeholder_token_id=7, image_patch_size=2)
    torch.manual_seed(0)
    embed = PatchEmbed(cfg).double()
    ids = torch.randint(8, 97, (2, 10))
    ids[0, 1:3], ids[1, 4:8] = 7, 7
    images = [torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(3, 4, 4, dtype=torch.float64)]  # 2 + 4 patches
    base = torch.randn(2, 10, cfg.hidden_size, dtype=torch.float64)
    fused = embed.fuse(ids, base, images)
    feats = embed.embed(images)
    at = ids == 7
    torch.testing.assert_close(fused[at], feats)
    torch.testing.assert_close(fused[~at], base[~at])
    single = torch.cat([patchify(i, 2) for i in images]).view(6, 3, 2, 2)  # [N_patches, C, p, p] form
    torch.testing.assert_close(embed.fuse(ids, base, single), fused)


@pytest.mark.parametrize("n_placeholders", [3, 5])
def test_placeholder_count_mismatch_is_a_named_error(n_placeholders):
    cfg = make_config(media_placeholder_token_id=7, image_patch_size=2)
    embed = PatchEmbed(cfg)
    ids = torch.randint(8, 97, (1, 10))
    ids[0, :n_placeholders] = 7
    with pytest.raises(ValueError, match=rf"pixel_values: 4 image patches but {n_placeholders} media placeholder"):
        embed.fuse(ids, torch.zeros(1, 10, cfg.hidden_size), torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="image_patch_size"):
        embed.embed(torch.zeros(1, 3, 3, 4))
