"""Evaluation with a method's cross-encoder (fused encoder + ITM head): one path for every pair of
the evaluated set and for each query's top k.

A cross-encoder scores an (image, caption) pair only by running both through one network, so a
score matrix costs one forward pass per pair. A method exposes its cross-encoder as a
``PairScorer`` over the evaluated set's index-ordered caches:

* ``captions(index)``: the work that depends on the captions alone, done once per block of
  captions (CCRk: the text encoder; RC3: nothing but gathering the tagged ids);
* ``score(images, block, rows)``: the scores ``[n]`` of the pairs (image ``images[i]``, caption
  ``rows[i]`` of the block).

``score_matrix`` scores every pair (``evaluation.scorer=cross_encoder``), ``TopKRescorer`` the
top-k candidates the metrics' re-ranking hook hands it (``evaluation.rerank_k``); both go through
``score_pairs``. Work runs in blocks of ``caption_chunk`` captions and calls of at most
``pair_batch`` pairs, so memory beyond the ``[images, captions]`` result is bounded by those two
sizes (``evaluation.caption_chunk``, ``evaluation.pair_batch_size``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


class PairScorer(Protocol):
    device: torch.device

    def captions(self, index: Tensor) -> Any:
        """What the captions ``index`` contribute to any pair, computed once for the block."""

    def score(self, images: Tensor, block: Any, rows: Tensor) -> Tensor:
        """Scores ``[n]`` of (image ``images[i]``, caption ``rows[i]`` of ``block``)."""


def score_pairs(
    scorer: PairScorer, images: Tensor, captions: Tensor, *, caption_chunk: int, pair_batch: int
) -> Tensor:
    """Float32 scores ``[n]`` of the pairs (``images[i]``, ``captions[i]``) (global indices of the
    evaluated set), on the indices' device. Pairs are grouped by caption: each block of up to
    ``caption_chunk`` distinct captions is prepared once and its pairs scored ``pair_batch`` at a
    time, caption by caption (similar captions share a call, so little padding is carried)."""
    if caption_chunk < 1 or pair_batch < 1:
        raise ValueError(
            f"cross-encoder scoring: caption_chunk ({caption_chunk}) and pair_batch "
            f"({pair_batch}) must be >= 1"
        )
    home = captions.device
    images, captions = images.to(scorer.device), captions.to(scorer.device)
    order = torch.argsort(captions, stable=True)
    distinct, counts = torch.unique_consecutive(captions[order], return_counts=True)
    ends = counts.cumsum(0).tolist()
    scores = torch.empty(len(captions), dtype=torch.float32, device=scorer.device)
    for first in range(0, len(distinct), caption_chunk):
        last = min(first + caption_chunk, len(distinct))
        block = scorer.captions(distinct[first:last])
        rows = torch.repeat_interleave(
            torch.arange(last - first, device=scorer.device), counts[first:last]
        )
        pairs = order[(ends[first - 1] if first else 0) : ends[last - 1]]
        for start in range(0, len(pairs), pair_batch):
            part = pairs[start : start + pair_batch]
            scores[part] = scorer.score(
                images[part], block, rows[start : start + pair_batch]
            ).float()
    return scores.to(home)


def score_matrix(
    scorer: PairScorer, num_images: int, num_captions: int, *, caption_chunk: int, pair_batch: int
) -> Tensor:
    """Float32 ``[num_images, num_captions]``: the cross-encoder's score of every pair, built one
    block of ``caption_chunk`` captions (against every image) at a time."""
    matrix = torch.empty(num_images, num_captions, dtype=torch.float32, device=scorer.device)
    for start in range(0, num_captions, caption_chunk):
        stop = min(start + caption_chunk, num_captions)
        captions = torch.arange(start, stop, device=scorer.device).repeat_interleave(num_images)
        images = torch.arange(num_images, device=scorer.device).repeat(stop - start)
        block = score_pairs(
            scorer, images, captions, caption_chunk=caption_chunk, pair_batch=pair_batch
        )
        matrix[:, start:stop] = block.view(stop - start, num_images).T
    return matrix


class TopKRescorer:
    """The metrics' ``Reranker`` of a cross-encoder: each query's top-k candidates scored by the same
    ``score_pairs`` as every pair is."""

    def __init__(self, scorer: PairScorer, *, caption_chunk: int, pair_batch: int):
        self.scorer, self.caption_chunk, self.pair_batch = scorer, caption_chunk, pair_batch

    @torch.no_grad()
    def __call__(self, direction: str, query_index: Tensor, candidate_index: Tensor) -> Tensor:
        """Scores ``[q, k]`` of image ``query_index[i]`` (i2t) or caption ``query_index[i]`` (t2i)
        against its candidates ``candidate_index[i]`` (global indices of the evaluated set)."""
        if direction not in ("i2t", "t2i"):
            raise ValueError(f"reranker direction must be 'i2t' or 't2i', got {direction!r}")
        queries = query_index[:, None].expand_as(candidate_index)
        images, captions = (
            (queries, candidate_index) if direction == "i2t" else (candidate_index, queries)
        )
        scores = score_pairs(
            self.scorer,
            images.reshape(-1),
            captions.reshape(-1),
            caption_chunk=self.caption_chunk,
            pair_batch=self.pair_batch,
        )
        return scores.view(candidate_index.shape)
