"""Rank blocks: where a query's first positive lands when ties are broken uniformly at random.

The rank engine describes each query by three counts, stored as one long tensor [Q, 3]:
``higher`` candidates score strictly above its best positive, ``tied`` candidates (the best
positive included) share that score, and ``tied_positives`` of those are positives. Breaking the
tie in a uniformly random order, the 0-based rank of the first positive is ``higher + X`` where X,
the number of tied negatives drawn before the first tied positive, has

    P(X = j) = C(tied - 1 - j, tied_positives - 1) / C(tied, tied_positives),  j = 0 .. tied - tied_positives.

Every rank metric is the expectation over X, so no metric depends on how ties happen to be
ordered, and without ties (tied = tied_positives = 1) X = 0 and the rank is ``higher``.
A 1-D tensor of plain ranks is accepted everywhere as untied blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

HIGHER, TIED, TIED_POSITIVES = 0, 1, 2
PMF_CHUNK = 2**22  # terms of the distribution of X held at once


def rank_blocks(higher: Tensor, tied: Tensor, tied_positives: Tensor) -> Tensor:
    """Stack the three counts into blocks [Q, 3] (long)."""
    return torch.stack([higher.long(), tied.long(), tied_positives.long()], 1)


def as_blocks(ranks: Tensor) -> Tensor:
    """Blocks [Q, 3] from blocks or from plain untied 0-based ranks [Q]."""
    if ranks.dim() == 2 and ranks.shape[1] == 3:
        return ranks
    if ranks.dim() != 1:
        raise ValueError(
            f"ranks must be plain ranks [Q] or rank blocks [Q, 3], got shape {tuple(ranks.shape)}"
        )
    if ranks.is_floating_point() and not torch.equal(ranks, ranks.floor()):
        raise ValueError(
            "plain ranks must be whole numbers; pass rank blocks [Q, 3] for tied ranks"
        )
    ones = torch.ones_like(ranks, dtype=torch.long)
    return rank_blocks(ranks.long(), ones, ones)


def _split(ranks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    blocks = as_blocks(ranks).double()
    return blocks[:, HIGHER], blocks[:, TIED], blocks[:, TIED_POSITIVES]


def expected_rank(ranks: Tensor) -> Tensor:
    """E[0-based rank] = higher + (tied - tied_positives) / (tied_positives + 1), float64 [Q]."""
    higher, tied, positives = _split(ranks)
    return higher + (tied - positives) / (positives + 1.0)


def hit_probability(ranks: Tensor, k: int) -> Tensor:
    """P(rank < k), float64 [Q]: 1 - P(the first m = k - higher tied places are all negatives),
    and P(all negatives) = prod_{i < tied_positives} (tied - m - i) / (tied - i)."""
    higher, tied, positives = _split(ranks)
    room = k - higher
    hit = (room > tied - positives).double()  # a positive is certainly in the top k
    partial = ((room > 0) & (room <= tied - positives)).nonzero().squeeze(1)
    if len(partial):
        e, m, p = tied[partial], room[partial], positives[partial]
        steps = torch.arange(int(p.max()), dtype=torch.float64, device=ranks.device)
        factors = (e[:, None] - m[:, None] - steps) / (e[:, None] - steps)
        factors = torch.where(steps < p[:, None], factors, 1.0)
        hit[partial] = 1.0 - factors.prod(1)
    return hit


def expected_reciprocal_rank(ranks: Tensor) -> Tensor:
    """E[1 / (rank + 1)], float64 [Q], summed over the distribution of X for tied rows."""
    higher, tied, positives = _split(ranks)
    result = 1.0 / (higher + 1.0)
    rows = (tied > positives).nonzero().squeeze(1)
    if len(rows):
        width = int((tied[rows] - positives[rows]).max()) + 1
        step = max(1, PMF_CHUNK // width)
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            result[chunk] = _reciprocal_of_tied(higher[chunk], tied[chunk], positives[chunk], width)
    return result


def _reciprocal_of_tied(higher: Tensor, tied: Tensor, positives: Tensor, width: int) -> Tensor:
    """E[1 / (higher + 1 + X)] with P(X = 0) = p / e and P(X = j + 1) / P(X = j) = (e - p - j) / (e - 1 - j)."""
    j = torch.arange(width, dtype=torch.float64, device=higher.device)
    e, p = tied[:, None], positives[:, None]
    ratio = (e - p - j) / (e - 1 - j)  # beyond j = e - p masked below
    ratio = torch.cat([p / e, ratio[:, :-1]], 1)
    pmf = torch.where(j <= e - p, ratio.cumprod(1), 0.0)
    return (pmf / (higher[:, None] + 1.0 + j)).sum(1)
