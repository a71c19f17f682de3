"""ITM re-ranking raises recall when the ITM head knows the answer, in both directions, through the
evaluation path a run takes (RetrievalEvaluation fed in shuffled order, CCRk's reranker, the
metrics' top-k lift): re-ranking can only hurt where the head is wrong, never by its plumbing."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ccr import metrics
from ccr.methods.layers.encoders import TextOutput
from tests.test_ccrk_module import build

N, LANGUAGES, FIRST_TOKEN = 8, ("en", "de"), 10
GOLD, NEAR_MISS, OTHER = (
    40.0,
    30.0,
    -10.0,
)  # match logits; both 40 and 30 give probability 1.0 in float32


class KnowingHead(nn.Module):
    """An ITM head that reads the caption's and the image's identity from the fused token: the gold
    pair scores GOLD, the image after the caption's (a look-alike, as in a world of shared
    attributes) NEAR_MISS, every other pair OTHER."""

    def forward(self, fused):
        caption, image = fused[:, :N].argmax(1), fused[:, N:].argmax(1)
        match = torch.full_like(caption, OTHER, dtype=torch.float32)
        match[image == (caption + 1) % N] = NEAR_MISS
        match[image == caption] = GOLD
        return torch.stack([torch.zeros_like(match), match], 1)


def knowing_module(monkeypatch, score):
    """A tiny CCRk whose encoders pass identities through, with ``KnowingHead`` as its ITM head."""
    module = build(rerank_score=score).eval()
    module.eval_cfg.pair_batch_size = 7
    monkeypatch.setattr(
        module, "image_encoder", nn.Identity()
    )  # "images" are one-hot ids [N, 1, N]
    monkeypatch.setattr(
        module,
        "encode_captions",
        lambda ids, mask: TextOutput(
            states=F.one_hot(ids[:, 1] - FIRST_TOKEN, N).float()[:, None, :],
            pooled=None,
            mask=mask.bool(),
        ),
    )
    monkeypatch.setattr(
        module, "fuse", lambda text, mask, image: torch.cat([text[:, :1], image[:, :1]], -1)
    )
    monkeypatch.setattr(module, "itm_head", KnowingHead())
    return module


def evaluate(module, rerank_k):
    """Report of N images with one caption per language, encoded in a shuffled order. The dual
    encoder is noisy: the gold item is often not first, but always within the top 3."""
    gen = torch.Generator().manual_seed(3)
    images = torch.eye(N)[:, None, :]
    caption_image = torch.arange(N).repeat(len(LANGUAGES))
    ids = torch.stack([torch.full((4,), FIRST_TOKEN) for _ in caption_image])
    ids[:, 1] += caption_image
    mask = torch.ones_like(ids)
    image_emb = F.normalize(torch.eye(N) + 0.35 * torch.randn(N, N, generator=gen), dim=1)
    text_emb = F.normalize(
        image_emb[caption_image] + 0.35 * torch.randn(len(caption_image), N, generator=gen), dim=1
    )
    truth = metrics.GroundTruth(
        caption_image=caption_image,
        caption_language=[lang for lang in LANGUAGES for _ in range(N)],
        image_ids=[str(i) for i in range(N)],
    )
    evaluation = metrics.RetrievalEvaluation(
        truth,
        ks=(1, 3),
        ndcg_k=3,
        unimodal_ndcg_ks=(3,),
        chunk_size=5,
        rerank_k=rerank_k,
        build_reranker=module.reranker,
    )
    for order, side, emb in (
        (torch.randperm(N, generator=gen), "images", image_emb),
        (torch.randperm(len(ids), generator=gen), "captions", text_emb),
    ):
        for part in order.chunk(3):
            cache = (
                module.image_cache(images[part])
                if side == "images"
                else module.text_cache(ids[part], mask[part])
            )
            evaluation.update(side, part, emb[part], cache if rerank_k else None)
    return evaluation.compute()


@pytest.mark.parametrize("rerank_k", [3, 16])
@pytest.mark.parametrize("score", ["prob", "logit"])
def test_reranking_with_a_head_that_knows_the_answer_raises_recall_both_ways(
    monkeypatch, score, rerank_k
):
    module = knowing_module(monkeypatch, score)
    itc, itm = evaluate(module, 0), evaluate(module, rerank_k)
    for lang in LANGUAGES:
        for direction in ("i2t", "t2i"):
            key = f"{lang}/{direction}"
            assert (
                itc[f"{key}/R@3"] == 100.0
            )  # the gold is in every top 3: a right head can fix every query
            assert itc[f"{key}/R@1"] < 100.0, key  # and the dual encoder leaves something to fix
            assert itm[f"{key}/R@1"] == 100.0, key
            assert itm[f"{key}/MeanR"] == 1.0, key
    assert itm["mR"] == 100.0 > itc["mR"]
