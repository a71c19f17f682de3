"""MRV (spec ccrk.md §4): worked example, identical languages, matching by id, dropped instances."""

import pytest
import torch

from metrics import MeanRankVariance, best_positive_rank, retrieval_report
from metrics.functional import mean_rank_variance

S_EN = torch.tensor([[0.9, 0.2, 0.1], [0.3, 0.8, 0.4], [0.5, 0.6, 0.7]])
S_DE = torch.tensor([[0.4, 0.6, 0.5], [0.7, 0.3, 0.2], [0.1, 0.2, 0.9]])


def worked_example_ranks():
    ids = torch.arange(3)
    tr = [best_positive_rank(None, None, ids, ids, scores=s) for s in (S_EN, S_DE)]
    ir = [best_positive_rank(None, None, ids, ids, scores=s.T.contiguous()) for s in (S_EN, S_DE)]
    return tr, ir


def test_worked_example_of_the_spec():
    tr, ir = worked_example_ranks()
    assert [r.tolist() for r in tr] == [[0, 0, 0], [2, 1, 0]]
    assert [r.tolist() for r in ir] == [[0, 0, 0], [1, 1, 0]]
    instance, language = torch.arange(3).repeat(2), torch.arange(2).repeat_interleave(3)
    tr_var, tr_std, dropped = mean_rank_variance(instance, language, torch.cat(tr), 2)
    ir_var, ir_std, _ = mean_rank_variance(instance, language, torch.cat(ir), 2)
    assert (tr_var, tr_std) == pytest.approx((0.416667, 0.5), abs=1e-6)
    assert (ir_var, ir_std) == pytest.approx((0.166667, 0.333333), abs=1e-6)
    assert dropped == 0


def test_report_reproduces_worked_example_from_embeddings():
    # embeddings whose dot products are exactly S: images = rows of S, captions = unit vectors
    images = torch.cat([S_EN, S_DE], 1)
    captions = torch.eye(6)
    caption_image = torch.tensor([0, 1, 2, 0, 1, 2])
    report = retrieval_report(images, captions, caption_image, ["en"] * 3 + ["de"] * 3, ["a", "b", "c"])
    assert report["all/MRV_var/i2t"] == pytest.approx(0.416667, abs=1e-6)
    assert report["all/MRV_std/i2t"] == pytest.approx(0.5, abs=1e-6)
    assert report["all/MRV_var/t2i"] == pytest.approx(0.166667, abs=1e-6)
    assert report["all/MRV_std/t2i"] == pytest.approx(0.333333, abs=1e-6)
    assert report["en/i2t/R@1"] == 100.0 and report["de/i2t/R@1"] == pytest.approx(100 / 3)
    assert report["en/t2i/R@1"] == 100.0 and report["de/t2i/R@1"] == pytest.approx(100 / 3)
    assert report["all/MRV_dropped"] == 0


def test_identical_languages_give_zero():
    ranks = torch.tensor([4, 0, 7, 2])
    instance, language = torch.arange(4).repeat(3), torch.arange(3).repeat_interleave(4)
    assert mean_rank_variance(instance, language, ranks.repeat(3), 3) == (0.0, 0.0, 0)


def test_matched_by_id_not_position_and_missing_language_dropped():
    instance = torch.tensor([10, 20, 30, 30, 10, 40])
    language = torch.tensor([0, 0, 0, 1, 1, 1])
    ranks = torch.tensor([1, 5, 2, 4, 3, 9])
    variance, std, dropped = mean_rank_variance(instance, language, ranks, 2)
    # instance 10: ranks (1, 3); 30: (2, 4); 20 and 40 miss a language
    assert (variance, std, dropped) == pytest.approx((1.0, 1.0, 2))
    shuffle = torch.tensor([5, 3, 0, 4, 1, 2])
    assert mean_rank_variance(instance[shuffle], language[shuffle], ranks[shuffle], 2) == (variance, std, dropped)


def test_repeated_instance_language_is_an_error():
    with pytest.raises(ValueError, match="instance 7 has two ranks for language 1"):
        mean_rank_variance(torch.tensor([7, 7]), torch.tensor([1, 1]), torch.tensor([0, 1]), 2)


def test_metric_class_accumulates_batches():
    tr, _ = worked_example_ranks()
    metric = MeanRankVariance(num_languages=2)
    metric.update(torch.tensor([2, 0]), torch.tensor([1, 0]), torch.tensor([tr[1][2], tr[0][0]]))
    metric.update(torch.tensor([0, 1, 1, 2]), torch.tensor([1, 0, 1, 0]),
                  torch.tensor([tr[1][0], tr[0][1], tr[1][1], tr[0][2]]))
    result = metric.compute()
    assert result["var"].item() == pytest.approx(0.416667, abs=1e-6)
    assert result["std"].item() == pytest.approx(0.5, abs=1e-6)
    assert result["dropped"].item() == 0
