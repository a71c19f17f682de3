"""Weak augmentations for intra-modal instance discrimination (CoVLR spec §3.2, mode ``nce``).

Images: horizontal flip with probability 0.5 and a random translation of up to 10 % of the side,
as ``RandomAffine(degrees=0, translate=(0.1, 0.1))`` with zero fill, done on the batch tensor.
Texts: dropping a share of ordinary tokens, the offline stand-in for back-translation when no
caption in another language is available (spec §7.11).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ccr.methods.layers.masking import maskable_positions


def flip_and_translate(
    images: Tensor,
    max_shift: float = 0.1,
    flip_probability: float = 0.5,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per image of ``images [B, C, H, W]``: flip left-right with ``flip_probability``, then shift
    by a whole number of pixels drawn uniformly in [-max_shift, max_shift] x side per axis;
    uncovered pixels are 0."""
    batch, _, height, width = images.shape
    device = images.device
    flip = torch.rand(batch, generator=generator, device=device) < flip_probability
    out = torch.where(flip[:, None, None, None], images.flip(-1), images)
    limits = (round(max_shift * height), round(max_shift * width))
    shifts = [
        torch.randint(-m, m + 1, (batch,), generator=generator, device=device) for m in limits
    ]
    rows = (
        torch.arange(height, device=device)[None, :] - shifts[0][:, None]
    )  # source row per target row
    cols = torch.arange(width, device=device)[None, :] - shifts[1][:, None]
    inside = ((rows >= 0) & (rows < height))[:, :, None] & ((cols >= 0) & (cols < width))[
        :, None, :
    ]
    index = torch.arange(batch, device=device)[:, None, None]
    moved = out[
        index, :, rows.clamp(0, height - 1)[:, :, None], cols.clamp(0, width - 1)[:, None, :]
    ]
    return moved.permute(0, 3, 1, 2) * inside[:, None]


def drop_tokens(
    input_ids: Tensor,
    attention_mask: Tensor,
    special_ids: Iterable[int],
    pad_token_id: int,
    probability: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Remove each ordinary (attended, non-special) token with ``probability``, close the gaps and
    re-pad on the right; special tokens always stay. Returns (input_ids, attention_mask)."""
    ordinary = maskable_positions(input_ids, attention_mask, special_ids)
    dropped = ordinary & (
        torch.rand(input_ids.shape, generator=generator, device=input_ids.device) < probability
    )
    keep = attention_mask.bool() & ~dropped
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept tokens first, in order
    kept_ids = input_ids.gather(1, order)
    kept_mask = keep.gather(1, order)
    return kept_ids.masked_fill(~kept_mask, pad_token_id), kept_mask.to(attention_mask.dtype)
