"""Helpers on padded caption batches: trimming shared padding and drawing one language per row.

Training batches hold every instance's captions in K language slots (``input_ids [B, K, L]``,
``present [B, K]`` saying which slots hold a caption); evaluation batches hold one caption per row
(``[N, L]``). Both come padded to the tokenizer's maximum length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def trim_padding(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop the trailing token columns that are padding in every caption (any leading shape);
    encoders give real tokens the same states, with less work. No captions: one column."""
    lengths = attention_mask.sum(-1)
    length = max(int(lengths.max()) if lengths.numel() else 0, 1)
    return input_ids[..., :length], attention_mask[..., :length]


def sample_one_language(present: Tensor) -> Tensor:
    """For every instance (row of ``present [B, K]``), the index of one present language drawn
    uniformly at random. An instance without any caption is an error."""
    empty = (~present.bool()).all(dim=1)
    if empty.any():
        raise ValueError(
            f"batch rows {empty.nonzero().flatten().tolist()} have no caption in any language"
        )
    return torch.multinomial(present.float(), 1).squeeze(1)
