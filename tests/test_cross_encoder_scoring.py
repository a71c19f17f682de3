"""The shared cross-encoder evaluation path (ccr/methods/layers/cross_encoder_scoring.py): every pair and
each top k give exactly what scoring one pair at a time gives, whatever the chunk sizes, with calls
no larger than asked; and the metrics rank a score matrix as they rank the embeddings it came from."""

import pytest
import torch

from ccr import metrics
from ccr.methods.layers.cross_encoder_scoring import TopKRescorer, score_matrix, score_pairs

N_IMAGES, N_CAPTIONS = 7, 11


class CountingScorer:
    """A pair scorer whose score is an exact function of the two items (small integers, so no
    rounding anywhere); it records the size of every call it gets."""

    device = torch.device("cpu")

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.image_feat = torch.randint(-4, 5, (N_IMAGES, 3), generator=gen).float()
        self.caption_feat = torch.randint(-4, 5, (N_CAPTIONS, 3), generator=gen).float()
        self.blocks, self.calls = [], []

    def captions(self, index):
        self.blocks.append(len(index))
        return self.caption_feat[index] * 10 + index[:, None]  # the block carries its own rows

    def score(self, images, block, rows):
        self.calls.append(len(images))
        return (self.image_feat[images] * block[rows]).sum(1) + 0.5 * images

    def one_pair(self, image, caption):
        index = torch.tensor([caption])
        return self.score(torch.tensor([image]), self.captions(index), torch.tensor([0]))[0]


def naive_matrix(scorer):
    return torch.stack(
        [torch.stack([scorer.one_pair(i, c) for c in range(N_CAPTIONS)]) for i in range(N_IMAGES)]
    )


@pytest.mark.parametrize(
    "caption_chunk,pair_batch", [(1, 1), (3, 5), (4, 7), (11, 77), (100, 1000)]
)
def test_every_pair_equals_scoring_one_pair_at_a_time_whatever_the_chunks(
    caption_chunk, pair_batch
):
    scorer = CountingScorer()
    matrix = score_matrix(
        scorer, N_IMAGES, N_CAPTIONS, caption_chunk=caption_chunk, pair_batch=pair_batch
    )
    assert matrix.shape == (N_IMAGES, N_CAPTIONS) and matrix.dtype == torch.float32
    assert max(scorer.calls) <= pair_batch and max(scorer.blocks) <= caption_chunk
    assert sum(scorer.calls) == N_IMAGES * N_CAPTIONS  # each pair scored once
    assert torch.equal(matrix, naive_matrix(CountingScorer()))


@pytest.mark.parametrize("caption_chunk,pair_batch", [(1, 1), (2, 3), (50, 50)])
def test_top_k_rescoring_is_the_same_scorer_restricted_to_the_candidates(caption_chunk, pair_batch):
    scorer = CountingScorer()
    full = naive_matrix(CountingScorer())
    rescore = TopKRescorer(scorer, caption_chunk=caption_chunk, pair_batch=pair_batch)
    images, captions = torch.tensor([4, 0, 4]), torch.tensor([[10, 2, 2], [0, 5, 9], [1, 10, 3]])
    assert torch.equal(rescore("i2t", images, captions), full[images[:, None], captions])
    captions_q, images_c = torch.tensor([3, 3, 8]), torch.tensor([[6, 0], [1, 6], [2, 2]])
    assert torch.equal(rescore("t2i", captions_q, images_c), full[images_c, captions_q[:, None]])
    assert max(scorer.calls) <= pair_batch and max(scorer.blocks) <= caption_chunk


def test_chunk_sizes_below_one_are_an_error():
    with pytest.raises(ValueError, match="caption_chunk .0. and pair_batch .4. must be >= 1"):
        score_pairs(
            CountingScorer(), torch.tensor([0]), torch.tensor([0]), caption_chunk=0, pair_batch=4
        )


def test_the_metrics_rank_a_score_matrix_as_they_rank_the_embeddings_it_came_from():
    """Integer embeddings make their dot products exact, so the matrix is the embeddings' scores to
    the bit, ties included, and every reported value must agree."""
    gen = torch.Generator().manual_seed(1)
    image_emb = torch.randint(-2, 3, (6, 4), generator=gen).float()
    caption_image = torch.arange(6).repeat(2)
    text_emb = image_emb[caption_image] + torch.randint(-2, 3, (12, 4), generator=gen).float()
    languages, ids = ["en"] * 6 + ["de"] * 6, [str(i) for i in range(6)]
    from_embeddings = metrics.retrieval_report(
        image_emb, text_emb, caption_image, languages, ids, ks=(1, 3), chunk_size=4
    )
    from_matrix = metrics.retrieval_report(
        image_emb,
        text_emb,
        caption_image,
        languages,
        ids,
        ks=(1, 3),
        chunk_size=4,
        pair_scores=image_emb @ text_emb.T,
    )
    assert from_matrix == from_embeddings
    flipped = metrics.retrieval_report(
        image_emb,
        text_emb,
        caption_image,
        languages,
        ids,
        ks=(1, 3),
        chunk_size=4,
        pair_scores=-(image_emb @ text_emb.T),
    )
    assert (
        flipped["mR"] < from_embeddings["mR"]
    )  # the matrix, not the embeddings, is what is ranked


def test_a_score_matrix_of_the_wrong_shape_is_an_error():
    emb = torch.eye(3)
    with pytest.raises(ValueError, match=r"pair_scores has shape \(3, 2\), expected \(3, 3\)"):
        metrics.retrieval_report(
            emb, emb, torch.arange(3), ["en"] * 3, ["a", "b", "c"], pair_scores=torch.zeros(3, 2)
        )
