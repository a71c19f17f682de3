"""NDCG on hand-computed binary and graded cases, and agreement with torchmetrics."""

import math

import pytest
import torch
from torchmetrics.retrieval import RetrievalHitRate, RetrievalNormalizedDCG

from ccr.metrics import graded_ndcg, rank_and_ndcg
from ccr.metrics.functional import recall_at_k


def graded_from_scores(scores, relevance, k, gain="linear"):
    """Graded NDCG of a score matrix [Q, M] with a relevance per (query, candidate): each query and
    each candidate is its own item, and query_emb @ eye(M) reproduces the scores exactly."""
    num_queries, num_candidates = scores.shape
    items = torch.zeros(
        num_queries + num_candidates, num_queries + num_candidates, dtype=torch.float64
    )
    items[:num_queries, num_queries:] = relevance
    return graded_ndcg(
        scores,
        torch.eye(num_candidates),
        torch.arange(num_queries),
        num_queries + torch.arange(num_candidates),
        items,
        k=k,
        gain=gain,
    )


def test_binary_ndcg_hand_example_with_two_positives():
    # positives (captions 1 and 3) land at positions 1 and 3 of [c0, c1, c2, c3]
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6]])
    _, ndcg = rank_and_ndcg(
        None, None, torch.tensor([0]), torch.tensor([9, 0, 9, 0]), scores=scores, ndcg_k=10
    )
    expected = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    assert ndcg.item() == pytest.approx(expected, abs=1e-12)


def test_binary_ndcg_ties_are_averaged_and_cut_at_k():
    # the positive ties with two negatives at positions 1..3: mean discount over those positions
    scores = torch.tensor([[0.9, 0.5, 0.5, 0.5, 0.1]])
    _, ndcg = rank_and_ndcg(
        None, None, torch.tensor([0]), torch.tensor([1, 1, 0, 1, 1]), scores=scores, ndcg_k=10
    )
    expected = (1 / math.log2(3) + 1 / math.log2(4) + 1 / math.log2(5)) / 3
    assert ndcg.item() == pytest.approx(expected, abs=1e-12)
    # with k = 2 only position 1 of the block counts: 1/3 of its discount
    _, ndcg_k2 = rank_and_ndcg(
        None, None, torch.tensor([0]), torch.tensor([1, 1, 0, 1, 1]), scores=scores, ndcg_k=2
    )
    assert ndcg_k2.item() == pytest.approx((1 / math.log2(3)) / 3, abs=1e-12)


def test_graded_ndcg_hand_example_exponential_and_linear_gain():
    scores = torch.tensor([[0.9, 0.8, 0.7]])
    relevance = torch.tensor([[0.5, 1.0, 0.0]], dtype=torch.float64)
    exp_gain = torch.pow(2.0, relevance) - 1
    dcg = exp_gain[0, 0] + exp_gain[0, 1] / math.log2(3)
    ideal = exp_gain[0, 1] + exp_gain[0, 0] / math.log2(3)
    got = graded_from_scores(scores, relevance, k=10, gain="exponential")
    assert got.item() == pytest.approx((dcg / ideal).item(), abs=1e-12)
    linear = graded_from_scores(scores, relevance, k=10, gain="linear")
    assert linear.item() == pytest.approx(
        (0.5 + 1 / math.log2(3)) / (1 + 0.5 / math.log2(3)), abs=1e-12
    )


def test_graded_ndcg_excludes_self_and_zero_relevance_scores_zero():
    emb = torch.eye(3)
    relevance = torch.eye(3)  # only self is relevant, and self is excluded
    ndcg = graded_ndcg(
        emb, emb, torch.arange(3), torch.arange(3), relevance, k=10, exclude_self=True
    )
    assert ndcg.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("with_ties", [False, True])
def test_agrees_with_torchmetrics(with_ties):
    gen = torch.Generator().manual_seed(7)
    num_queries, num_candidates, k = 12, 30, 5
    scores = torch.randn(num_queries, num_candidates, generator=gen)
    if with_ties:
        scores = (scores * 2).round() / 2
    candidate_group = torch.randint(0, num_queries, (num_candidates,), generator=gen)
    candidate_group[:num_queries] = torch.arange(num_queries)  # every query has a positive
    ranks, ndcg = rank_and_ndcg(
        None, None, torch.arange(num_queries), candidate_group, scores=scores, ndcg_k=k
    )
    target = candidate_group[None, :] == torch.arange(num_queries)[:, None]
    indexes = torch.arange(num_queries)[:, None].expand_as(scores)
    tm_ndcg = RetrievalNormalizedDCG(top_k=k)(scores.flatten(), target.flatten(), indexes.flatten())
    assert ndcg.mean().item() == pytest.approx(tm_ndcg.item(), abs=1e-6)
    graded = graded_from_scores(scores, target.double(), k)
    assert graded.mean().item() == pytest.approx(tm_ndcg.item(), abs=1e-6)
    if not with_ties:  # torchmetrics' hit rate orders ties arbitrarily
        hit = RetrievalHitRate(top_k=k)(scores.flatten(), target.flatten(), indexes.flatten())
        assert recall_at_k(ranks, k) / 100 == pytest.approx(hit.item(), abs=1e-6)


def test_graded_agrees_with_torchmetrics_linear_gain():
    gen = torch.Generator().manual_seed(8)
    scores = (torch.randn(6, 20, generator=gen) * 2).round() / 2
    relevance = torch.randint(0, 4, (6, 20), generator=gen).double() / 3
    ours = graded_from_scores(scores, relevance, 10)
    indexes = torch.arange(6)[:, None].expand_as(scores)
    # torchmetrics takes integer or float relevance through `target`
    tm = RetrievalNormalizedDCG(top_k=10)(scores.flatten(), relevance.flatten(), indexes.flatten())
    assert ours.mean().item() == pytest.approx(tm.item(), abs=1e-6)
