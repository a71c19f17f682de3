"""BERT-style token masking for masked language modelling, shared by the methods that use an MLM loss.

A fraction ``probability`` of the maskable tokens (attended, not a special token) is selected, with at
least one per text that has any maskable token. Of the selected tokens 80 % become the mask token,
10 % a random ordinary token and 10 % stay unchanged. Labels hold the original id at selected
positions and ``IGNORE_INDEX`` everywhere else, ready for ``F.cross_entropy(ignore_index=-100)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass
class MaskedTokens:
    """input_ids [N, L] after masking and labels [N, L] (IGNORE_INDEX off the selected positions)."""

    input_ids: Tensor
    labels: Tensor


def maskable_positions(
    input_ids: Tensor, attention_mask: Tensor, special_ids: Iterable[int]
) -> Tensor:
    """Bool [N, L]: attended tokens that are not special (never <s>, </s>, <pad>, <mask>)."""
    special = torch.tensor(sorted(set(special_ids)), dtype=input_ids.dtype, device=input_ids.device)
    return attention_mask.bool() & ~torch.isin(input_ids, special)


@torch.no_grad()
def mask_tokens(
    input_ids: Tensor,
    attention_mask: Tensor,
    mask_token_id: int,
    vocab_size: int,
    special_ids: Iterable[int],
    probability: float = 0.15,
    generator: torch.Generator | None = None,
) -> MaskedTokens:
    """Select and corrupt tokens BERT-style; see the module docstring."""
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"mask_tokens: probability must be in (0, 1], got {probability}")
    special_ids = set(special_ids) | {mask_token_id}
    device = input_ids.device
    maskable = maskable_positions(input_ids, attention_mask, special_ids)
    draws = torch.rand(input_ids.shape, generator=generator, device=device)
    selected = maskable & (draws < probability)
    selected |= _one_forced_position(maskable, generator) & ~selected.any(1, keepdim=True)

    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(input_ids.shape, generator=generator, device=device)
    to_mask = selected & (action < 0.8)
    to_random = selected & (action >= 0.8) & (action < 0.9)
    is_ordinary = torch.ones(vocab_size, dtype=torch.bool, device=device)
    is_ordinary[sorted(special_ids)] = False
    ordinary = is_ordinary.nonzero().squeeze(1).to(input_ids.dtype)
    random_ids = ordinary[
        torch.randint(len(ordinary), input_ids.shape, generator=generator, device=device)
    ]
    corrupted = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    corrupted = torch.where(to_random, random_ids, corrupted)
    return MaskedTokens(input_ids=corrupted, labels=labels)


def _one_forced_position(maskable: Tensor, generator: torch.Generator | None) -> Tensor:
    """Bool [N, L] with one uniformly chosen maskable position per row (none for rows without any)."""
    scores = torch.rand(maskable.shape, generator=generator, device=maskable.device)
    scores = scores.masked_fill(~maskable, -1.0)
    forced = torch.zeros_like(maskable)
    forced.scatter_(1, scores.argmax(1, keepdim=True), True)
    return forced & maskable
