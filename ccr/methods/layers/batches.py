"""Helpers on padded batches: trimming shared padding, drawing one language per row, and filling
an evaluation batch up to its loader's shape.

Training batches hold every instance's captions in K language slots (``input_ids [B, K, L]``,
``present [B, K]`` saying which slots hold a caption); evaluation batches hold one caption per row
(``[N, L]``). Both come padded to the tokenizer's maximum length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def fill_to(rows: int, tensor: Tensor) -> Tensor:
    """``tensor`` filled up to ``rows`` rows with copies of its first row (as it is when already
    that long): one shape for every call, whose extra outputs the caller drops."""
    fill = torch.zeros(max(rows - len(tensor), 0), dtype=torch.long, device=tensor.device)
    return torch.cat([tensor, tensor[fill]])


def fill_rows(batch: dict[str, Any], rows: int | None) -> dict[str, Any]:
    """``batch`` with every tensor and every per-row list (e.g. the captions' ``language``) filled
    up to ``rows`` rows with copies of its first row (``fill_to``); ``rows`` None, or a batch
    already that long, comes back as it is."""
    count = len(batch["index"])
    if rows is None or count >= rows:
        return batch
    filled = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            value = fill_to(rows, value)
        elif isinstance(value, list) and len(value) == count:
            value = value + value[:1] * (rows - count)
        filled[key] = value
    return filled


def first_rows(value: Tensor | Mapping[str, Tensor] | None, count: int):
    """The first ``count`` rows of a tensor, of every tensor of a mapping, or None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {key: first_rows(item, count) for key, item in value.items()}
    return value[:count]
