"""Graded-relevance NDCG@k (image->image, text->text retrieval), chunk by chunk.

Relevance is given per item (image): query ``q`` and candidate ``c`` are as relevant as their items,
``item_relevance[query_item[q], candidate_item[c]]`` (a caption's item is its image). So the ideal
DCG depends only on the query's item and is computed once per item from the item's relevance row
and how many candidates each item has; per query chunk only the top k+1 scores are looked up.

DCG@k = sum over ranked items of gain(rel) x discount, tie-averaged (see ``ccr.metrics.discount``), which
is the expected DCG under uniform random tie-breaking; IDCG@k is the DCG of the k largest gains of
the query; a query with no positive gain scores 0. Gains: ``"exponential"`` is 2^rel - 1 (the
suite's adopted choice), ``"linear"`` is rel (sklearn, torchmetrics and CoVLR's code); both agree
for binary relevance. Inputs are never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ccr.metrics.discount import position_discounts, tie_averaged_discount
from ccr.metrics.ranks import check_finite_embeddings

GAINS: dict[str, Callable[[Tensor], Tensor]] = {
    "exponential": lambda relevance: torch.pow(2.0, relevance) - 1.0,
    "linear": lambda relevance: relevance,
}
EDGE_ROWS = 64  # rows whose tie at position k is recounted over the whole row at once


def _check_relevance(item_relevance: Tensor) -> None:
    bad = int((~torch.isfinite(item_relevance)).sum())
    if bad:
        raise ValueError(
            f"graded NDCG: {bad} non-finite relevance value(s) of {item_relevance.numel()}"
        )
    negative = int((item_relevance < 0).sum())
    if negative:
        raise ValueError(
            f"graded NDCG: {negative} negative relevance value(s); relevance must be >= 0"
        )


def ideal_dcg_per_item(
    item_gain: Tensor, candidate_item: Tensor, k: int, exclude_self: bool
) -> Tensor:
    """IDCG@k of a query of each item [I]: the k largest gains among the candidates, where item j
    contributes ``gain[i, j]`` once per candidate of item j (one fewer for the query's own item
    when the query itself is no candidate)."""
    num_items = item_gain.shape[0]
    counts = torch.bincount(candidate_item, minlength=item_gain.shape[1])
    ordered, order = item_gain.sort(1, descending=True)
    copies = counts[order]
    if exclude_self:
        items = torch.arange(num_items, device=item_gain.device)
        copies = copies - (order == items[:, None]).long()
    last_position = copies.cumsum(1)  # positions before which each sorted gain has been used up
    k = min(k, len(candidate_item))  # no more positions than candidates (the query itself included)
    positions = torch.arange(k, device=item_gain.device).expand(num_items, k).contiguous()
    slot = torch.searchsorted(last_position, positions, right=True)
    inside = slot < ordered.shape[1]
    best = torch.where(inside, ordered.gather(1, slot.clamp(max=ordered.shape[1] - 1)), 0.0)
    return (best * position_discounts(k, item_gain.device)).sum(1)


def _chunk_gains(
    item_gain: Tensor, own_item: Tensor, candidate_item: Tensor, start: int, exclude_self: bool
) -> Callable[[Tensor, Tensor], Tensor]:
    """``gain_at(rows, columns)`` of a chunk of queries starting at query ``start``: the gain of
    each (chunk row, candidate) pair, 0 for a query against itself when ``exclude_self``."""

    def gain_at(rows: Tensor, columns: Tensor) -> Tensor:
        gains = item_gain[own_item[rows], candidate_item[columns]]
        return torch.where(columns == rows + start, 0.0, gains) if exclude_self else gains

    return gain_at


def _sorted_top(
    scores: Tensor, gain_at: Callable[[Tensor, Tensor], Tensor], size: int
) -> tuple[Tensor, Tensor]:
    """The ``size`` best scores of each row, descending, and their gains [c, size]; rows with fewer
    candidates are padded with -inf scores of gain 0."""
    available = min(size, scores.shape[1])
    values, indices = scores.topk(available, dim=1)
    rows = torch.arange(len(scores), device=scores.device)
    item_gain = gain_at(rows[:, None], indices)
    if available < size:
        values = torch.cat(
            [values, values.new_full((len(values), size - available), float("-inf"))], 1
        )
        item_gain = torch.cat([item_gain, item_gain.new_zeros(len(values), size - available)], 1)
    return values, item_gain


def _chunk_dcg(
    scores: Tensor, best: tuple[Tensor, Tensor], gain_at: Callable[[Tensor, Tensor], Tensor], k: int
) -> Tensor:
    """DCG@k of each row of ``scores`` [c, M] from ``best``, its rows' sorted best scores and their
    gains (at least k+1 columns, see ``_sorted_top``); ``gain_at(rows, columns)`` gives item gains.
    Cutting a longer sorted list at k is exact: whatever precedes the (k+1)-th score scores higher
    than it, and the items that tie with it are counted over the whole row."""
    values, item_gain = best[0][:, : k + 1], best[1][:, : k + 1]
    edge = values[:, k : k + 1]
    top = values[:, :k]
    higher = (values[:, None, :] > top[:, :, None]).sum(-1)
    tied = (values[:, None, :] == top[:, :, None]).sum(-1)
    inside = top > edge
    dcg = (item_gain[:, :k] * tie_averaged_discount(higher, tied, k) * inside).sum(1)
    edge_rows = (top[:, -1:] == edge).squeeze(1).nonzero().squeeze(1)
    columns = torch.arange(scores.shape[1], device=scores.device)
    for part in edge_rows.split(EDGE_ROWS):
        row_scores, row_edge = scores[part], edge[part]
        in_block = row_scores == row_edge
        block_higher = (row_scores > row_edge).sum(1)
        block_gain = (gain_at(part[:, None], columns[None, :]) * in_block).sum(1)
        block_size = in_block.sum(1).clamp(min=1)  # empty when only -inf padding ties the edge
        dcg[part] += block_gain * tie_averaged_discount(block_higher, block_size, k)
    return dcg


def graded_ndcg(
    query_emb: Tensor,
    candidate_emb: Tensor,
    query_item: Tensor,
    candidate_item: Tensor,
    item_relevance: Tensor,
    *,
    k: int = 10,
    exclude_self: bool = False,
    gain: str = "exponential",
    chunk_size: int = 1024,
) -> Tensor:
    """Per-query graded NDCG@k [Q] (float64). ``query_item`` [Q] and ``candidate_item`` [M] index
    the rows and columns of ``item_relevance`` [I, I]; with ``exclude_self``, query i is not a
    candidate of itself (i2i, t2t: the same set on both sides)."""
    return graded_ndcg_at(
        query_emb,
        candidate_emb,
        query_item,
        candidate_item,
        item_relevance,
        ks=(k,),
        exclude_self=exclude_self,
        gain=gain,
        chunk_size=chunk_size,
    )[k]


def graded_ndcg_at(
    query_emb: Tensor,
    candidate_emb: Tensor,
    query_item: Tensor,
    candidate_item: Tensor,
    item_relevance: Tensor,
    *,
    ks: Sequence[int],
    exclude_self: bool = False,
    gain: str = "exponential",
    chunk_size: int = 1024,
) -> dict[int, Tensor]:
    """``{k: per-query graded NDCG@k [Q]}`` for every cut-off in ``ks``, as ``graded_ndcg`` gives
    each: every chunk's scores are computed and sorted once (top max(ks)+1) and cut at each k."""
    if gain not in GAINS:
        raise ValueError(f"unknown gain {gain!r}; choose one of {sorted(GAINS)}")
    bad_ks = [k for k in ks if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if bad_ks or not ks:
        raise ValueError(
            f"graded NDCG: cut-offs must be a non-empty list of integers >= 1, got {list(ks)}"
        )
    ks = list(dict.fromkeys(ks))
    check_finite_embeddings("graded NDCG", query_emb, candidate_emb)
    _check_relevance(item_relevance)
    item_gain = GAINS[gain](item_relevance.to(torch.float64))
    ideal = {
        k: ideal_dcg_per_item(item_gain, candidate_item, k, exclude_self)[query_item] for k in ks
    }
    num_queries = query_emb.shape[0]
    result = {k: torch.empty(num_queries, dtype=torch.float64, device=query_emb.device) for k in ks}
    for start in range(0, num_queries, chunk_size):
        stop = min(start + chunk_size, num_queries)
        scores = query_emb[start:stop] @ candidate_emb.T
        gain_at = _chunk_gains(
            item_gain, query_item[start:stop], candidate_item, start, exclude_self
        )
        if exclude_self:
            rows = torch.arange(stop - start, device=scores.device)
            scores[rows, rows + start] = float("-inf")
        best = _sorted_top(scores, gain_at, max(ks) + 1)
        for k in ks:
            dcg = _chunk_dcg(scores, best, gain_at, k)
            chunk_ideal = ideal[k][start:stop]
            result[k][start:stop] = torch.where(
                chunk_ideal > 0,
                dcg / chunk_ideal.clamp(min=torch.finfo(chunk_ideal.dtype).tiny),
                0.0,
            )
    return result
