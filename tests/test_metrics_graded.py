"""Graded NDCG from per-image relevance equals the dense reference (tests/reference_graded_ndcg.py)
on continuous and on tied scores, in the report too at every uni-modal cut-off, each cut-off scores
its own hand-computed value, and the inputs are never modified."""

import math

import pytest
import torch
from reference_graded_ndcg import graded_ndcg as dense_graded_ndcg

from ccr.metrics import graded_ndcg, graded_ndcg_at, retrieval_report


def graded_world(num_images=30, captions_per_image=3, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(num_images, dim, generator=gen), dim=1)
    caption_image = torch.arange(num_images).repeat(captions_per_image)
    caption_image = caption_image[torch.randperm(len(caption_image), generator=gen)]
    text = torch.nn.functional.normalize(
        image[caption_image] + torch.randn(len(caption_image), dim, generator=gen), dim=1
    )
    relevance = (
        torch.rand(num_images, num_images, generator=gen) * 4
    ).floor() / 4  # graded, many zeros
    relevance = torch.maximum(relevance, relevance.T)
    relevance.fill_diagonal_(1.0)
    return image, text, caption_image, relevance


@pytest.mark.parametrize("gain", ["exponential", "linear"])
@pytest.mark.parametrize("k", [5, 10, 200])
def test_per_image_relevance_equals_the_dense_reference(gain, k):
    image, text, caption_image, relevance = graded_world()
    images = torch.arange(len(image))
    for query, items in ((image, images), (text, caption_image)):
        dense = dense_graded_ndcg(
            query,
            query,
            lambda a, b, items=items: relevance[items[a:b]][:, items],
            k=k,
            exclude_self=True,
            gain=gain,
            chunk_size=16,
        )
        fast = graded_ndcg(
            query, query, items, items, relevance, k=k, exclude_self=True, gain=gain, chunk_size=16
        )
        assert torch.equal(fast, dense)
    cross = dense_graded_ndcg(
        text, image, lambda a, b: relevance[caption_image[a:b]], k=k, gain=gain
    )
    assert torch.equal(
        graded_ndcg(text, image, caption_image, images, relevance, k=k, gain=gain), cross
    )


def test_report_keys_equal_the_dense_reference():
    image, text, caption_image, relevance = graded_world(num_images=40, captions_per_image=2)
    languages = ["en"] * 40 + ["de"] * 40
    caption_image = torch.arange(40).repeat(2)
    report = retrieval_report(
        image,
        text,
        caption_image,
        languages,
        [str(i) for i in range(40)],
        image_relevance=relevance,
        chunk_size=16,
    )
    i2i = dense_graded_ndcg(
        image, image, lambda a, b: relevance[a:b], exclude_self=True, chunk_size=16
    )
    t2t = dense_graded_ndcg(
        text,
        text,
        lambda a, b: relevance[caption_image[a:b]][:, caption_image],
        exclude_self=True,
        chunk_size=16,
    )
    assert report["i2i/NDCG@10"] == i2i.mean().item()
    assert report["t2t/NDCG@10"] == t2t.mean().item()


@pytest.mark.parametrize("gain", ["exponential", "linear"])
def test_inputs_are_never_modified(gain):
    image, text, caption_image, relevance = graded_world()
    relevance = relevance.double()  # float64: a linear gain could alias it
    inputs = (image, text, caption_image, relevance)
    before = [tensor.clone() for tensor in inputs]
    items = torch.arange(len(image))
    graded_ndcg(image, image, items, items, relevance, exclude_self=True, gain=gain)
    graded_ndcg(text, text, caption_image, caption_image, relevance, exclude_self=True, gain=gain)
    for tensor, copy in zip(inputs, before, strict=True):
        assert torch.equal(tensor, copy)


def test_negative_relevance_is_an_error():
    relevance = torch.eye(3)
    relevance[0, 1] = -0.5
    items = torch.arange(3)
    with pytest.raises(ValueError, match="graded NDCG: 1 negative relevance value"):
        graded_ndcg(torch.eye(3), torch.eye(3), items, items, relevance)


