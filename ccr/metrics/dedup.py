"""The "dedup" image->text recall of mCLIP's reference evaluation (spec §8-A16), reported beside
the standard scores so that numbers can be compared with the paper's.

The reference script ranks an image query's captions, maps them to their image ids, removes
repeated ids and counts a hit when the query's image is among the first K *distinct* ids. An image
first appears in that list at its best-scoring caption, so this equals ranking the images by their
best caption's score: images tied on that score are taken as uniformly ordered (the suite's tie
rule, ``ccr.metrics.ties``). It is never below the standard rule and equals it when every image has
one caption per language; text->image ranks unique images already, so it is unchanged.

Keys: ``<lang>/i2t_dedup/R@K``, ``<lang>/mR_dedup`` (dedup i2t with the standard t2i recalls) and
``mR_dedup`` (their mean over languages). The standard keys keep their meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ccr.metrics import functional
from ccr.metrics.evaluation import RetrievalEvaluation
from ccr.metrics.ranks import check_finite_embeddings, rank_and_ndcg


def dedup_i2t_ranks(
    image_emb: Tensor, text_emb: Tensor, caption_image: Tensor, chunk_size: int = 1024
) -> Tensor:
    """Rank blocks [Q, 3] of the images that have captions (ascending image index), each ranked
    among those images by their best caption's score."""
    check_finite_embeddings("i2t dedup", image_emb, text_emb)
    queries = torch.unique(caption_image)
    slot = torch.searchsorted(queries, caption_image)  # column of each caption's image
    best = torch.empty(len(queries), len(queries), dtype=image_emb.dtype, device=image_emb.device)
    for start in range(0, len(queries), chunk_size):
        rows = queries[start : start + chunk_size]
        scores = image_emb[rows] @ text_emb.T
        per_image = scores.new_full((len(rows), len(queries)), float("-inf"))
        best[start : start + len(rows)] = per_image.scatter_reduce(
            1, slot[None].expand(len(rows), -1), scores, reduce="amax"
        )
    groups = torch.arange(len(queries), device=image_emb.device)
    blocks, _ = rank_and_ndcg(
        None, None, groups, groups, scores=best, chunk_size=chunk_size, direction="i2t dedup"
    )
    return blocks


def dedup_recall_report(
    image_emb: Tensor,
    text_emb: Tensor,
    caption_image: Tensor,
    caption_language: Sequence[str],
    report: dict[str, float],
    *,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 1024,
) -> dict[str, float]:
    """The dedup keys for every language of ``caption_language``; ``report`` is the standard
    report of the same embeddings (its t2i recalls enter ``<lang>/mR_dedup``)."""
    languages = list(dict.fromkeys(caption_language))
    scores: dict[str, float] = {}
    for language in languages:
        captions = (
            torch.tensor(
                [lang == language for lang in caption_language], device=caption_image.device
            )
            .nonzero()
            .squeeze(1)
        )
        ranks = dedup_i2t_ranks(image_emb, text_emb[captions], caption_image[captions], chunk_size)
        recalls = []
        for k in ks:
            scores[f"{language}/i2t_dedup/R@{k}"] = functional.recall_at_k(ranks, k)
            recalls += [scores[f"{language}/i2t_dedup/R@{k}"], report[f"{language}/t2i/R@{k}"]]
        scores[f"{language}/mR_dedup"] = sum(recalls) / len(recalls)
    scores["mR_dedup"] = sum(scores[f"{lang}/mR_dedup"] for lang in languages) / len(languages)
    return scores


class DedupRecallEvaluation(RetrievalEvaluation):
    """``RetrievalEvaluation`` whose report also carries the dedup keys (computed from the same
    gathered embeddings, in index order)."""

    def compute(self) -> dict[str, float]:
        report = super().compute()
        image_emb = self._placed("images", "emb")
        extra = dedup_recall_report(
            image_emb,
            self._placed("captions", "emb"),
            self.truth.caption_image.to(image_emb.device),
            self.truth.caption_language,
            report,
            ks=self.ks,
            chunk_size=self.chunk_size,
        )
        return report | extra
