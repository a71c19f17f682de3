"""The rank engine: each query's rank block (``ccr.metrics.ties``), computed chunk by chunk.

For every query it counts the candidates scoring strictly higher than its best-scoring positive,
the candidates tied with that score (the positive included) and the positives among them; every
rank metric is then the expectation under uniform random tie-breaking. Without ties the rank is the
one the argsort-per-row evaluator of the methods' public code (ALBEF ``itm_eval``) gives.

Positives are given by groups: candidate ``c`` is a positive of query ``q`` exactly when
``candidate_group[c] == query_group[q]`` (for image->text, the group is the image index of each
caption; for text->image, the caption's image against ``arange(N)``). Nothing of size
queries x candidates is ever held: memory is O(chunk x candidates). Every tensor is allocated on
the device of the inputs. NaN or infinite embeddings or scores are an error.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce

import torch
from torch import Tensor

from ccr.metrics.discount import ideal_binary_dcg, tie_averaged_discount
from ccr.metrics.reranking import Reranker, rerank_chunk
from ccr.metrics.ties import expected_rank, rank_blocks


def group_starts(sorted_groups: Tensor, num_groups: int) -> Tensor:
    """Where each group 0..num_groups-1 begins in ``sorted_groups`` (plus the end), [num_groups+1]."""
    counts = torch.bincount(sorted_groups, minlength=num_groups)[:num_groups]
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def positive_lists(query_group: Tensor, candidate_group: Tensor) -> tuple[Tensor, Tensor]:
    """Candidate indices of every query's positives, padded: (index [Q, P], valid [Q, P]).
    Groups are non-negative integers."""
    order = torch.argsort(candidate_group, stable=True)
    num_groups = int(max(query_group.max(), candidate_group.max())) + 1
    starts = group_starts(candidate_group[order], num_groups)
    start, count = starts[query_group], starts[query_group + 1] - starts[query_group]
    width = max(int(count.max()) if count.numel() else 0, 1)
    offsets = torch.arange(width, device=query_group.device)
    valid = offsets[None, :] < count[:, None]
    slot = (start[:, None] + offsets[None, :] * valid).clamp(max=max(len(order) - 1, 0))
    return order[slot], valid


MAX_EXACT_COUNT = 2**24  # float32 holds every integer up to here exactly


def count_compare(
    compare, part: Tensor, threshold: Tensor, dim: int, scratch: Tensor | None = None
) -> Tensor:
    """How many entries of ``part`` satisfy ``compare(entry, threshold)`` along ``dim`` (long).

    The 0/1 outcome is written into a float32 buffer and summed there: summing floats is about
    5x faster on CPU than summing bools, and exact because counts stay below 2**24.
    """
    if part.shape[dim] >= MAX_EXACT_COUNT:
        raise ValueError(
            f"cannot count over {part.shape[dim]} candidates (limit {MAX_EXACT_COUNT})"
        )
    if scratch is None:
        scratch = torch.empty(part.shape, dtype=torch.float32, device=part.device)
    compare(part, threshold, out=scratch)
    return scratch.sum(dim).long()


def count_above(
    parts: list[Tensor], threshold: Tensor, scratch: list[Tensor] | None = None
) -> Tensor:
    """Per row, how many scores across the column blocks ``parts`` exceed ``threshold`` [rows]."""
    buffers: Sequence[Tensor | None] = scratch or [None] * len(parts)
    counts = (
        count_compare(torch.gt, p, threshold[:, None], 1, b)
        for p, b in zip(parts, buffers, strict=True)
    )
    return reduce(operator.add, counts)


def count_equal(parts: list[Tensor], value: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
    """Per row, how many scores across ``parts`` equal ``value`` [rows]."""
    buffers: Sequence[Tensor | None] = scratch or [None] * len(parts)
    counts = (
        count_compare(torch.eq, p, value[:, None], 1, b)
        for p, b in zip(parts, buffers, strict=True)
    )
    return reduce(operator.add, counts)


def count_non_finite(matrix: Tensor) -> tuple[int, int]:
    """(rows, columns) of ``matrix`` holding a NaN or infinite entry."""
    bad = ~torch.isfinite(matrix)
    return int(bad.any(1).sum()), int(bad.any(0).sum())


def check_finite_embeddings(what: str, query_emb: Tensor, candidate_emb: Tensor) -> None:
    """Raise naming how many query and candidate embeddings hold a NaN or infinity."""
    queries, candidates = count_non_finite(query_emb)[0], count_non_finite(candidate_emb)[0]
    if queries or candidates:
        raise ValueError(
            f"{what}: non-finite embeddings in {queries} of {len(query_emb)} queries and "
            f"{candidates} of {len(candidate_emb)} candidates"
        )


def check_finite_scores(what: str, scores: Tensor) -> None:
    """Raise naming how many queries (rows) and candidates (columns) hold a NaN or infinity."""
    queries, candidates = count_non_finite(scores)
    if queries:
        raise ValueError(
            f"{what}: non-finite scores in {queries} of {scores.shape[0]} queries and "
            f"{candidates} of {scores.shape[1]} candidates"
        )


def window_top(parts: list[Tensor], size: int) -> Tensor:
    """The ``size`` highest scores of each row across ``parts``, descending, padded with -inf."""
    tops = [part.topk(min(size, part.shape[1]), dim=1).values for part in parts if part.shape[1]]
    merged = torch.cat(tops, 1) if tops else parts[0].new_empty(parts[0].shape[0], 0)
    if merged.shape[1] < size:
        pad = merged.new_full((merged.shape[0], size - merged.shape[1]), float("-inf"))
        merged = torch.cat([merged, pad], 1)
    return merged.topk(size, dim=1).values


def positive_ndcg(parts: list[Tensor], positive_scores: Tensor, valid: Tensor, k: int) -> Tensor:
    """Binary NDCG@k of each row whose positives score ``positive_scores`` [rows, P] (``valid``
    marks real entries), tie-averaged. Only ties reaching past the top-k window are recounted over
    the whole row."""
    window = window_top(parts, k + 1)
    edge_value = window[:, k : k + 1]
    higher = (window[:, None, :] > positive_scores[:, :, None]).sum(-1)
    tied = (window[:, None, :] == positive_scores[:, :, None]).sum(-1)
    on_edge = valid & (positive_scores == edge_value) & (higher < k)
    for row, slot in on_edge.nonzero().tolist():
        row_parts = [part[row : row + 1] for part in parts]
        score = positive_scores[row : row + 1, slot]
        higher[row, slot] = count_above(row_parts, score)[0]
        tied[row, slot] = count_equal(row_parts, score)[0]
    counted = valid & (positive_scores >= edge_value)
    gains = tie_averaged_discount(higher, tied.clamp(min=1), k) * counted
    return gains.sum(1) / ideal_binary_dcg(valid.sum(1), k)


def _rank_rows(
    score_rows: Callable[[int, int], Tensor],
    num_queries: int,
    query_group: Tensor,
    candidate_group: Tensor,
    *,
    chunk_size: int,
    ndcg_k: int,
    reranker: Reranker | None,
    rerank_k: int,
    direction: str,
) -> tuple[Tensor, Tensor]:
    """Rank blocks and binary NDCG@ndcg_k of every query, one row chunk of scores at a time."""
    positive_index, valid = positive_lists(query_group, candidate_group)
    missing = (~valid.any(1)).nonzero()
    if len(missing):
        raise ValueError(f"query {int(missing[0])} ({direction}) has no positive candidate")
    device = query_group.device
    blocks = torch.empty(num_queries, 3, dtype=torch.long, device=device)
    ndcg = torch.empty(num_queries, dtype=torch.float64, device=device)
    for start in range(0, num_queries, chunk_size):
        stop = min(start + chunk_size, num_queries)
        scores = score_rows(start, stop)
        if reranker is not None and rerank_k > 0:
            rows = torch.arange(start, stop, device=device)
            scores = rerank_chunk(scores, rows, reranker, rerank_k, direction)
        positive = scores.gather(1, positive_index[start:stop])
        rows_valid = valid[start:stop]
        best = positive.masked_fill(~rows_valid, float("-inf")).amax(1)
        tied_positives = ((positive == best[:, None]) & rows_valid).sum(1)
        blocks[start:stop] = rank_blocks(
            count_above([scores], best), count_equal([scores], best), tied_positives
        )
        ndcg[start:stop] = positive_ndcg([scores], positive, rows_valid, ndcg_k)
    return blocks, ndcg


def rank_and_ndcg(
    query_emb: Tensor | None,
    candidate_emb: Tensor | None,
    query_group: Tensor,
    candidate_group: Tensor,
    *,
    scores: Tensor | None = None,
    chunk_size: int = 1024,
    ndcg_k: int = 10,
    reranker: Reranker | None = None,
    rerank_k: int = 0,
    direction: str = "i2t",
) -> tuple[Tensor, Tensor]:
    """Rank blocks [Q, 3] (``ccr.metrics.ties``) and binary NDCG@ndcg_k [Q] from embeddings or a
    score matrix.

    Give either ``query_emb`` [Q, D] and ``candidate_emb`` [M, D] (scores are their dot products,
    computed per chunk) or ``scores`` [Q, M] (e.g. already re-ranked scores). With ``reranker``
    and ``rerank_k`` > 0, each query's top ``rerank_k`` candidates are rescored and placed first in
    their new order, the rest follow in the original order: a rank below ``rerank_k`` is then a
    position in the re-ranked list, a rank of ``rerank_k`` or more means no positive made the
    top ``rerank_k`` and counts the candidates above the best positive in the original scores.
    ``reranker`` receives local indices (rows of the queries, columns of the candidates).
    """
    if scores is not None:
        check_finite_scores(direction, scores)
        return _rank_rows(
            lambda a, b: scores[a:b],
            scores.shape[0],
            query_group,
            candidate_group,
            chunk_size=chunk_size,
            ndcg_k=ndcg_k,
            reranker=reranker,
            rerank_k=rerank_k,
            direction=direction,
        )
    if query_emb is None or candidate_emb is None:
        raise ValueError(f"{direction}: give either scores or both query and candidate embeddings")
    check_finite_embeddings(direction, query_emb, candidate_emb)
    return _rank_rows(
        lambda a, b: query_emb[a:b] @ candidate_emb.T,
        query_emb.shape[0],
        query_group,
        candidate_group,
        chunk_size=chunk_size,
        ndcg_k=ndcg_k,
        reranker=reranker,
        rerank_k=rerank_k,
        direction=direction,
    )


def best_positive_rank(
    query_emb: Tensor | None,
    candidate_emb: Tensor | None,
    query_group: Tensor,
    candidate_group: Tensor,
    *,
    scores: Tensor | None = None,
    chunk_size: int = 1024,
    reranker: Reranker | None = None,
    rerank_k: int = 0,
    direction: str = "i2t",
) -> Tensor:
    """Expected 0-based rank of each query's first positive, float64 [Q] (see ``ccr.metrics.ties``
    and ``rank_and_ndcg``)."""
    blocks, _ = rank_and_ndcg(
        query_emb,
        candidate_emb,
        query_group,
        candidate_group,
        scores=scores,
        chunk_size=chunk_size,
        reranker=reranker,
        rerank_k=rerank_k,
        direction=direction,
    )
    return expected_rank(blocks)


@dataclass
class PairedRanks:
    """Both directions of one image set against one caption set as rank blocks; an image without
    captions (it is no query) has an i2t block of -1."""

    i2t_rank: Tensor  # [N, 3]
    i2t_ndcg: Tensor  # [N]
    t2i_rank: Tensor  # [T, 3]
    t2i_ndcg: Tensor  # [T]


def paired_ranks(
    image_emb: Tensor,
    text_emb: Tensor,
    caption_image: Tensor,
    *,
    chunk_size: int = 1024,
    ndcg_k: int = 10,
) -> PairedRanks:
    """Image->text and text->image ranks and NDCG from ONE pass of the similarity matmul.

    Captions are grouped by image, so the block of image chunk j against its own captions (the
    "diagonal" block) holds every positive score of the chunk's images and captions. Those blocks
    are computed first; the positive scores used as thresholds are therefore the very entries that
    are compared, never a recomputation that could differ in rounding. Each score is then compared
    once along its row (image->text) and once along its column (text->image).
    """
    check_finite_embeddings("paired ranks", image_emb, text_emb)
    num_images, num_captions = image_emb.shape[0], text_emb.shape[0]
    device = image_emb.device
    order = torch.argsort(caption_image, stable=True)
    texts, owner = text_emb[order], caption_image[order]
    first_caption = group_starts(owner, num_images)
    positive_index, valid = positive_lists(torch.arange(num_images, device=device), owner)
    chunks = [(a, min(a + chunk_size, num_images)) for a in range(0, num_images, chunk_size)]

    diagonal = []
    gold = torch.empty(num_captions, dtype=image_emb.dtype, device=device)
    for a, b in chunks:
        lo, hi = int(first_caption[a]), int(first_caption[b])
        block = image_emb[a:b] @ texts[lo:hi].T
        gold[lo:hi] = block[owner[lo:hi] - a, torch.arange(hi - lo, device=device)]
        diagonal.append(block)

    i2t_rank = torch.empty(num_images, 3, dtype=torch.long, device=device)
    i2t_ndcg = torch.zeros(num_images, dtype=torch.float64, device=device)
    t2i_higher = torch.zeros(num_captions, dtype=torch.long, device=device)
    t2i_tied = torch.zeros(num_captions, dtype=torch.long, device=device)
    for (a, b), block in zip(chunks, diagonal, strict=True):
        lo, hi = int(first_caption[a]), int(first_caption[b])
        spans = [(0, lo, None), (lo, hi, block), (hi, num_captions, None)]
        spans = [(start, stop, stored) for start, stop, stored in spans if stop > start]
        parts = [
            image_emb[a:b] @ texts[start:stop].T if stored is None else stored
            for start, stop, stored in spans
        ]
        scratch = [torch.empty(part.shape, dtype=torch.float32, device=device) for part in parts]
        for part, buffer, (start, stop, _) in zip(parts, scratch, spans, strict=True):
            columns = slice(start, stop)
            t2i_higher[columns] += count_compare(torch.gt, part, gold[columns], 0, buffer)
            t2i_tied[columns] += count_compare(torch.eq, part, gold[columns], 0, buffer)
        rows_valid = valid[a:b]
        positive = gold[positive_index[a:b]].masked_fill(~rows_valid, float("-inf"))
        best = positive.amax(1)
        tied_positives = (positive == best[:, None]).sum(1)
        i2t_rank[a:b] = rank_blocks(
            count_above(parts, best, scratch), count_equal(parts, best, scratch), tied_positives
        )
        has_caption = rows_valid.any(1)
        scores_ndcg = positive_ndcg(parts, positive, rows_valid, ndcg_k)
        i2t_ndcg[a:b] = torch.where(has_caption, scores_ndcg, 0.0)
    i2t_rank[~valid.any(1)] = -1

    t2i_rank = torch.empty(num_captions, 3, dtype=torch.long, device=device)
    t2i_rank[order] = rank_blocks(t2i_higher, t2i_tied, torch.ones_like(t2i_tied))
    t2i_ndcg = torch.empty(num_captions, dtype=torch.float64, device=device)
    t2i_ndcg[order] = tie_averaged_discount(t2i_higher, t2i_tied, ndcg_k)
    return PairedRanks(i2t_rank, i2t_ndcg, t2i_rank, t2i_ndcg)
