"""The reference code's "dedup" image->text recall (spec §8-A16, §9 test 15), reported beside the
standard scores with ``method.recall_mode: dedup``."""

import pytest
import torch
from test_mclip_method import BASE, DATA, method_config

from ccr.methods.mclip.module import MCLIP
from ccr.metrics import GroundTruth, retrieval_report
from ccr.metrics.dedup import DedupRecallEvaluation, dedup_recall_report

KS = (1, 3, 5)


def hand_built():
    """Three one-hot images with two captions each. Image 0's captions rank 5th and 6th among the
    six captions (standard rank 4), but its image is the 3rd distinct one (dedup rank 2)."""
    images = torch.eye(3)
    first = [0.5, 0.4, 0.9, 0.8, 0.7, 0.6]  # scores against image 0: captions of 1, then 2, then 0
    texts = torch.zeros(6, 3)
    texts[:, 0] = torch.tensor(first)
    texts[2:4, 1] = 1.0
    texts[4:6, 2] = 1.0
    return images, texts, torch.tensor([0, 0, 1, 1, 2, 2]), ["en"] * 6


def scores(images, texts, owners, languages, ks=KS):
    report = retrieval_report(
        images, texts, owners, languages, [str(i) for i in range(len(images))], ks=ks
    )
    return report, dedup_recall_report(images, texts, owners, languages, report, ks=ks)


def test_hand_built_ranks_count_distinct_images():
    report, dedup = scores(*hand_built())
    assert [report[f"en/i2t/R@{k}"] for k in KS] == pytest.approx([200 / 3, 200 / 3, 100.0])
    assert [dedup[f"en/i2t_dedup/R@{k}"] for k in KS] == pytest.approx([200 / 3, 100.0, 100.0])
    t2i = [report[f"en/t2i/R@{k}"] for k in KS]
    assert dedup["en/mR_dedup"] == pytest.approx((200 / 3 + 100 + 100 + sum(t2i)) / 6)
    assert dedup["mR_dedup"] == dedup["en/mR_dedup"]


def random_set(captions_per_image, seed=0, images=30):
    g = torch.Generator().manual_seed(seed)
    owners = torch.arange(images).repeat_interleave(captions_per_image).repeat(2)
    languages = ["en"] * (images * captions_per_image) + ["de"] * (images * captions_per_image)
    return (
        torch.randn(images, 8, generator=g),
        torch.randn(len(owners), 8, generator=g),
        owners,
        languages,
    )


def test_dedup_is_never_below_the_standard_rule_and_equal_with_one_caption_per_image():
    report, dedup = scores(*random_set(5), ks=(1, 5, 10))
    gaps = [
        dedup[f"{lang}/i2t_dedup/R@{k}"] - report[f"{lang}/i2t/R@{k}"]
        for lang in ("en", "de")
        for k in (5, 10)
    ]
    assert min(gaps) >= 0 and max(gaps) > 0
    report, dedup = scores(*random_set(1), ks=(1, 5, 10))
    for lang in ("en", "de"):
        for k in (1, 5, 10):
            assert dedup[f"{lang}/i2t_dedup/R@{k}"] == pytest.approx(report[f"{lang}/i2t/R@{k}"])
        assert dedup[f"{lang}/mR_dedup"] == pytest.approx(report[f"{lang}/mR"])


def test_a_constant_model_scores_the_expected_value_of_a_random_order():
    images, texts, owners, languages = random_set(5, images=10)
    _, dedup = scores(
        torch.zeros_like(images), torch.zeros_like(texts), owners, languages, ks=(1, 5)
    )
    assert dedup["en/i2t_dedup/R@1"] == pytest.approx(10.0) and dedup[
        "en/i2t_dedup/R@5"
    ] == pytest.approx(50.0)


def test_non_finite_embeddings_are_an_error():
    images, texts, owners, languages = hand_built()
    texts[1, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        dedup_recall_report(images, texts, owners, languages, {}, ks=KS)


def test_mclip_reports_dedup_recall_beside_the_standard_scores_only_when_asked():
    images, texts, owners, languages = random_set(5)
    truth = GroundTruth(owners, languages, [str(i) for i in range(len(images))])
    module = MCLIP(method_config(recall_mode="dedup"), BASE.optim, DATA, BASE.evaluation)
    evaluation = module.new_evaluation(truth)
    assert isinstance(evaluation, DedupRecallEvaluation)
    plain = MCLIP(method_config(), BASE.optim, DATA, BASE.evaluation)
    assert not isinstance(plain.new_evaluation(truth), DedupRecallEvaluation)
    evaluation.update("images", torch.arange(len(images)), images)
    evaluation.update("captions", torch.arange(len(texts)), texts)
    report = evaluation.compute()
    standard, dedup = scores(images, texts, owners, languages, ks=tuple(BASE.evaluation.ks))
    assert {k: report[k] for k in standard} == pytest.approx(standard)
    assert {k: report[k] for k in dedup} == pytest.approx(dedup)
    with pytest.raises(ValueError, match="recall_mode 'paper'"):
        MCLIP(method_config(recall_mode="paper"), BASE.optim, DATA, BASE.evaluation)
