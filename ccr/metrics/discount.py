"""Tie-averaged DCG discounts shared by every NDCG computation of the suite.

An item whose score ties with others occupies a block of positions ``g .. g+e-1`` (0-based, ``g`` =
number of strictly higher candidates, ``e`` = block size). Like sklearn and torchmetrics, each item
of the block receives the block's *mean* discount, so NDCG does not depend on how ties are ordered.
"""

from __future__ import annotations

import torch
from torch import Tensor


def position_discounts(k: int, device: torch.device) -> Tensor:
    """``1 / log2(p + 2)`` for the 0-based positions ``p = 0 .. k-1`` (float64)."""
    return 1.0 / torch.log2(torch.arange(k, dtype=torch.float64, device=device) + 2)


def cumulative_discounts(k: int, device: torch.device) -> Tensor:
    """``D[n] = sum_{p < n} 1 / log2(p + 2)`` for ``n = 0 .. k`` (D[0] = 0), float64."""
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    return torch.cat([zero, torch.cumsum(position_discounts(k, device), 0)])


def tie_averaged_discount(higher: Tensor, tied: Tensor, k: int) -> Tensor:
    """Mean discount@k of an item with ``higher`` strictly better candidates in a block of ``tied``
    equal scores (``tied`` >= 1, itself included); 0 beyond position k."""
    table = cumulative_discounts(k, higher.device)
    start = higher.clamp(max=k)
    stop = (higher + tied).clamp(max=k)
    return (table[stop] - table[start]) / tied.to(table.dtype)


def ideal_binary_dcg(num_positives: Tensor, k: int) -> Tensor:
    """Best achievable DCG@k with ``num_positives`` relevant items of gain 1."""
    table = cumulative_discounts(k, num_positives.device)
    return table[num_positives.clamp(max=k)]
