"""The one report call used by evaluation, ``metrics.json`` and the leaderboard."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ccr.metrics import functional
from ccr.metrics.graded import graded_ndcg_at
from ccr.metrics.ranks import count_non_finite, paired_ranks, rank_and_ndcg
from ccr.metrics.reranking import Reranker
from ccr.metrics.ties import HIGHER


def _check_inputs(image_emb, text_emb, caption_image, caption_language, image_ids) -> None:
    num_images, num_captions = image_emb.shape[0], text_emb.shape[0]
    if len(image_ids) != num_images:
        raise ValueError(
            f"retrieval_report: {len(image_ids)} image_ids for {num_images} image embeddings"
        )
    if len(set(image_ids)) != num_images:
        raise ValueError("retrieval_report: image_ids are not unique")
    if caption_image.shape != (num_captions,) or len(caption_language) != num_captions:
        raise ValueError(
            f"retrieval_report: {num_captions} caption embeddings but caption_image has shape "
            f"{tuple(caption_image.shape)} and caption_language {len(caption_language)} entries"
        )
    outside = ((caption_image < 0) | (caption_image >= num_images)).nonzero()
    if len(outside):
        row = int(outside[0])
        raise ValueError(
            f"retrieval_report: caption {row} points to image {int(caption_image[row])} of {num_images}"
        )
    bad_images, bad_captions = count_non_finite(image_emb)[0], count_non_finite(text_emb)[0]
    if bad_images or bad_captions:
        raise ValueError(
            f"retrieval_report: non-finite embeddings: {bad_images} of {num_images} images and "
            f"{bad_captions} of {num_captions} captions (each is a query in one direction and a "
            f"candidate in the other)"
        )


def _mrv_languages(languages: list[str], mrv_languages: Sequence[str] | None) -> list[str]:
    """The languages MRV is computed over: all evaluated ones, or the given subset (in its order)."""
    if mrv_languages is None:
        return languages
    unknown = [lang for lang in mrv_languages if lang not in languages]
    if unknown or not mrv_languages:
        raise ValueError(
            f"retrieval_report: mrv_languages {list(mrv_languages)} must be a non-empty subset of "
            f"the evaluated languages {languages}"
        )
    return list(dict.fromkeys(mrv_languages))


def _first_caption_per_image(caption_image: Tensor) -> tuple[Tensor, Tensor]:
    """(images, position of each image's first caption) for the images that have captions."""
    images, slot = torch.unique(caption_image, return_inverse=True)
    positions = torch.arange(len(caption_image), device=caption_image.device)
    first = torch.full(
        (len(images),), len(caption_image), dtype=torch.long, device=caption_image.device
    )
    return images, first.scatter_reduce(0, slot, positions, reduce="amin")


def _language_ranks(
    image_emb,
    text_emb,
    captions,
    caption_image,
    *,
    ndcg_k,
    chunk_size,
    reranker,
    rerank_k,
    pair_scores,
):
    """(i2t query images, i2t ranks, i2t NDCG, t2i ranks, t2i NDCG) for one language's captions."""
    owners = caption_image[captions]
    if pair_scores is not None:
        block = pair_scores[:, captions.to(pair_scores.device)].to(owners.device)
        queries = torch.unique(owners)
        i2t = rank_and_ndcg(
            None,
            None,
            queries,
            owners,
            scores=block[queries],
            chunk_size=chunk_size,
            ndcg_k=ndcg_k,
            direction="i2t",
        )
        t2i = rank_and_ndcg(
            None,
            None,
            owners,
            torch.arange(block.shape[0], device=owners.device),
            scores=block.T,
            chunk_size=chunk_size,
            ndcg_k=ndcg_k,
            direction="t2i",
        )
        return (queries, *i2t, *t2i)
    if reranker is None or rerank_k <= 0:
        paired = paired_ranks(
            image_emb, text_emb[captions], owners, chunk_size=chunk_size, ndcg_k=ndcg_k
        )
        queries = (paired.i2t_rank[:, HIGHER] >= 0).nonzero().squeeze(1)
        return (
            queries,
            paired.i2t_rank[queries],
            paired.i2t_ndcg[queries],
            paired.t2i_rank,
            paired.t2i_ndcg,
        )
    queries = torch.unique(owners)
    i2t = rank_and_ndcg(
        image_emb[queries],
        text_emb[captions],
        queries,
        owners,
        chunk_size=chunk_size,
        ndcg_k=ndcg_k,
        direction="i2t",
        rerank_k=rerank_k,
        reranker=lambda d, q, c: reranker(d, queries[q], captions[c]),
    )
    t2i = rank_and_ndcg(
        text_emb[captions],
        image_emb,
        owners,
        torch.arange(image_emb.shape[0], device=owners.device),
        chunk_size=chunk_size,
        ndcg_k=ndcg_k,
        direction="t2i",
        rerank_k=rerank_k,
        reranker=lambda d, q, c: reranker(d, captions[q], c),
    )
    return (queries, *i2t, *t2i)


def _direction_scores(prefix: str, ranks: Tensor, ndcg: Tensor, ks, ndcg_k) -> dict[str, float]:
    scores = {f"{prefix}/R@{k}": functional.recall_at_k(ranks, k) for k in ks}
    scores[f"{prefix}/NDCG@{ndcg_k}"] = ndcg.mean().item()
    scores[f"{prefix}/MRR"] = functional.mean_reciprocal_rank(ranks)
    scores[f"{prefix}/MeanR"] = functional.mean_rank(ranks)
    scores[f"{prefix}/MedR"] = functional.median_rank(ranks)
    return scores


def retrieval_report(
    image_emb: Tensor,
    text_emb: Tensor,
    caption_image: Tensor,
    caption_language: Sequence[str],
    image_ids: Sequence[str],
    *,
    ks=(1, 5, 10),
    ndcg_k: int = 10,
    unimodal_ndcg_ks: Sequence[int] = (10, 20, 50),
    chunk_size: int = 1024,
    reranker: Reranker | None = None,
    rerank_k: int = 0,
    image_relevance: Tensor | None = None,
    mrv_languages: Sequence[str] | None = None,
    pair_scores: Tensor | None = None,
) -> dict[str, float]:
    """Every retrieval score of an evaluated set, as one flat dict (keys in docs/interfaces.md).

    Per language, image->text ranks an image's captions of that language among all captions of
    that language (images without one are no query); text->image ranks all images for each
    caption. ``mR_non_en`` averages the per-language mR of every language but English (present
    when there is one). MRV (``all/MRV_*``) is computed over ``mrv_languages`` (None: every
    evaluated language); it matches instances by image, uses each image's expected rank per
    language (TR) and its first caption's expected rank per language (IR), drops images missing a
    language and reports their count; one language gives 0. ``all/MRV`` is the mean of the TR and
    IR MRV_std. ``image_ids`` names the images; the instance key is the image's position, so ids
    must be unique. With ``image_relevance`` [I, I] (graded, per image pair), ``i2i/NDCG@k`` and
    ``t2t/NDCG@k`` for each k of ``unimodal_ndcg_ks``; without it, no uni-modal key at all. NaN or
    infinite embeddings are an error. With ``pair_scores`` [I, T] (a cross-encoder's score of
    every image-caption pair) the cross-modal ranks, recalls, NDCG and MRV come from that matrix
    instead of the embeddings' dot products (no re-ranking on top); the uni-modal NDCG still
    ranks the embeddings.
    """
    _check_inputs(image_emb, text_emb, caption_image, caption_language, image_ids)
    if pair_scores is not None:
        if pair_scores.shape != (image_emb.shape[0], text_emb.shape[0]):
            raise ValueError(
                f"retrieval_report: pair_scores has shape {tuple(pair_scores.shape)}, "
                f"expected ({image_emb.shape[0]}, {text_emb.shape[0]}) (images, captions)"
            )
        if rerank_k > 0:
            raise ValueError(
                "retrieval_report: pair_scores already score every pair; rerank_k must be 0"
            )
    languages = list(dict.fromkeys(caption_language))
    mrv_set = _mrv_languages(languages, mrv_languages)
    language_of = torch.tensor(
        [languages.index(lang) for lang in caption_language],
        dtype=torch.long,
        device=caption_image.device,
    )
    report: dict[str, float] = {}
    mrv_rows: dict[str, list[tuple[Tensor, Tensor, Tensor]]] = {"i2t": [], "t2i": []}
    for slot, lang in enumerate(languages):
        captions = (language_of == slot).nonzero().squeeze(1)
        queries, i2t_rank, i2t_ndcg, t2i_rank, t2i_ndcg = _language_ranks(
            image_emb,
            text_emb,
            captions,
            caption_image,
            ndcg_k=ndcg_k,
            chunk_size=chunk_size,
            reranker=reranker,
            rerank_k=rerank_k,
            pair_scores=pair_scores,
        )
        report |= _direction_scores(f"{lang}/i2t", i2t_rank, i2t_ndcg, ks, ndcg_k)
        report |= _direction_scores(f"{lang}/t2i", t2i_rank, t2i_ndcg, ks, ndcg_k)
        recalls = [report[f"{lang}/{d}/R@{k}"] for d in ("i2t", "t2i") for k in ks]
        report[f"{lang}/mR"] = sum(recalls) / len(recalls)
        if lang in mrv_set:
            images, first = _first_caption_per_image(caption_image[captions])
            mrv_slot = mrv_set.index(lang)
            mrv_rows["i2t"].append((queries, torch.full_like(queries, mrv_slot), i2t_rank))
            mrv_rows["t2i"].append((images, torch.full_like(images, mrv_slot), t2i_rank[first]))
    report["mR"] = sum(report[f"{lang}/mR"] for lang in languages) / len(languages)
    non_english = [lang for lang in languages if lang != "en"]
    if non_english:
        report["mR_non_en"] = sum(report[f"{lang}/mR"] for lang in non_english) / len(non_english)
    report |= _mrv_scores(mrv_rows, len(mrv_set), image_emb.shape[0])
    if image_relevance is not None:
        report |= _unimodal_ndcg(
            image_emb, text_emb, caption_image, image_relevance, unimodal_ndcg_ks, chunk_size
        )
    return report


def _mrv_scores(mrv_rows: dict[str, list], num_languages: int, num_images: int) -> dict[str, float]:
    """``all/MRV_var|std/{i2t,t2i}``, their combined ``all/MRV`` and ``all/MRV_dropped``."""
    scores: dict[str, float] = {}
    for direction, rows in mrv_rows.items():
        instance, language, ranks = (torch.cat(column) for column in zip(*rows, strict=True))
        variance, std, incomplete = functional.mean_rank_variance(
            instance, language, ranks, num_languages
        )
        scores[f"all/MRV_var/{direction}"] = variance
        scores[f"all/MRV_std/{direction}"] = std
        complete = len(torch.unique(instance)) - incomplete
    scores["all/MRV"] = (scores["all/MRV_std/i2t"] + scores["all/MRV_std/t2i"]) / 2
    scores["all/MRV_dropped"] = float(num_images - complete)
    return scores


def _unimodal_ndcg(image_emb, text_emb, caption_image, image_relevance, ks, chunk_size):
    """i2i and t2t graded NDCG at each k: images among all other images, captions among all other
    captions of every language; a caption's relevance to another is that of their images."""
    num_images = image_emb.shape[0]
    if image_relevance.shape != (num_images, num_images):
        raise ValueError(
            f"retrieval_report: image_relevance has shape {tuple(image_relevance.shape)}, "
            f"expected ({num_images}, {num_images})"
        )
    images = torch.arange(num_images, device=caption_image.device)
    scores = {}
    for name, emb, items in (("i2i", image_emb, images), ("t2t", text_emb, caption_image)):
        per_k = graded_ndcg_at(
            emb, emb, items, items, image_relevance, ks=ks, exclude_self=True, chunk_size=chunk_size
        )
        scores |= {f"{name}/NDCG@{k}": ndcg.mean().item() for k, ndcg in per_k.items()}
    return scores


def report_keys(
    languages: Sequence[str],
    *,
    ks=(1, 5, 10),
    ndcg_k: int = 10,
    unimodal_ndcg_ks: Sequence[int] = (),
    graded: bool = False,
) -> list[str]:
    """The keys :func:`retrieval_report` returns for these evaluated languages and settings
    (``graded``: the data gives image relevance, so the uni-modal NDCG keys are present), known
    before anything is scored: a run checks ``evaluation.select_on`` against them."""
    metrics = [*(f"R@{k}" for k in ks), f"NDCG@{ndcg_k}", "MRR", "MeanR", "MedR"]
    keys = [
        f"{lang}/{direction}/{m}"
        for lang in languages
        for direction in ("i2t", "t2i")
        for m in metrics
    ]
    keys += [f"{lang}/mR" for lang in languages] + ["mR"]
    if any(lang != "en" for lang in languages):
        keys.append("mR_non_en")
    keys += [f"all/MRV_{kind}/{d}" for kind in ("var", "std") for d in ("i2t", "t2i")]
    keys += ["all/MRV", "all/MRV_dropped"]
    if graded:
        keys += [f"{side}/NDCG@{k}" for side in ("i2i", "t2t") for k in unimodal_ndcg_ks]
    return keys


LOWER_IS_BETTER = ("MeanR", "MedR")  # ranks; every MRV key (a spread of ranks) too
NOT_A_SCORE = ("all/MRV_dropped",)  # a count of images left out, neither better nor worse


def better_direction(key: str) -> str:
    """``"max"`` for a report key where higher is better (recall, NDCG, MRR, mR), ``"min"`` where
    lower is (MeanR, MedR, MRV); ``ValueError`` for a key that ranks nothing."""
    if key in NOT_A_SCORE:
        raise ValueError(f"report key {key!r} counts images left out of MRV; it is not a score")
    if key.startswith("all/MRV") or key.rsplit("/", 1)[-1] in LOWER_IS_BETTER:
        return "min"
    return "max"
