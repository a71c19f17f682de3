"""``RetrievalEvaluation``: the torchmetrics ``Metric`` that evaluation runs through.

The evaluated set's ground truth (``GroundTruth``: each caption's image and language, the image ids,
optionally graded image relevance) and how pairs are scored are fixed at construction. Each
evaluation batch adds its items' embeddings (and, when a cross-encoder scores, the per-item tensors
it needs) with their dataset ``index``. States are lists synced with ``cat``, so under DDP every
process ends up with every process's rows, whatever their counts. ``compute()`` (no arguments, as
torchmetrics and Lightning call it) puts the rows in index order, keeping the first copy of an index
that a DistributedSampler repeated to pad its last batch, and scores them with ``retrieval_report``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from ccr.metrics.report import retrieval_report
from ccr.metrics.reranking import Reranker

SIDES = {"images": "image", "captions": "text"}
Cache = Tensor | Mapping[str, Tensor] | None
PLAIN = ""  # cache key of a cache that is a single tensor


@dataclass(frozen=True, eq=False)  # tensors: compared by identity, not elementwise
class GroundTruth:
    """What the evaluated set is: ``caption_image`` [T] (each caption's image index),
    ``caption_language`` (T names), ``image_ids`` (I unique names), ``image_relevance`` [I, I]
    (graded, per image pair; None: no uni-modal NDCG) and ``mrv_languages`` (MRV's languages;
    None: every evaluated one). Items are numbered as the ``index`` of ``update``."""

    caption_image: Tensor
    caption_language: Sequence[str]
    image_ids: Sequence[str]
    image_relevance: Tensor | None = None
    mrv_languages: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.caption_image.shape != (len(self.caption_language),):
            raise ValueError(
                f"GroundTruth: caption_image has shape {tuple(self.caption_image.shape)} for "
                f"{len(self.caption_language)} caption languages"
            )
        images = len(self.image_ids)
        relevance = self.image_relevance
        if relevance is not None and relevance.shape != (images, images):
            raise ValueError(
                f"GroundTruth: image_relevance has shape {tuple(relevance.shape)}, "
                f"expected ({images}, {images})"
            )

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.caption_image)


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
    """Embeddings and cross-encoder caches of one evaluated set; ``compute()`` returns the report.

    ``truth`` is the set's ``GroundTruth``. ``update(side, index, emb, cache)`` with ``side``
    "images" or "captions". A cache (a tensor or a mapping of tensors, rows per item) gets its
    states on first sight; every process sees at least one batch of each side, as a
    DistributedSampler guarantees whenever the set has at least as many items as there are
    processes. ``build_reranker(image_cache, text_cache)`` makes the reranker from the
    index-ordered caches when ``rerank_k`` > 0; ``build_pair_scores(image_cache, text_cache)``
    (instead) makes the score matrix [I, T] of every image-caption pair that the cross-modal ranks
    then come from.
    """

    full_state_update = False

    def __init__(
        self,
        truth: GroundTruth,
        *,
        ks: Sequence[int],
        ndcg_k: int,
        unimodal_ndcg_ks: Sequence[int],
        chunk_size: int,
        rerank_k: int,
        build_reranker: Callable[[Cache, Cache], Reranker | None] | None = None,
        build_pair_scores: Callable[[Cache, Cache], Tensor] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if build_pair_scores is not None and rerank_k > 0:
            raise ValueError(
                "evaluation: a score matrix of every pair leaves nothing to re-rank; "
                "set evaluation.rerank_k=0"
            )
        self.truth = truth
        self.ks, self.ndcg_k, self.chunk_size, self.rerank_k = (
            tuple(ks),
            ndcg_k,
            chunk_size,
            rerank_k,
        )
        self.unimodal_ndcg_ks = tuple(unimodal_ndcg_ks)
        self.build_reranker, self.build_pair_scores = build_reranker, build_pair_scores
        self.cache_keys: dict[str, list[str] | None] = {side: None for side in SIDES}
        for side in SIDES:
            self.add_state(self._state(side, "index"), default=[], dist_reduce_fx="cat")
            self.add_state(self._state(side, "emb"), default=[], dist_reduce_fx="cat")

    @classmethod
    def from_config(
        cls, evaluation: Mapping, truth: GroundTruth, **overrides
    ) -> RetrievalEvaluation:
        """The evaluation of ``truth`` that the run's ``evaluation`` config section asks for
        (``overrides`` win)."""
        settings: dict[str, Any] = {
            "ks": tuple(evaluation["ks"]),
            "ndcg_k": int(evaluation["ndcg_k"]),
            "unimodal_ndcg_ks": tuple(evaluation["unimodal_ndcg_ks"]),
            "chunk_size": int(evaluation["chunk_size"]),
            "rerank_k": int(evaluation["rerank_k"]),
        }
        return cls(truth, **(settings | overrides))

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

    def _count(self, side: str) -> int:
        return self.truth.num_images if side == "images" else self.truth.num_captions

    def _placed(self, side: str, field: str) -> Tensor:
        index = getattr(self, self._state(side, "index"))
        rows = getattr(self, self._state(side, field))
        if isinstance(index, list) and not index:  # after a sync, states are tensors
            raise RuntimeError(f"evaluation produced no {side} (is the {side} loader empty?)")
        return place_rows(dim_zero_cat(index), dim_zero_cat(rows), self._count(side), side)

    def _placed_cache(self, side: str) -> Cache:
        keys = self.cache_keys[side]
        if keys is None:
            return None
        placed = {key: self._placed(side, f"cache_{key}") for key in keys}
        return placed[PLAIN] if keys == [PLAIN] else placed

    def compute(self) -> dict[str, float]:
        """The report of the gathered set (see ``retrieval_report``)."""
        truth = self.truth
        image_emb = self._placed("images", "emb")
        text_emb = self._placed("captions", "emb")
        reranker, pair_scores = None, None
        if self.rerank_k > 0 and self.build_reranker is not None:
            reranker = self.build_reranker(
                self._placed_cache("images"), self._placed_cache("captions")
            )
        if self.build_pair_scores is not None:
            pair_scores = self.build_pair_scores(
                self._placed_cache("images"), self._placed_cache("captions")
            )
        relevance = truth.image_relevance
        report = retrieval_report(
            image_emb,
            text_emb,
            truth.caption_image.to(image_emb.device),
            truth.caption_language,
            truth.image_ids,
            ks=self.ks,
            ndcg_k=self.ndcg_k,
            unimodal_ndcg_ks=self.unimodal_ndcg_ks,
            chunk_size=self.chunk_size,
            reranker=reranker,
            rerank_k=self.rerank_k if reranker is not None else 0,
            image_relevance=None if relevance is None else relevance.to(image_emb.device),
            mrv_languages=truth.mrv_languages,
            pair_scores=pair_scores,
        )
        return {key: float(value) for key, value in report.items()}
