"""Re-ranking hook: a scorer (e.g. an image-text matching head) rescores each query's top-k."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor


class Reranker(Protocol):
    def __call__(self, direction: str, query_index: Tensor, candidate_index: Tensor) -> Tensor:
        """New scores [q, k] for each query's top-k candidates; ``direction`` is "i2t" or "t2i"."""


def score_candidate_pairs(
    direction: str, query_index: Tensor, candidate_index: Tensor,
    score_pairs: Callable[[Tensor, Tensor], Tensor], chunk: int, device: torch.device,
) -> Tensor:
    """What a pair-scoring :class:`Reranker` returns: ``score_pairs(images, captions)`` over every
    (query, candidate) pair as image / caption index pairs on ``device``, ``chunk`` pairs at a
    time, shaped [q, k] like ``candidate_index``."""
    if direction not in ("i2t", "t2i"):
        raise ValueError(f"reranker direction must be 'i2t' or 't2i', got {direction!r}")
    queries = query_index[:, None].expand_as(candidate_index)
    images, captions = (queries, candidate_index) if direction == "i2t" else (candidate_index, queries)
    images, captions = images.reshape(-1), captions.reshape(-1)
    scores = [score_pairs(images[start:start + chunk].to(device), captions[start:start + chunk].to(device))
              for start in range(0, len(images), chunk)]
    return torch.cat(scores).view(candidate_index.shape).to(candidate_index.device)


def rerank_chunk(
    scores: Tensor, query_index: Tensor, reranker: Reranker, k: int, direction: str
) -> Tensor:
    """Final scores of a row chunk: the top ``k`` candidates of each row, rescored by ``reranker``,
    are lifted above every other candidate in their new order; the rest keep their order.

    Returned in float64 so that the lifted scores keep the float32 rescores' exact order.
    """
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    new_scores = reranker(direction, query_index, top).to(torch.float64)
    if new_scores.shape != top.shape:
        raise ValueError(
            f"reranker ({direction}) returned shape {tuple(new_scores.shape)}, "
            f"expected {tuple(top.shape)}"
        )
    bad = int((~torch.isfinite(new_scores)).sum())
    if bad:
        raise ValueError(f"reranker ({direction}) returned {bad} non-finite scores of {new_scores.numel()}")
    final = scores.to(torch.float64)
    floor = final.amax(1, keepdim=True) + 1.0
    lifted = floor + (new_scores - new_scores.amin(1, keepdim=True))
    return final.scatter(1, top, lifted)
