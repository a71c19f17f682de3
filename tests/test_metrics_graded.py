"""Graded NDCG from per-image relevance equals the dense reference (tests/reference_graded_ndcg.py)
on continuous scores, in the report too, and never modifies its inputs."""

import pytest
import torch

from metrics import graded_ndcg, retrieval_report
from reference_graded_ndcg import graded_ndcg as dense_graded_ndcg


def graded_world(num_images=30, captions_per_image=3, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(num_images, dim, generator=gen), dim=1)
    caption_image = torch.arange(num_images).repeat(captions_per_image)
    caption_image = caption_image[torch.randperm(len(caption_image), generator=gen)]
    text = torch.nn.functional.normalize(image[caption_image] + torch.randn(len(caption_image), dim, generator=gen), dim=1)
    relevance = (torch.rand(num_images, num_images, generator=gen) * 4).floor() / 4  # graded, many zeros
    relevance = torch.maximum(relevance, relevance.T)
    relevance.fill_diagonal_(1.0)
    return image, text, caption_image, relevance


@pytest.mark.parametrize("gain", ["exponential", "linear"])
@pytest.mark.parametrize("k", [5, 10, 200])
def test_per_image_relevance_equals_the_dense_reference(gain, k):
    image, text, caption_image, relevance = graded_world()
    images = torch.arange(len(image))
    for query, items in ((image, images), (text, caption_image)):
        dense = dense_graded_ndcg(query, query, lambda a, b: relevance[items[a:b]][:, items],
                                  k=k, exclude_self=True, gain=gain, chunk_size=16)
        fast = graded_ndcg(query, query, items, items, relevance, k=k, exclude_self=True, gain=gain,
                           chunk_size=16)
        assert torch.equal(fast, dense)
    cross = dense_graded_ndcg(text, image, lambda a, b: relevance[caption_image[a:b]], k=k, gain=gain)
    assert torch.equal(graded_ndcg(text, image, caption_image, images, relevance, k=k, gain=gain), cross)


def test_report_keys_equal_the_dense_reference():
    image, text, caption_image, relevance = graded_world(num_images=40, captions_per_image=2)
    languages = ["en"] * 40 + ["de"] * 40
    caption_image = torch.arange(40).repeat(2)
    report = retrieval_report(image, text, caption_image, languages, [str(i) for i in range(40)],
                              image_relevance=relevance, chunk_size=16)
    i2i = dense_graded_ndcg(image, image, lambda a, b: relevance[a:b], exclude_self=True, chunk_size=16)
    t2t = dense_graded_ndcg(text, text, lambda a, b: relevance[caption_image[a:b]][:, caption_image],
                            exclude_self=True, chunk_size=16)
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
    for tensor, copy in zip(inputs, before):
        assert torch.equal(tensor, copy)


def test_negative_relevance_is_an_error():
    relevance = torch.eye(3)
    relevance[0, 1] = -0.5
    items = torch.arange(3)
    with pytest.raises(ValueError, match="graded NDCG: 1 negative relevance value"):
        graded_ndcg(torch.eye(3), torch.eye(3), items, items, relevance)
