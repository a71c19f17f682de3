"""Re-ranking hook: a scorer (e.g. an image-text matching head) rescores each query's top-k."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class Reranker(Protocol):
    def __call__(self, direction: str, query_index: Tensor, candidate_index: Tensor) -> Tensor:
        """New scores [q, k] for each query's top-k candidates; ``direction`` is "i2t" or "t2i"."""


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
        raise ValueError(
            f"reranker ({direction}) returned {bad} non-finite scores of {new_scores.numel()}"
        )
    final = scores.to(torch.float64)
    floor = final.amax(1, keepdim=True) + 1.0
    lifted = floor + (new_scores - new_scores.amin(1, keepdim=True))
    return final.scatter(1, top, lifted)
