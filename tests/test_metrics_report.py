"""retrieval_report: keys of docs/interfaces.md, re-ranking hook, graded keys, clear errors."""

import pytest
import torch

from ccr.metrics import retrieval_report
from ccr.metrics.functional import mean_rank, mean_reciprocal_rank, median_rank, recall_at_k

LANGS = ["en", "de"]


def make_set(num_images=40, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(num_images, dim, generator=gen)
    caption_image = torch.cat(
        [torch.arange(num_images).repeat_interleave(2), torch.arange(num_images)]
    )
    languages = ["en"] * (2 * num_images) + ["de"] * num_images
    text = image[caption_image] + 2.0 * torch.randn(len(caption_image), dim, generator=gen)
    return image, text, caption_image, languages, [f"id{i}" for i in range(num_images)]


def test_keys_follow_the_interface():
    report = retrieval_report(*make_set())
    expected = {
        f"{lang}/{d}/{m}"
        for lang in LANGS
        for d in ("i2t", "t2i")
        for m in ("R@1", "R@5", "R@10", "NDCG@10", "MRR", "MeanR", "MedR")
    }
    expected |= {f"{lang}/mR" for lang in LANGS} | {"mR", "mR_non_en", "all/MRV", "all/MRV_dropped"}
    expected |= {f"all/MRV_{r}/{d}" for r in ("var", "std") for d in ("i2t", "t2i")}
    assert set(report) == expected
    six = [report[f"en/{d}/R@{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10)]
    assert report["en/mR"] == pytest.approx(sum(six) / 6)
    assert report["mR"] == pytest.approx((report["en/mR"] + report["de/mR"]) / 2)
    assert report["mR_non_en"] == report["de/mR"]
    assert report["all/MRV"] == (report["all/MRV_std/i2t"] + report["all/MRV_std/t2i"]) / 2


def test_chunk_size_does_not_change_the_report():
    data = make_set()
    assert retrieval_report(*data, chunk_size=7) == retrieval_report(*data, chunk_size=1024)


def test_oracle_reranker_lifts_positives_in_top_k_and_keeps_the_rest():
    image, text, caption_image, languages, ids = make_set()
    calls = []

    def oracle(direction, query_index, candidate_index):
        calls.append(direction)
        if direction == "i2t":  # global caption indices: positive when the caption is the image's
            return (caption_image[candidate_index] == query_index[:, None]).float()
        return (candidate_index == caption_image[query_index][:, None]).float()

    plain = retrieval_report(image, text, caption_image, languages, ids)
    reranked = retrieval_report(
        image, text, caption_image, languages, ids, reranker=oracle, rerank_k=5
    )
    assert set(calls) == {"i2t", "t2i"}
    for lang in LANGS:
        for direction in ("i2t", "t2i"):
            # every positive within the top 5 moves to rank 0; the others stay where they were
            assert reranked[f"{lang}/{direction}/R@1"] == plain[f"{lang}/{direction}/R@5"]
            assert reranked[f"{lang}/{direction}/R@10"] == plain[f"{lang}/{direction}/R@10"]


def test_relevance_matrix_adds_unimodal_ndcg_at_each_cut_off_and_only_then():
    image, text, caption_image, languages, ids = make_set(num_images=12)
    relevance = torch.eye(12)
    relevance[0, 1] = relevance[1, 0] = 1.0
    plain = retrieval_report(image, text, caption_image, languages, ids)
    report = retrieval_report(image, text, caption_image, languages, ids, image_relevance=relevance)
    unimodal = {f"{side}/NDCG@{k}" for side in ("i2i", "t2t") for k in (10, 20, 50)}
    assert set(report) == set(plain) | unimodal  # the default cut-offs, and nothing else changes
    assert {key: report[key] for key in plain} == plain
    chosen = retrieval_report(
        image,
        text,
        caption_image,
        languages,
        ids,
        image_relevance=relevance,
        unimodal_ndcg_ks=[3, 7],
    )
    assert set(chosen) - set(plain) == {"i2i/NDCG@3", "t2t/NDCG@3", "i2i/NDCG@7", "t2t/NDCG@7"}


def test_bad_inputs_name_the_problem():
    image, text, caption_image, languages, ids = make_set(num_images=5)
    with pytest.raises(ValueError, match="caption 3 points to image 9 of 5"):
        bad = caption_image.clone()
        bad[3] = 9
        retrieval_report(image, text, bad, languages, ids)
    with pytest.raises(ValueError, match="image_ids are not unique"):
        retrieval_report(image, text, caption_image, languages, ["x"] * 5)
    with pytest.raises(ValueError, match="caption_language 14 entries"):
        retrieval_report(image, text, caption_image, languages[:-1], ids)


def test_rank_metrics_on_plain_ranks():
    ranks = torch.tensor([0, 3, 12, 1, 0])
    assert recall_at_k(ranks, 2) == pytest.approx(60.0)
    assert mean_reciprocal_rank(ranks) == pytest.approx((1 + 1 / 4 + 1 / 13 + 1 / 2 + 1) / 5)
    assert median_rank(ranks) == 2.0
    assert mean_rank(ranks) == pytest.approx(4.2)
