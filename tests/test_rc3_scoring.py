"""The rc3 row's scorer is RC3's own ITM head over every candidate (spec §5: IGLUE scores every
(image, caption) pair of the test grid with the cross-encoder), through the evaluation a run takes
(Lightning's test loop, the base module's report): the first-stage probe, which is not part of
RC3, has no say in it."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ccr import metrics
from ccr.methods.rc3.module import VisualInput
from tests.rc3_helpers import IMAGE, LANGUAGES, build, captions

N_IMAGES = 10  # more than the probe+itm@8 protocol re-ranks: there the probe decides ranks 9-10
EVAL_LANGUAGES = LANGUAGES[:2]


class TinyTestSet(L.LightningDataModule):
    """N_IMAGES images with one caption per language (language-major), as the suite's loaders give
    them: an image loader and a caption loader (each caption with its language), in batches of 4."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.images = torch.randn(N_IMAGES, 3, IMAGE, IMAGE, generator=gen)
        self.ids, self.mask = captions(gen, N_IMAGES * len(EVAL_LANGUAGES))
        self.caption_image = torch.arange(N_IMAGES).repeat(len(EVAL_LANGUAGES))
        self.caption_language = [lang for lang in EVAL_LANGUAGES for _ in range(N_IMAGES)]

    def test_dataloader(self):
        images = [{"images": self.images[i], "index": torch.tensor(i)} for i in range(N_IMAGES)]
        texts = [
            {
                "input_ids": self.ids[i],
                "attention_mask": self.mask[i],
                "index": torch.tensor(i),
                "language": self.caption_language[i],
            }
            for i in range(len(self.ids))
        ]
        return [DataLoader(images, batch_size=4), DataLoader(texts, batch_size=4)]

    def eval_view(self, split):
        return SimpleNamespace(
            caption_image=self.caption_image,
            caption_language=self.caption_language,
            image_ids=[f"img{i}" for i in range(N_IMAGES)],
            relevance=torch.eye(N_IMAGES),
            mrv_languages=None,
        )


@pytest.fixture
def reported(monkeypatch):
    """The keyword arguments of every ``retrieval_report`` call evaluation makes."""
    calls, real = [], metrics.evaluation.retrieval_report

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics.evaluation, "retrieval_report", spy)
    return calls


def test_report(module, data):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.test(module.eval(), datamodule=data, verbose=False)
    return module.last_report


test_report.__test__ = False  # a helper, not a test


def head_on_each_pair(module, data):
    """The ITM logit of every (image, caption) pair, one pair per encoder call."""
    with torch.no_grad():
        visual = module.visual_tokens(data.images)
        rows = []
        for image in range(N_IMAGES):
            row = []
            for caption, language in enumerate(data.caption_language):
                length = int(data.mask[caption].sum())
                ids = module.tag(
                    data.ids[caption : caption + 1, :length],
                    data.mask[caption : caption + 1, :length],
                    language,
                )
                pooled = module.net.encode(
                    ids,
                    data.mask[caption : caption + 1, :length],
                    visual.tokens[image : image + 1],
                    visual.mask[image : image + 1],
                ).pooled
                row.append(module.itm_head(pooled)[0, 0])
            rows.append(torch.stack(row))
    return torch.stack(rows)


def test_rc3_ranks_every_candidate_by_its_own_itm_head(reported):
    module, data = build(), TinyTestSet()
    report = test_report(module, data)
    (call,) = reported
    scores = call["pair_scores"]
    assert scores.shape == (N_IMAGES, len(data.ids))  # every image against every caption
    assert call["reranker"] is None and call["rerank_k"] == 0
    # batched calls pad captions to their longest: the same pair can round ~1e-7 apart on CPU
    torch.testing.assert_close(scores, head_on_each_pair(module, data), rtol=0, atol=1e-5)
    for slot, lang in enumerate(EVAL_LANGUAGES):
        block = scores[
            :, slot * N_IMAGES : (slot + 1) * N_IMAGES
        ]  # [image, caption of this language]
        gold = block.diagonal()
        i2t_rank = (block > gold[:, None]).sum(1)
        t2i_rank = (block > gold[None, :]).sum(0)
        assert report[f"{lang}/i2t/R@1"] == pytest.approx(
            100 * (i2t_rank == 0).double().mean().item()
        )
        assert report[f"{lang}/t2i/MeanR"] == pytest.approx(t2i_rank.double().mean().item() + 1)


def test_the_probe_has_no_say_in_rc3s_scores():
    """Perturbing the first stage (the probe heads every ``probe``/``probe+itm@k`` row ranks by)
    leaves the rc3 row's report bit for bit; the same perturbation moves the probe's own row."""
    data = TinyTestSet()

    def reports(*overrides):
        module = build(*overrides)
        before = test_report(module, data)
        with torch.no_grad():
            for head in (module.probe_image, module.probe_text):
                for param in head.parameters():
                    param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
        return before, test_report(module, data)

    before, after = reports()
    assert before == after
    unimodal = ("i2i/", "t2t/")  # uni-modal NDCG ranks the embeddings, here the probe's
    assert not any(key.startswith(unimodal) for key in before)
    probe_before, probe_after = reports("evaluation.scorer=embeddings")
    assert probe_before != probe_after and any(key.startswith(unimodal) for key in probe_before)


def test_rc3_pair_scorer_scores_the_pairs_it_is_given():
    module, data = build().eval(), TinyTestSet()
    tagged = torch.stack(
        [
            module.tag(data.ids[c : c + 1], data.mask[c : c + 1], lang)[0]
            for c, lang in enumerate(data.caption_language)
        ]
    )
    with torch.no_grad():
        visual = module.visual_tokens(data.images)
        scorer = module.cross_encoder(
            {"tokens": visual.tokens, "mask": visual.mask},
            {"input_ids": tagged, "attention_mask": data.mask},
        )
        block = scorer.captions(torch.tensor([7, 2]))
        got = scorer.score(torch.tensor([5, 0, 5]), block, torch.tensor([0, 1, 1]))
        expected = module.match_logits(
            VisualInput(visual.tokens[[5, 0, 5]]), tagged[[7, 2, 2]], data.mask[[7, 2, 2]]
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
