"""Retrieval metrics from best-positive ranks: rank blocks [Q, 3] of the rank engine (see
``ccr.metrics.ties``) or plain untied 0-based ranks [Q].

Every metric is its expected value under uniform random tie-breaking. R@K is hit-style as the
literature reports it: a query counts when its first positive is in the top K (image->text: any of
the image's captions), and a tied query counts with its probability of being there. Mean rank and
MRR are expectations; median rank is the floor of the median of the expected 1-based ranks (the
convention of open_clip and VSE++).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ccr.metrics.ties import expected_rank, expected_reciprocal_rank, hit_probability


def recall_at_k(ranks: Tensor, k: int) -> float:
    """Percentage of queries whose first positive ranks in the top ``k`` (expected)."""
    hits = hit_probability(ranks, k)
    return 100.0 * float(hits.sum()) / hits.numel()


def mean_reciprocal_rank(ranks: Tensor) -> float:
    """Mean over queries of E[1 / (rank + 1)]."""
    return expected_reciprocal_rank(ranks).mean().item()


def mean_rank(ranks: Tensor) -> float:
    """Mean over queries of the expected 1-based rank."""
    return (expected_rank(ranks) + 1.0).mean().item()


def median_rank(ranks: Tensor) -> float:
    """Floor of the median of the expected 1-based ranks (middle pair averaged for an even count)."""
    ordered = (expected_rank(ranks) + 1.0).sort().values
    count = ordered.numel()
    middle = (ordered[(count - 1) // 2] + ordered[count // 2]) / 2
    return float(torch.floor(middle))


def mean_rank_variance(
    instance: Tensor, language: Tensor, ranks: Tensor, num_languages: int
) -> tuple[float, float, int]:
    """Mean Rank Variance across languages (CCRk, spec §4): (MRV_var, MRV_std, dropped).

    ``ranks`` are rank blocks (their expected ranks are used) or 0-based ranks [Q]. Ranks are
    matched by ``instance`` key, never by position. MRV_var is the mean over instances of the
    population variance of their ``num_languages`` ranks (paper Eq. 7); MRV_std the mean of the
    population standard deviations (the reference code's scale); one language gives 0. Instances
    lacking a language are left out and counted in ``dropped``. A repeated (instance, language)
    pair is an error.
    """
    values = expected_rank(ranks) if ranks.dim() == 2 else ranks.double()
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise ValueError(f"MRV: {bad} non-finite rank(s) of {values.numel()}")
    keys, instance_slot = torch.unique(instance, return_inverse=True)
    cell = instance_slot * num_languages + language
    if torch.unique(cell).numel() != cell.numel():
        counts = torch.bincount(cell)
        repeated = int((counts > 1).nonzero()[0])
        raise ValueError(
            f"MRV: instance {int(keys[repeated // num_languages])} has two ranks for language "
            f"{repeated % num_languages}"
        )
    table = torch.full(
        (len(keys), num_languages), float("nan"), dtype=torch.float64, device=values.device
    )
    table.view(-1)[cell] = values
    complete = ~table.isnan().any(1)
    table = table[complete]
    if len(table) == 0:
        return float("nan"), float("nan"), int((~complete).sum())
    variance = table.var(1, unbiased=False)
    return variance.mean().item(), variance.sqrt().mean().item(), int((~complete).sum())
