"""MRV (spec ccrk.md §4): worked example, identical languages, matching by id, dropped instances."""

import pytest
import torch

from ccr.metrics import best_positive_rank, retrieval_report
from ccr.metrics.functional import mean_rank_variance

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
    report = retrieval_report(
        images, captions, caption_image, ["en"] * 3 + ["de"] * 3, ["a", "b", "c"]
    )
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
    assert mean_rank_variance(instance[shuffle], language[shuffle], ranks[shuffle], 2) == (
        variance,
        std,
        dropped,
    )


def test_repeated_instance_language_is_an_error():
    with pytest.raises(ValueError, match="instance 7 has two ranks for language 1"):
        mean_rank_variance(torch.tensor([7, 7]), torch.tensor([1, 1]), torch.tensor([0, 1]), 2)


def three_language_set(num_images=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(num_images, 6, generator=gen)
    caption_image = torch.arange(num_images).repeat(3)[:-1]  # the last image has no "ja" caption
    languages = ["en"] * num_images + ["de"] * num_images + ["ja"] * (num_images - 1)
    text = image[caption_image] + 1.5 * torch.randn(len(caption_image), 6, generator=gen)
    return image, text, caption_image, languages, [str(i) for i in range(num_images)]


def test_mrv_over_a_language_subset_equals_mrv_of_those_languages_alone():
    image, text, caption_image, languages, ids = three_language_set()
    subset = retrieval_report(
        image, text, caption_image, languages, ids, mrv_languages=["en", "de"]
    )
    keep = [i for i, lang in enumerate(languages) if lang in ("en", "de")]
    alone = retrieval_report(
        image, text[keep], caption_image[keep], [languages[i] for i in keep], ids
    )
    everything = retrieval_report(image, text, caption_image, languages, ids)
    mrv_keys = [key for key in alone if key.startswith("all/")]
    assert {key: subset[key] for key in mrv_keys} == {key: alone[key] for key in mrv_keys}
    assert subset["all/MRV_dropped"] == 0 and everything["all/MRV_dropped"] == 1
    assert subset["all/MRV"] != everything["all/MRV"]
    assert subset["ja/mR"] == everything["ja/mR"]  # only MRV is restricted


def test_mrv_languages_must_be_evaluated_languages():
    image, text, caption_image, languages, ids = three_language_set()
    with pytest.raises(
        ValueError, match=r"mrv_languages \['en', 'zh'\] must be a non-empty subset"
    ):
        retrieval_report(image, text, caption_image, languages, ids, mrv_languages=["en", "zh"])


def test_mrv_over_one_language_is_zero():
    image, text, caption_image, languages, ids = three_language_set()
    report = retrieval_report(image, text, caption_image, languages, ids, mrv_languages=["de"])
    assert [report[f"all/MRV_{r}/{d}"] for r in ("var", "std") for d in ("i2t", "t2i")] == [0.0] * 4
    assert report["all/MRV"] == 0.0
