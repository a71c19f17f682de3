"""``RetrievalEvaluation``: the torchmetrics ``Metric`` that evaluation runs through.

Each evaluation batch adds its items' embeddings (and, when re-ranking, the per-item tensors a
reranker needs) with their dataset ``index``. States are lists synced with ``cat``, so under DDP
every process ends up with every process's rows, whatever their counts. ``compute`` puts the rows in
index order, keeping the first copy of an index that a DistributedSampler repeated to pad its last
batch, and scores them with ``retrieval_report``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from metrics.report import retrieval_report
from metrics.reranking import Reranker

SIDES = {"images": "image", "captions": "text"}
Cache = Tensor | Mapping[str, Tensor] | None
PLAIN = ""  # cache key of a cache that is a single tensor


def place_rows(index: Tensor, rows: Tensor, count: int, what: str) -> Tensor:
    """``rows`` [n, ...] put at their ``index`` in a tensor of ``count`` rows; for a repeated index the
    first copy is kept. An index out of range or an item never seen is an error."""
    if len(index) and int(index.max()) >= count:
        raise RuntimeError(
            f"evaluation: {what} index {int(index.max())} out of range ({count} {what})"
        )
    items, slot = torch.unique(index, return_inverse=True)
    missing = count - len(items)
    if missing:
        raise RuntimeError(f"evaluation: {missing} of {count} {what} were never encoded")
    positions = torch.arange(len(index), device=index.device)
    first = torch.full((count,), len(index), dtype=torch.long, device=index.device)
    first = first.scatter_reduce(0, slot, positions, reduce="amin")
    return rows[first]


class RetrievalEvaluation(Metric):
    """Embeddings and re-ranking caches of one evaluated set; ``compute`` returns the report.

    ``update(side, index, emb, cache)`` with ``side`` "images" or "captions". A cache (a tensor or a
    mapping of tensors, rows per item) gets its states on first sight; every process sees at least
    one batch of each side, as a DistributedSampler guarantees whenever the set has at least as many
    items as there are processes.
    """

    full_state_update = False

    def __init__(
        self,
        *,
        ks: Sequence[int],
        ndcg_k: int,
        unimodal_ndcg_ks: Sequence[int],
        chunk_size: int,
        rerank_k: int,
        **kwargs,
    ) -> None:
        super().__init__(compute_with_cache=False, **kwargs)
        self.ks, self.ndcg_k, self.chunk_size, self.rerank_k = (
            tuple(ks),
            ndcg_k,
            chunk_size,
            rerank_k,
        )
        self.unimodal_ndcg_ks = tuple(unimodal_ndcg_ks)
        self.cache_keys: dict[str, list[str] | None] = {side: None for side in SIDES}
        for side in SIDES:
            self.add_state(self._state(side, "index"), default=[], dist_reduce_fx="cat")
            self.add_state(self._state(side, "emb"), default=[], dist_reduce_fx="cat")

    @classmethod
    def from_config(cls, evaluation: Mapping, **overrides) -> RetrievalEvaluation:
        """The evaluation the run's ``evaluation`` config section asks for (``overrides`` win)."""
        settings: dict[str, Any] = {
            "ks": tuple(evaluation["ks"]),
            "ndcg_k": int(evaluation["ndcg_k"]),
            "unimodal_ndcg_ks": tuple(evaluation["unimodal_ndcg_ks"]),
            "chunk_size": int(evaluation["chunk_size"]),
            "rerank_k": int(evaluation["rerank_k"]),
        }
        return cls(**(settings | overrides))

    @staticmethod
    def _state(side: str, field: str) -> str:
        return f"{SIDES[side]}_{field}"

    def update(self, side: str, index: Tensor, emb: Tensor, cache: Cache = None) -> None:
        if side not in SIDES:
            raise ValueError(
                f"RetrievalEvaluation: side must be one of {sorted(SIDES)}, got {side!r}"
            )
        getattr(self, self._state(side, "index")).append(index.detach().long().flatten())
        getattr(self, self._state(side, "emb")).append(emb.detach())
        if cache is None:
            return
        parts = {PLAIN: cache} if isinstance(cache, Tensor) else dict(cache)
        keys = self.cache_keys[side]
        if keys is None:
            keys = self.cache_keys[side] = list(parts)
            for key in keys:
                self.add_state(self._state(side, f"cache_{key}"), default=[], dist_reduce_fx="cat")
        for key in keys:
            getattr(self, self._state(side, f"cache_{key}")).append(parts[key].detach())

    def _placed(self, side: str, field: str, count: int) -> Tensor:
        index = getattr(self, self._state(side, "index"))
        rows = getattr(self, self._state(side, field))
        if isinstance(index, list) and not index:  # after a sync, states are tensors
            raise RuntimeError(f"evaluation produced no {side} (is the {side} loader empty?)")
        return place_rows(dim_zero_cat(index), dim_zero_cat(rows), count, side)

    def _placed_cache(self, side: str, count: int) -> Cache:
        keys = self.cache_keys[side]
        if keys is None:
            return None
        placed = {key: self._placed(side, f"cache_{key}", count) for key in keys}
        return placed[PLAIN] if keys == [PLAIN] else placed

    def compute(  # type: ignore[override]  # takes the ground truth until issue 33 item 5
        self,
        *,
        caption_image: Tensor,
        caption_language: Sequence[str],
        image_ids: Sequence[str],
        image_relevance: Tensor | None = None,
        mrv_languages: Sequence[str] | None = None,
        build_reranker: Callable[[Cache, Cache], Reranker | None] | None = None,
        build_pair_scores: Callable[[Cache, Cache], Tensor] | None = None,
    ) -> dict[str, float]:
        """The report of the gathered set (see ``retrieval_report``); ``build_reranker(image_cache,
        text_cache)`` makes the reranker from the index-ordered caches when ``rerank_k`` > 0;
        ``build_pair_scores(image_cache, text_cache)`` (instead) makes the score matrix of every
        image-caption pair that the cross-modal ranks then come from."""
        if build_pair_scores is not None and self.rerank_k > 0:
            raise ValueError(
                "evaluation: a score matrix of every pair leaves nothing to re-rank; "
                "set evaluation.rerank_k=0"
            )
        image_emb = self._placed("images", "emb", len(image_ids))
        text_emb = self._placed("captions", "emb", len(caption_image))
        reranker, pair_scores = None, None
        if self.rerank_k > 0 and build_reranker is not None:
            reranker = build_reranker(
                self._placed_cache("images", len(image_ids)),
                self._placed_cache("captions", len(caption_image)),
            )
        if build_pair_scores is not None:
            pair_scores = build_pair_scores(
                self._placed_cache("images", len(image_ids)),
                self._placed_cache("captions", len(caption_image)),
            )
        report = retrieval_report(
            image_emb,
            text_emb,
            caption_image.to(image_emb.device),
            caption_language,
            image_ids,
            ks=self.ks,
            ndcg_k=self.ndcg_k,
            unimodal_ndcg_ks=self.unimodal_ndcg_ks,
            chunk_size=self.chunk_size,
            reranker=reranker,
            rerank_k=self.rerank_k if reranker is not None else 0,
            image_relevance=None
            if image_relevance is None
            else image_relevance.to(image_emb.device),
            mrv_languages=mrv_languages,
            pair_scores=pair_scores,
        )
        return {key: float(value) for key, value in report.items()}