def tied_graded_world(num_images=36, captions_per_image=2, seed=3):
    """Embeddings on a coarse grid, so many scores tie (also across the k-th position), with
    graded relevance that ties too; captions of every image in two languages."""
    image, text, _, relevance = graded_world(num_images, captions_per_image, dim=4, seed=seed)
    caption_image = torch.arange(num_images).repeat(captions_per_image)
    text = torch.nn.functional.normalize(image[caption_image] + 0.5 * text, dim=1)
    return (image * 2).round() / 2, (text * 2).round() / 2, caption_image, relevance


@pytest.mark.parametrize("k", [20, 50])
def test_report_at_20_and_50_equals_the_dense_reference_with_ties(k):
    image, text, caption_image, relevance = tied_graded_world()
    scores = image @ image.T
    assert len(torch.unique(scores)) < scores.numel() // 8  # the data does tie, heavily
    languages = ["en"] * 36 + ["de"] * 36
    report = retrieval_report(
        image,
        text,
        caption_image,
        languages,
        [str(i) for i in range(36)],
        image_relevance=relevance,
        unimodal_ndcg_ks=(10, 20, 50),
        chunk_size=16,
    )
    i2i = dense_graded_ndcg(
        image, image, lambda a, b: relevance[a:b], k=k, exclude_self=True, chunk_size=16
    )
    t2t = dense_graded_ndcg(
        text,
        text,
        lambda a, b: relevance[caption_image[a:b]][:, caption_image],
        k=k,
        exclude_self=True,
        chunk_size=16,
    )
    assert report[f"i2i/NDCG@{k}"] == pytest.approx(i2i.mean().item(), rel=0, abs=1e-15)
    assert report[f"t2t/NDCG@{k}"] == pytest.approx(t2t.mean().item(), rel=0, abs=1e-15)


def test_every_cut_off_of_one_pass_equals_its_own_pass():
    image, text, caption_image, relevance = tied_graded_world()
    together = graded_ndcg_at(
        text,
        text,
        caption_image,
        caption_image,
        relevance,
        ks=(50, 10, 20),
        exclude_self=True,
        chunk_size=16,
    )
    assert list(together) == [50, 10, 20]
    for k, values in together.items():
        alone = graded_ndcg(
            text,
            text,
            caption_image,
            caption_image,
            relevance,
            k=k,
            exclude_self=True,
            chunk_size=16,
        )
        # tied items may be summed in another order: equal up to the last bit of a float64 sum
        assert torch.allclose(values, alone, rtol=0, atol=1e-15)


def test_each_cut_off_scores_its_own_hand_computed_value():
    """Four images on a line; only image 0 has relevant neighbours: image 1 (rel 0, scored
    highest), image 2 (rel 1) and image 3 (rel 0.5, scored lowest). Captions equal their images,
    so t2t gives the same values. Images 1-3 have no relevant candidate and score 0."""
    image = torch.tensor([[1.0], [3.0], [2.0], [1.0]])
    relevance = torch.eye(4)
    relevance[0, 2], relevance[0, 3] = 1.0, 0.5
    half = 2**0.5 - 1  # exponential gain of relevance 0.5
    discount = [1.0, 1 / math.log2(3), 0.5]
    expected = {  # DCG@k / IDCG@k of query 0, averaged over the four queries
        1: (0.0 / 1.0) / 4,
        2: (discount[1]) / (1.0 + half * discount[1]) / 4,
        3: (discount[1] + half * discount[2]) / (1.0 + half * discount[1]) / 4,
    }
    report = retrieval_report(
        image,
        image,
        torch.arange(4),
        ["en"] * 4,
        ["a", "b", "c", "d"],
        image_relevance=relevance,
        unimodal_ndcg_ks=(1, 2, 3),
    )
    for k, value in expected.items():
        assert report[f"i2i/NDCG@{k}"] == pytest.approx(value, abs=1e-12)
        assert report[f"t2t/NDCG@{k}"] == pytest.approx(value, abs=1e-12)
    assert len({report[f"i2i/NDCG@{k}"] for k in expected}) == 3


@pytest.mark.parametrize("ks", [(), (0, 10), (2.5,)])
def test_bad_cut_offs_are_an_error(ks):
    items = torch.arange(3)
    with pytest.raises(ValueError, match="cut-offs must be a non-empty list of integers >= 1"):
        graded_ndcg_at(torch.eye(3), torch.eye(3), items, items, torch.eye(3), ks=ks)
