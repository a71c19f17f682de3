"""The device rule of the losses, samplers and methods: every tensor they allocate takes its
device from their inputs.

No GPU is needed to check it. The default device is switched to ``meta`` while the inputs and
modules stay on the CPU, the mirror of a GPU run whose default device is the CPU: a factory call
without ``device=`` (or one followed by ``.to(...)``) then allocates on ``meta``, and mixing it
with the inputs raises, or its missing data changes the result. Every computation must therefore
give exactly the result of a normal run with the same seed.
"""

import pytest
import torch
import torch.nn.functional as F
from test_ccrk_module import build as build_ccrk
from test_ccrk_module import training_batch as ccrk_batch
from test_clip import _clip, _toy_batch
from test_mclip_method import build_mclip, image_batch
from test_mclip_stages import parallel_batch, stage_one

from ccr.methods.ccrk.hard_sampling import sample_hard_examples
from ccr.methods.ccrk.one_to_k import one_to_k_loss
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.layers.masking import mask_tokens


def same_with_meta_default(compute):
    """Run ``compute`` (seeded) normally and with the default device set to meta; both results
    must be CPU tensors, equal to the last bit."""
    torch.manual_seed(0)
    expected = compute()
    torch.manual_seed(0)
    with torch.device("meta"):
        got = compute()
    for name, (a, b) in zip(
        expected, zip(expected.values(), got.values(), strict=True), strict=True
    ):
        assert b.device.type == "cpu", name
        assert torch.equal(a, b), name


def features(rows, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen), dim=-1)


def test_info_nce_and_one_to_k_allocate_on_the_inputs_device():
    images, texts = features(4), features(12, seed=1)
    present = torch.ones(12, dtype=torch.bool)
    present[[1, 5]] = False
    tau = torch.tensor(0.07)
    same_with_meta_default(
        lambda: {
            "info_nce": info_nce(images, texts[:4], tau),
            "one_to_k": one_to_k_loss(images, texts, tau, present).total,
        }
    )


@pytest.mark.parametrize("mode", ["reference", "paper", "uniform"])
def test_hard_sampling_allocates_on_the_inputs_device(mode):
    images, texts = features(4), features(12, seed=1)

    def draw():
        samples = sample_hard_examples(images, texts, 0.07, mode)
        return {
            "positive": samples.positive_text,
            "negative_text": samples.negative_text,
            "negative_image": samples.negative_image,
        }

    same_with_meta_default(draw)


def test_masking_allocates_on_the_inputs_device():
    batch = ccrk_batch()
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]

    def masked():
        out = mask_tokens(ids, mask, mask_token_id=4, vocab_size=120, special_ids=(0, 1, 2))
        return {"input_ids": out.input_ids, "labels": out.labels}

    same_with_meta_default(masked)


def test_clip_training_step_allocates_on_the_inputs_device():
    module, batch = _clip(), _toy_batch(6)
    same_with_meta_default(lambda: {"loss": module.training_step(batch, 0)})


def test_ccrk_training_step_and_reranker_allocate_on_the_inputs_device():
    module, batch = build_ccrk(), ccrk_batch(absent=[(0, 1), (3, 2)])
    images, ids, mask = (
        batch["images"][:3],
        batch["input_ids"][:4, 0],
        batch["attention_mask"][:4, 0],
    )
    queries, candidates = torch.arange(3), torch.tensor([[0, 2], [1, 3], [3, 0]])

    def run():
        reranker = module.reranker(module.image_cache(images), module.text_cache(ids, mask))
        return {
            "loss": module.training_step(batch, 0),
            "rerank": reranker("i2t", queries, candidates),
        }

    same_with_meta_default(run)


# The teacher's text tower here is the suite's tiny encoder: with the world's XLM-R (Hugging Face)
# as that tower, one torch thread and a meta default device, the TriKD loss came out 1 ulp apart
# (1.2e-7); no tensor landed on meta, so the difference is a summation order inside that library's
# code, not an allocation of ours. Not traced further.
TINY_TEACHER_TEXT = {
    "teacher.clip.text_encoder.name": "tiny",
    "teacher.clip.text_encoder.width": 64,
    "teacher.clip.text_encoder.layers": 2,
    "teacher.clip.text_encoder.heads": 4,
}


def test_mclip_stages_allocate_on_the_inputs_device():
    trikd = build_mclip(**TINY_TEACHER_TEXT)
    batch = image_batch(6, ("en", "xx"))
    batch["present"][[0, 3], 1] = False
    nmt, ctl, text = stage_one(joint=False), stage_one(joint=True), parallel_batch()
    same_with_meta_default(
        lambda: {
            "trikd": trikd.training_step(batch, 0),
            "nmt": nmt.training_step(text, 0),
            "ctl": ctl.training_step(text, 0),
        }
    )
