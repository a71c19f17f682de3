"""Masked patch modelling input: corrupt a share of visual tokens after the image encoder.

Of the patch positions 1..P of each image (index 0, the global token, never), a fraction
``probability`` is selected, at least one per image so the regression loss always has a target. Of
the selected tokens 80 % become a learned mask vector, 10 % a patch token drawn at random from the
batch and 10 % stay unchanged (BERT's split, applied to features: CoVLR spec §3.1, MPM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class MaskedPatches:
    """tokens [B, 1+P, D] after corruption and selected bool [B, 1+P] (False at index 0)."""

    tokens: Tensor
    selected: Tensor


def mask_patches(
    tokens: Tensor,
    mask_vector: Tensor,
    probability: float = 0.15,
    generator: torch.Generator | None = None,
) -> MaskedPatches:
    """Select and corrupt patch tokens of ``tokens [B, 1+P, D]`` (see the module docstring).

    The corruption keeps the graph: unselected and kept tokens still carry their gradient, mask
    positions carry the gradient of ``mask_vector [D]``.
    """
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"mask_patches: probability must be in (0, 1], got {probability}")
    batch, length, _ = tokens.shape
    if length < 2:
        raise ValueError(
            f"mask_patches: need a global token and at least one patch, got {length} tokens"
        )
    device = tokens.device
    draws = torch.rand(batch, length, generator=generator, device=device)
    draws[:, 0] = 2.0  # never the global token
    selected = draws < probability
    forced = torch.zeros_like(selected)
    forced.scatter_(1, draws.argmin(1, keepdim=True), True)  # the lowest draw is always a patch
    selected |= forced & ~selected.any(1, keepdim=True)

    action = torch.rand(batch, length, generator=generator, device=device)
    to_mask = (selected & (action < 0.8))[..., None]
    to_random = (selected & (action >= 0.8) & (action < 0.9))[..., None]
    donor_row = torch.randint(batch, (batch, length), generator=generator, device=device)
    donor_col = torch.randint(1, length, (batch, length), generator=generator, device=device)
    random_tokens = tokens[donor_row, donor_col]
    corrupted = torch.where(to_mask, mask_vector.to(tokens.dtype).expand_as(tokens), tokens)
    corrupted = torch.where(to_random, random_tokens, corrupted)
    return MaskedPatches(tokens=corrupted, selected=selected)
