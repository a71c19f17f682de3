"""Closed-form checks of mCLIP's losses (spec §9 tests 5-9, 12, 13)."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ccr.methods.layers.contrastive import info_nce
from ccr.methods.mclip.distillation import clamped_logit_scale, fixed_ttc_temperature, trikd_loss
from ccr.methods.mclip.translation import (
    TranslationDecoder,
    contrastive_translation_loss,
    masked_mean,
    translation_nll,
)


def one_direction(x, y, scale):
    logits = scale * x @ y.T
    return F.cross_entropy(logits, torch.arange(len(x)))


def numpy_info_nce(x, y, tau):
    s = x @ y.T / tau
    log_softmax = s - np.log(np.exp(s).sum(1, keepdims=True))
    return -np.mean(np.diag(log_softmax))


@pytest.mark.parametrize("n,tau", [(2, 1.0), (4, 0.5), (8, 0.25)])
def test_identical_orthonormal_embeddings_give_closed_form(n, tau):
    x = torch.eye(n, dtype=torch.float64)
    expected = math.log(1 + (n - 1) * math.exp(-1 / tau))
    assert info_nce(x, x, tau).item() == pytest.approx(expected, rel=1e-6)


def test_two_by_two_closed_form_value():
    assert info_nce(torch.eye(2), torch.eye(2), 1.0).item() == pytest.approx(0.313262, abs=1e-6)


def test_asymmetric_pair_matches_numpy_and_symmetrises():
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    y = np.array([[0.6, 0.8], [0.0, 1.0]])
    xt, yt = torch.tensor(x), torch.tensor(y)
    assert one_direction(xt, yt, 1.0).item() == pytest.approx(numpy_info_nce(x, y, 1.0), abs=1e-6)
    both = 0.5 * (numpy_info_nce(x, y, 1.0) + numpy_info_nce(y, x, 1.0))
    assert info_nce(xt, yt, 1.0).item() == pytest.approx(both, abs=1e-6)
    assert numpy_info_nce(x, y, 1.0) != pytest.approx(numpy_info_nce(y, x, 1.0))


def test_true_pairing_beats_every_shuffled_pairing():
    x = torch.eye(4)
    true_loss = info_nce(x, x, 0.07)
    for order in itertools.permutations(range(4)):
        if list(order) != [0, 1, 2, 3]:
            assert info_nce(x, x[list(order)], 0.07) > true_loss


def test_loss_vanishes_as_temperature_goes_to_zero_with_strict_diagonal_maximum():
    torch.manual_seed(0)
    x = F.normalize(torch.randn(5, 8), dim=-1)
    y = F.normalize(x + 0.05 * torch.randn(5, 8), dim=-1)
    sims = x @ y.T
    assert torch.all(sims.diag() > sims.masked_fill(torch.eye(5, dtype=torch.bool), -2).amax(1))
    losses = [info_nce(x, y, tau).item() for tau in (1.0, 0.1, 1e-3)]
    assert losses[0] > losses[1] > losses[2] and losses[2] < 1e-6


def test_logit_scale_is_clamped_at_one_hundred():
    assert clamped_logit_scale(torch.tensor(10.0)).item() == 100.0
    assert clamped_logit_scale(torch.tensor(math.log(1 / 0.07))).item() == pytest.approx(1 / 0.07)


def test_ttc_temperature_modes():
    assert fixed_ttc_temperature(0.07) == 0.07
    assert 1 / fixed_ttc_temperature(0.07, "reference") == pytest.approx(2.65926, abs=1e-5)
    with pytest.raises(ValueError, match="ttc_scale_mode"):
        fixed_ttc_temperature(0.07, "other")


def random_unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_trikd_english_is_itc_plus_a_tenth_of_ttc():
    h_i, h_t, h_x = random_unit(6, 16, 1), random_unit(6, 16, 2), random_unit(6, 16, 3)
    scale = torch.tensor(math.log(1 / 0.07))
    loss = trikd_loss(h_i, h_x, scale, h_t)
    itc = 0.5 * (one_direction(h_i, h_x, 1 / 0.07) + one_direction(h_x, h_i, 1 / 0.07))
    ttc = 0.5 * (one_direction(h_t, h_x, 1 / 0.07) + one_direction(h_x, h_t, 1 / 0.07))
    assert loss.total.item() == pytest.approx((itc + 0.1 * ttc).item(), rel=1e-5)
    assert loss.ttc.item() == pytest.approx(ttc.item(), rel=1e-5)


def test_trikd_without_teacher_text_is_itc_only():
    h_i, h_x = random_unit(6, 16, 1), random_unit(6, 16, 3)
    loss = trikd_loss(h_i, h_x, torch.tensor(2.0))
    assert loss.ttc is None
    assert loss.total.item() == pytest.approx(info_nce(h_i, h_x, math.exp(-2.0)).item())


def test_ttc_backward_leaves_the_logit_scale_without_gradient():
    scale = torch.nn.Parameter(torch.tensor(2.0))
    h_t = random_unit(4, 8, 4)
    h_x = random_unit(4, 8, 5).requires_grad_()
    trikd_loss(h_t, h_x, scale, h_t).ttc.backward()
    assert scale.grad is None and h_x.grad.abs().sum() > 0


def test_nmt_loss_equals_hand_sum_over_non_pad_targets():
    pad = 1
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    gold = torch.tensor([[3, 4, 2], [4, 2, pad]])  # |y|=2 (+ </s>), then |y|=1 (+ </s>) and a pad
    log_p = logits.log_softmax(-1)
    hand = -(log_p[0, 0, 3] + log_p[0, 1, 4] + log_p[0, 2, 2] + log_p[1, 0, 4] + log_p[1, 1, 2]) / 2
    assert translation_nll(logits, gold, pad).item() == pytest.approx(hand.item(), rel=1e-6)
    changed = logits.clone()
    changed[1, 2] = 100 * torch.randn(5)
    assert translation_nll(changed, gold, pad).item() == pytest.approx(hand.item(), rel=1e-6)


def test_label_smoothing_mixes_in_the_uniform_target():
    logits = torch.randn(1, 2, 5, generator=torch.Generator().manual_seed(1))
    gold = torch.tensor([[3, 2]])
    log_p = logits.log_softmax(-1)[0]
    nll = -(log_p[0, 3] + log_p[1, 2])
    uniform = -log_p.mean(-1).sum()
    expected = 0.9 * nll + 0.1 * uniform
    assert translation_nll(logits, gold, 1, 0.1).item() == pytest.approx(expected.item(), rel=1e-5)


def test_masked_mean_ignores_padding_and_counts_boundary_tokens():
    states = torch.randn(1, 3, 4)
    mask = torch.ones(1, 3, dtype=torch.long)
    padded_states = torch.cat([states, 50 * torch.randn(1, 2, 4)], dim=1)
    padded_mask = torch.tensor([[1, 1, 1, 0, 0]])
    assert torch.allclose(masked_mean(states, mask), states.mean(1))
    assert torch.allclose(masked_mean(padded_states, padded_mask), states.mean(1), atol=1e-6)


def test_ctl_sends_gradient_through_both_source_and_target():
    encoder = torch.nn.Linear(4, 8)
    src, tgt = torch.randn(3, 5, 4), torch.randn(3, 6, 4)
    src_mask, tgt_mask = torch.ones(3, 5, dtype=torch.long), torch.ones(3, 6, dtype=torch.long)
    src_states = encoder(src)
    src_states.register_hook(
        torch.zeros_like
    )  # cut the source side: the target must carry gradient
    contrastive_translation_loss(src_states, src_mask, encoder(tgt), tgt_mask).backward()
    assert encoder.weight.grad.abs().sum() > 0


def test_ctl_matches_symmetric_info_nce_at_temperature_point_one():
    src, tgt = torch.randn(3, 5, 8), torch.randn(3, 4, 8)

    def ones(t):
        return torch.ones(t.shape[:2], dtype=torch.long)

    expected = info_nce(F.normalize(src.mean(1), dim=-1), F.normalize(tgt.mean(1), dim=-1), 0.1)
    assert contrastive_translation_loss(src, ones(src), tgt, ones(tgt)).item() == pytest.approx(
        expected.item(), rel=1e-5
    )


def test_decoder_is_causal_and_reads_the_language_tag():
    torch.manual_seed(0)
    decoder = TranslationDecoder(
        ["en", "xx"], dim=16, layers=2, heads=4, ffn=32, dropout=0.0
    ).eval()
    embeddings = torch.randn(10, 16)
    memory, memory_mask = torch.randn(2, 4, 16), torch.ones(2, 4, dtype=torch.long)
    ids = torch.tensor([[0, 5, 6, 2], [0, 7, 2, 1]])
    logits, gold = decoder(ids, memory, memory_mask, "xx", embeddings)
    assert logits.shape == (2, 3, 10) and torch.equal(gold, ids[:, 1:])
    later_changed = ids.clone()
    later_changed[0, 2] = 8  # affects decoder input at position 2 only
    logits_changed, _ = decoder(later_changed, memory, memory_mask, "xx", embeddings)
    assert torch.allclose(logits_changed[:, :2], logits[:, :2], atol=1e-5)
    assert not torch.allclose(logits_changed[0, 2], logits[0, 2])
    other_language, _ = decoder(ids, memory, memory_mask, "en", embeddings)
    assert not torch.allclose(other_language[:, 0], logits[:, 0])
    with pytest.raises(KeyError, match="'fr'"):
        decoder(ids, memory, memory_mask, "fr", embeddings)
