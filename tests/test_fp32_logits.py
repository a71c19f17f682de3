"""Similarity logits are fp32 under bf16 autocast: every contrastive and sampling similarity goes
through ``similarity_logits``, so each loss under autocast equals its fp32 computation."""

import torch
import torch.nn.functional as F

from ccr.methods.ccrk.hard_sampling import sampling_weights
from ccr.methods.ccrk.one_to_k import one_to_k_loss
from ccr.methods.layers.contrastive import info_nce, similarity_logits
from ccr.methods.mclip.distillation import trikd_loss
from ccr.methods.mclip.translation import contrastive_translation_loss

TAU = 0.07  # logits up to 1 / 0.07 ≈ 14, where a bf16 product resolves only about 0.06
FP32 = {"rtol": 1e-6, "atol": 1e-5}


def unit_rows(rows, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen), dim=-1)


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_logits_are_fp32_and_equal_the_fp32_product_under_bf16_autocast():
    queries, keys = unit_rows(16), unit_rows(24, seed=1)
    queries[:, :] = F.normalize(queries + keys[:16], dim=-1)  # large positive logits
    expected = queries @ keys.t() / TAU
    with bf16_autocast():
        logits = similarity_logits(queries, keys, torch.tensor(TAU))
        bf16_product = queries @ keys.t() / TAU
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, **FP32)
    # what the test guards against: the autocast product is off by far more than fp32 rounding
    assert bf16_product.dtype == torch.bfloat16
    assert (bf16_product.float() - expected).abs().max() > 1e-2


def test_float64_features_keep_float64():
    queries = unit_rows(3).double()
    assert similarity_logits(queries, queries, TAU).dtype == torch.float64


def same_under_autocast(compute):
    expected = compute()
    with bf16_autocast():
        got = compute()
    for a, b in zip(expected, got, strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, **FP32)


def test_info_nce_under_autocast_equals_fp32():
    images, texts = unit_rows(12), unit_rows(12, seed=1)
    same_under_autocast(lambda: [info_nce(images, texts, torch.tensor(TAU))])


def test_one_to_k_under_autocast_equals_fp32():
    images, texts = unit_rows(6), unit_rows(18, seed=1)
    present = torch.ones(18, dtype=torch.bool)
    present[[2, 7]] = False

    def terms():
        out = one_to_k_loss(images, texts, torch.tensor(TAU), present)
        return [out.i2t, out.t2i]

    same_under_autocast(terms)


def test_hard_sampling_weights_under_autocast_equal_fp32():
    images, texts = unit_rows(6), unit_rows(18, seed=1)
    for mode in ("reference", "paper"):

        def weights(mode=mode):
            out = sampling_weights(images, texts, torch.tensor(TAU), mode)
            return [out.positive, out.negative_text, out.negative_image]

        same_under_autocast(weights)


def test_mclip_losses_under_autocast_equal_fp32():
    images, students, teachers = unit_rows(8), unit_rows(8, seed=1), unit_rows(8, seed=2)
    gen = torch.Generator().manual_seed(3)
    src, tgt = torch.randn(8, 5, 64, generator=gen), torch.randn(8, 6, 64, generator=gen)
    src_mask, tgt_mask = torch.ones(8, 5, dtype=torch.long), torch.ones(8, 6, dtype=torch.long)
    logit_scale = torch.tensor(4.0)

    def losses():
        trikd = trikd_loss(images, students, logit_scale, teachers)
        return [
            trikd.itc,
            trikd.ttc,
            contrastive_translation_loss(src, src_mask, tgt, tgt_mask, 0.1),
        ]

    same_under_autocast(losses)
