"""Tied scores: every metric is its expected value under uniform random tie-breaking.

The reference enumerates every tie-breaking order of a tiny score matrix (all permutations of the
candidates used as the secondary sort key), so it shares no code or formula with the suite.
"""

import itertools
import math
from fractions import Fraction
from statistics import median

import pytest
import torch

from ccr.metrics import best_positive_rank, rank_and_ndcg, retrieval_report
from ccr.metrics.functional import mean_rank, mean_reciprocal_rank, median_rank, recall_at_k


def enumerated_expectations(scores: torch.Tensor, positive: torch.Tensor, ks=(1, 2, 3, 5)):
    """Per query: exact mean over all tie-breaking orders of (hit@k for ks, 1/rank, rank), 1-based."""
    num_candidates = scores.shape[1]
    orders = list(itertools.permutations(range(num_candidates)))
    per_query = []
    for row, wanted in zip(scores.tolist(), positive.tolist(), strict=True):
        hits = {k: Fraction(0) for k in ks}
        reciprocal, rank_sum = Fraction(0), Fraction(0)
        for order in orders:  # order[c]: the tie-break key of candidate c
            ranked = sorted(range(num_candidates), key=lambda c: (-row[c], order[c]))
            rank = 1 + min(ranked.index(c) for c in range(num_candidates) if wanted[c])
            for k in ks:
                hits[k] += rank <= k
            reciprocal += Fraction(1, rank)
            rank_sum += rank
        count = len(orders)
        per_query.append(
            ({k: h / count for k, h in hits.items()}, reciprocal / count, rank_sum / count)
        )
    return per_query


def tied_matrix():
    """6 queries x 6 candidates, scores rounded to one decimal (many ties), 1-2 positives per query."""
    gen = torch.Generator().manual_seed(4)
    scores = (torch.rand(6, 6, generator=gen) * 0.4).round(decimals=1)
    candidate_group = torch.tensor([0, 1, 2, 3, 4, 0])  # query 0 has two positives
    query_group = torch.tensor([0, 1, 2, 3, 4, 2])
    return scores, query_group, candidate_group


def test_rounded_scores_give_the_expected_value_of_every_metric():
    scores, query_group, candidate_group = tied_matrix()
    positive = candidate_group[None, :] == query_group[:, None]
    expected = enumerated_expectations(scores, positive)
    ranks, _ = rank_and_ndcg(None, None, query_group, candidate_group, scores=scores)
    assert (scores[:, :, None] == scores[:, None, :]).sum() > 3 * scores.numel() // 2  # ties abound
    for k in (1, 2, 3, 5):
        want = 100 * sum(hit[k] for hit, _, _ in expected) / len(expected)
        assert recall_at_k(ranks, k) == pytest.approx(float(want), rel=1e-12)
    want_mrr = sum(r for _, r, _ in expected) / len(expected)
    want_mean = sum(m for _, _, m in expected) / len(expected)
    assert mean_reciprocal_rank(ranks) == pytest.approx(float(want_mrr), rel=1e-12)
    assert mean_rank(ranks) == pytest.approx(float(want_mean), rel=1e-12)
    assert median_rank(ranks) == math.floor(median(float(m) for _, _, m in expected))
    expected_rank = best_positive_rank(None, None, query_group, candidate_group, scores=scores)
    assert expected_rank.tolist() == pytest.approx(
        [float(m) - 1 for _, _, m in expected], rel=1e-12
    )


def chance_i2t_hit(num_captions: int, positives: int, k: int) -> Fraction:
    """P(some positive among the first k of a uniformly random order)."""
    miss = Fraction(math.comb(num_captions - k, positives), math.comb(num_captions, positives))
    return 1 - miss


def chance_reciprocal(num: int, positives: int) -> Fraction:
    """E[1 / (1-based position of the first positive)] in a uniformly random order."""
    total = math.comb(num, positives)
    return sum(
        Fraction(math.comb(num - r, positives - 1), total) / r
        for r in range(1, num - positives + 2)
    )


def discounts(k):
    return [1 / math.log2(p + 2) for p in range(k)]


@pytest.mark.parametrize("captions_per_image", [1, 3])
def test_constant_scorer_scores_exactly_chance(captions_per_image):
    num_images, k_ndcg = 20, 10
    image = torch.ones(num_images, 4)
    caption_image = torch.arange(num_images).repeat_interleave(captions_per_image)
    text = torch.ones(len(caption_image), 4)
    report = retrieval_report(
        image,
        text,
        caption_image,
        ["en"] * len(caption_image),
        [str(i) for i in range(num_images)],
        ndcg_k=k_ndcg,
    )
    num_captions = len(caption_image)
    for k in (1, 5, 10):
        assert report[f"en/t2i/R@{k}"] == pytest.approx(100 * k / num_images, rel=1e-12)
        want = 100 * float(chance_i2t_hit(num_captions, captions_per_image, k))
        assert report[f"en/i2t/R@{k}"] == pytest.approx(want, rel=1e-12)
    assert report["en/t2i/MeanR"] == pytest.approx((num_images + 1) / 2, rel=1e-12)
    i2t_mean = (num_captions + 1) / (captions_per_image + 1)  # first of p in a random order
    assert report["en/i2t/MeanR"] == pytest.approx(i2t_mean, rel=1e-12)
    assert report["en/t2i/MedR"] == math.floor((num_images + 1) / 2)
    assert report["en/i2t/MedR"] == math.floor(i2t_mean)
    assert report["en/t2i/MRR"] == pytest.approx(float(chance_reciprocal(num_images, 1)), rel=1e-12)
    want_mrr = float(chance_reciprocal(num_captions, captions_per_image))
    assert report["en/i2t/MRR"] == pytest.approx(want_mrr, rel=1e-12)
    # NDCG: each positive's expected discount is the mean over all positions
    mean_discount = sum(discounts(k_ndcg)) / num_images
    assert report[f"en/t2i/NDCG@{k_ndcg}"] == pytest.approx(mean_discount, rel=1e-12)
    ideal = sum(discounts(min(captions_per_image, k_ndcg)))
    want_ndcg = captions_per_image * sum(discounts(k_ndcg)) / num_captions / ideal
    assert report[f"en/i2t/NDCG@{k_ndcg}"] == pytest.approx(want_ndcg, rel=1e-12)


def test_albef_style_minus_100_fill_is_not_a_perfect_score():
    """Top-3 rescored, every other candidate -100 (ALBEF's itm_eval matrix): a positive outside the
    top 3 ties with the 47 others and hits the top 10 with probability 7/47."""
    gen = torch.Generator().manual_seed(0)
    num = 50
    raw = torch.randn(num, num, generator=gen)
    raw.fill_diagonal_(-5.0)  # every positive outside each row's top 3
    top = raw.topk(3, dim=1).indices
    scores = torch.full_like(raw, -100.0).scatter(1, top, raw.gather(1, top))
    ranks, _ = rank_and_ndcg(None, None, torch.arange(num), torch.arange(num), scores=scores)
    assert recall_at_k(ranks, 10) == pytest.approx(100 * 7 / 47, rel=1e-12)
    assert recall_at_k(ranks, 1) == 0.0
    assert mean_rank(ranks) == pytest.approx(3 + (47 + 1) / 2, rel=1e-12)


def test_median_rank_is_the_floor_of_the_median_of_1_based_ranks():
    ranks = torch.tensor([0, 1, 4, 9])  # 1-based 1, 2, 5, 10: median 3.5
    assert median_rank(ranks) == 3.0
    assert median_rank(torch.tensor([0, 3, 12, 1, 0])) == 2.0
