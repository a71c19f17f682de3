"""Retrieval metrics derived from 0-based best-positive ranks (see ``metrics.ranks``).

R@K is hit-style as the literature reports it: a query counts when its best positive is in the top
K, so image->text counts a hit when any of the image's captions is there. Mean and median rank are
reported 1-based (1 = top) as in the literature; MRR is the mean of 1 / (rank + 1).
"""

from __future__ import annotations

import torch
from torch import Tensor


def recall_at_k(ranks: Tensor, k: int) -> float:
    """Percentage of queries whose best positive ranks in the top ``k``."""
    return 100.0 * int((ranks < k).sum()) / ranks.numel()


def mean_reciprocal_rank(ranks: Tensor) -> float:
    return (1.0 / (ranks.double() + 1.0)).mean().item()


def mean_rank(ranks: Tensor) -> float:
    return (ranks.double() + 1.0).mean().item()


def median_rank(ranks: Tensor) -> float:
    """Median 1-based rank (the lower middle value for an even count, as torch.median)."""
    return (ranks.double() + 1.0).median().item()


def mean_rank_variance(
    instance: Tensor, language: Tensor, ranks: Tensor, num_languages: int
) -> tuple[float, float, int]:
    """Mean Rank Variance across languages (CCRk, spec §4): (MRV_var, MRV_std, dropped).

    Ranks are matched by ``instance`` key, never by position. MRV_var is the mean over instances of
    the population variance of their ``num_languages`` ranks (paper Eq. 7); MRV_std the mean of the
    population standard deviations (the reference code's scale). Instances lacking a language are
    left out and counted in ``dropped``. A repeated (instance, language) pair is an error.
    """
    keys, instance_slot = torch.unique(instance, return_inverse=True)
    cell = instance_slot * num_languages + language
    if torch.unique(cell).numel() != cell.numel():
        counts = torch.bincount(cell)
        repeated = int((counts > 1).nonzero()[0])
        raise ValueError(
            f"MRV: instance {int(keys[repeated // num_languages])} has two ranks for language "
            f"{repeated % num_languages}"
        )
    table = torch.full((len(keys), num_languages), float("nan"), dtype=torch.float64)
    table.view(-1)[cell] = ranks.double()
    complete = ~table.isnan().any(1)
    table = table[complete]
    if len(table) == 0:
        return float("nan"), float("nan"), int((~complete).sum())
    variance = table.var(1, unbiased=False)
    return variance.mean().item(), variance.sqrt().mean().item(), int((~complete).sum())
