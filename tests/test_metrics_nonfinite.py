"""NaN or inf embeddings and scores are errors that say how many queries and candidates they hit."""

import pytest
import torch

from ccr.metrics import graded_ndcg, rank_and_ndcg, retrieval_report
from ccr.metrics.functional import mean_rank_variance


def make_set(num_images=10):
    gen = torch.Generator().manual_seed(0)
    image = torch.randn(num_images, 8, generator=gen)
    caption_image = torch.arange(num_images).repeat(2)
    text = image[caption_image] + torch.randn(2 * num_images, 8, generator=gen)
    return (
        image,
        text,
        caption_image,
        ["en"] * num_images + ["de"] * num_images,
        [str(i) for i in range(num_images)],
    )


def test_nan_image_embeddings_are_an_error_naming_the_counts():
    image, text, caption_image, languages, ids = make_set()
    image[2, 3] = float("nan")
    image[7] = float("nan")
    with pytest.raises(
        ValueError, match=r"non-finite embeddings: 2 of 10 images and 0 of 20 captions"
    ):
        retrieval_report(image, text, caption_image, languages, ids)


def test_collapsed_nan_model_is_an_error():
    image, text, caption_image, languages, ids = make_set()
    with pytest.raises(ValueError, match=r"10 of 10 images and 20 of 20 captions"):
        retrieval_report(
            torch.full_like(image, float("nan")),
            torch.full_like(text, float("inf")),
            caption_image,
            languages,
            ids,
        )


def test_non_finite_scores_are_an_error_naming_queries_and_candidates():
    scores = torch.randn(5, 7)
    scores[1, 2] = float("nan")
    scores[3, 2] = float("-inf")
    scores[3, 5] = float("inf")
    with pytest.raises(
        ValueError, match=r"t2i: non-finite scores in 2 of 5 queries and 2 of 7 candidates"
    ):
        rank_and_ndcg(
            None, None, torch.arange(5), torch.arange(7) % 5, scores=scores, direction="t2i"
        )


def test_non_finite_embeddings_in_rank_engine_and_graded_ndcg():
    query, candidate = torch.randn(4, 3), torch.randn(6, 3)
    candidate[0, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"i2t: non-finite embeddings in 0 of 4 queries and 1 of 6 candidates"
    ):
        rank_and_ndcg(query, candidate, torch.arange(4), torch.arange(6) % 4)
    relevance = torch.eye(6)
    with pytest.raises(
        ValueError,
        match=r"graded NDCG: non-finite embeddings in 1 of 6 queries and 1 of 6 candidates",
    ):
        graded_ndcg(
            candidate, candidate, torch.arange(6), torch.arange(6), relevance, exclude_self=True
        )


def test_non_finite_relevance_or_rank_is_an_error():
    emb = torch.eye(3)
    relevance = torch.eye(3)
    relevance[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"graded NDCG: 1 non-finite relevance value"):
        graded_ndcg(emb, emb, torch.arange(3), torch.arange(3), relevance)
    with pytest.raises(ValueError, match=r"MRV: 1 non-finite rank"):
        mean_rank_variance(
            torch.arange(2), torch.zeros(2, dtype=torch.long), torch.tensor([0.0, float("nan")]), 1
        )


def test_rank_engine_without_scores_or_embeddings_is_an_error_naming_the_direction():
    with pytest.raises(
        ValueError, match="t2i: give either scores or both query and candidate embeddings"
    ):
        rank_and_ndcg(
            torch.randn(4, 3), None, torch.arange(4), torch.arange(6) % 4, direction="t2i"
        )
