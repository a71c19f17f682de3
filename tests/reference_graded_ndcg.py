"""Reference for the graded NDCG tests: the suite's first, dense implementation of graded NDCG@k
(a float64 relevance row per query and candidate), kept to check that the per-image one gives the
same values. Slow: do not use outside tests.

DCG@k = sum over ranked items of gain(rel) x discount, tie-averaged (see ``ccr.metrics.discount``);
IDCG@k is the DCG of the k largest gains of the query; a query with no positive gain scores 0.
Gains: ``"exponential"`` is 2^rel - 1 (CoVLR's protocol), ``"linear"`` is rel (sklearn and
torchmetrics); both agree for binary relevance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ccr.metrics.discount import tie_averaged_discount

GAINS: dict[str, Callable[[Tensor], Tensor]] = {
    "exponential": lambda relevance: torch.pow(2.0, relevance) - 1.0,
    "linear": lambda relevance: relevance,
}


def graded_ndcg_rows(scores: Tensor, gains: Tensor, k: int) -> Tensor:
    """NDCG@k of each row of ``scores`` [c, M] with item gains ``gains`` [c, M] (float64)."""
    size = min(k + 1, scores.shape[1])
    values, indices = scores.topk(size, dim=1)
    item_gain = gains.gather(1, indices)
    if size < k + 1:
        values = torch.cat([values, values.new_full((len(values), k + 1 - size), float("-inf"))], 1)
        item_gain = torch.cat([item_gain, item_gain.new_zeros(len(values), k + 1 - size)], 1)
    edge = values[:, k : k + 1]
    top = values[:, :k]
    higher = (values[:, None, :] > top[:, :, None]).sum(-1)
    tied = (values[:, None, :] == top[:, :, None]).sum(-1)
    inside = top > edge
    dcg = (item_gain[:, :k] * tie_averaged_discount(higher, tied, k) * inside).sum(1)
    edge_rows = (top[:, -1:] == edge).squeeze(1).nonzero().squeeze(1)
    if len(edge_rows):
        row_scores, row_edge = scores[edge_rows], edge[edge_rows]
        in_block = row_scores == row_edge
        block_higher = (row_scores > row_edge).sum(1)
        block_gain = (gains[edge_rows] * in_block).sum(1)
        block_size = in_block.sum(1).clamp(min=1)  # empty when only -inf padding ties the edge
        dcg[edge_rows] += block_gain * tie_averaged_discount(block_higher, block_size, k)
    best = gains.topk(min(k, gains.shape[1]), dim=1).values
    ideal = (best * (1.0 / torch.log2(torch.arange(best.shape[1], dtype=best.dtype) + 2))).sum(1)
    return torch.where(ideal > 0, dcg / ideal.clamp(min=torch.finfo(ideal.dtype).tiny), 0.0)


def graded_ndcg(
    query_emb: Tensor,
    candidate_emb: Tensor,
    relevance_rows: Callable[[int, int], Tensor],
    *,
    k: int = 10,
    exclude_self: bool = False,
    gain: str = "exponential",
    chunk_size: int = 1024,
) -> Tensor:
    """Per-query graded NDCG@k [Q]. ``relevance_rows(a, b)`` gives the relevance of queries a..b
    to every candidate; with ``exclude_self``, query i is not a candidate of itself (i2i, t2t)."""
    if gain not in GAINS:
        raise ValueError(f"unknown gain {gain!r}; choose one of {sorted(GAINS)}")
    num_queries = query_emb.shape[0]
    result = torch.empty(num_queries, dtype=torch.float64)
    for start in range(0, num_queries, chunk_size):
        stop = min(start + chunk_size, num_queries)
        scores = query_emb[start:stop] @ candidate_emb.T
        gains = GAINS[gain](relevance_rows(start, stop).to(torch.float64))
        if exclude_self:
            rows, own = torch.arange(stop - start), torch.arange(start, stop)
            scores[rows, own] = float("-inf")
            gains = gains.clone()
            gains[rows, own] = 0.0
        result[start:stop] = graded_ndcg_rows(scores, gains, k)
    return result
