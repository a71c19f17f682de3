"""Faithfulness tests of the 1-to-K contrastive loss (spec ccrk.md §10, items 1–7)."""

import math

import pytest
import torch
import torch.nn.functional as F

from ccr.methods.ccrk.one_to_k import one_to_k_i2t, one_to_k_terms, positive_mask
from ccr.methods.layers.distributed import RowLayout


def kcl(image, text, tau, **kwargs):
    """Single-process loss: queries are the candidates."""
    return one_to_k_terms(image, text, image, text, tau, **kwargs)


def random_features(batch, languages, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=gen), dim=1)
    text = F.normalize(torch.randn(batch * languages, dim, generator=gen), dim=1)
    return image, text


def hand_example():
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [0.8, 0.6]])  # t11, t12, t21, t22
    return image, text


def test_k1_reduces_to_infonce_both_directions():
    image, text = random_features(6, 1)
    logits = image @ text.t() / 0.1
    target = torch.arange(6)
    terms = kcl(image, text, 0.1)
    assert torch.allclose(terms.i2t, F.cross_entropy(logits, target), atol=1e-6)
    assert torch.allclose(terms.t2i, F.cross_entropy(logits.t(), target), atol=1e-6)
    assert torch.allclose(terms.total, terms.i2t + terms.t2i, atol=1e-6)
    reference = kcl(image, text, 0.1, weighting="reference")
    assert torch.allclose(reference.total, (terms.i2t + terms.t2i) / 2, atol=1e-6)


def test_hand_computed_values():
    image, text = hand_example()
    terms = kcl(image, text, 1.0)
    assert terms.i2t.item() == pytest.approx(1.249748, abs=1e-6)
    assert terms.t2i.item() == pytest.approx(0.555700, abs=1e-6)
    assert terms.total.item() == pytest.approx(1.805448, abs=1e-6)
    assert kcl(image, text, 1.0, weighting="reference").total.item() == pytest.approx(
        0.763799, abs=1e-6
    )
    at_007 = kcl(image, text, 0.07)
    assert at_007.i2t.item() == pytest.approx(2.916102, abs=1e-5)
    assert at_007.t2i.item() == pytest.approx(1.456494, abs=1e-5)


def test_language_major_flattening_breaks_hand_value():
    image, text = hand_example()
    language_major = text.view(2, 2, 2).transpose(0, 1).reshape(4, 2)  # t11, t21, t12, t22
    assert abs(kcl(image, language_major, 1.0).i2t.item() - 1.249748) > 1e-2


@pytest.mark.parametrize("languages", [2, 3, 5])
def test_i2t_lower_bound_log_k_on_random_inputs(languages):
    for seed in range(5):
        image, text = random_features(4, languages, seed=seed)
        assert kcl(image, text, 0.05).i2t.item() >= math.log(languages) - 1e-6


@pytest.mark.parametrize("languages, expected", [(2, 0.6931484), (3, 1.0986135)])
def test_perfect_alignment_attains_bound(languages, expected):
    tau, batch = 0.07, 3
    image = torch.eye(batch, dtype=torch.float64)  # float32 cannot resolve the 1e-6 t2i value
    text = image.repeat_interleave(languages, dim=0)
    terms = kcl(image, text, tau)
    closed_form = math.log(languages) + math.log(1 + (batch - 1) * math.exp(-1 / tau))
    assert terms.i2t.item() == pytest.approx(closed_form, abs=1e-6)
    assert terms.i2t.item() == pytest.approx(expected, abs=1e-6)
    assert terms.t2i.item() == pytest.approx(
        math.log(1 + (batch - 1) * math.exp(-1 / tau)), rel=1e-6
    )
    assert terms.t2i.item() == pytest.approx(1.2497e-6, rel=1e-4)


def test_duplicated_translations_shift_i2t_by_log_k():
    image, single = random_features(5, 1, seed=3)
    languages = 4
    duplicated = single.repeat_interleave(languages, dim=0)
    one, many = kcl(image, single, 0.1), kcl(image, duplicated, 0.1)
    assert many.i2t.item() == pytest.approx(one.i2t.item() + math.log(languages), abs=1e-5)
    assert many.t2i.item() == pytest.approx(one.t2i.item(), abs=1e-6)


def test_equal_positive_logits_relate_to_multi_positive_infonce():
    languages = 3
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.5, -1.0, 0.3]])
    positives = positive_mask(torch.tensor([0]), 2, languages)
    log_p = logits.log_softmax(1)
    multi_positive = -torch.logsumexp(log_p[positives], 0)
    assert one_to_k_i2t(logits, positives).mean().item() == pytest.approx(
        multi_positive.item() + math.log(languages), abs=1e-6
    )


def test_gradient_is_softmax_minus_soft_target():
    batch, languages = 3, 2
    logits = torch.randn(batch, batch * languages, generator=torch.Generator().manual_seed(1))
    logits.requires_grad_(True)
    positives = positive_mask(torch.arange(batch), batch, languages)
    one_to_k_i2t(logits, positives).mean().backward()
    target = positives.float() / languages
    assert torch.allclose(logits.grad, (logits.detach().softmax(1) - target) / batch, atol=1e-6)


def test_optimum_gives_each_positive_probability_one_over_k():
    languages = 3
    logits = torch.zeros(1, 2 * languages, requires_grad=True)
    positives = positive_mask(torch.tensor([0]), 2, languages)
    optimizer = torch.optim.SGD([logits], lr=5.0)
    for _ in range(300):
        optimizer.zero_grad()
        one_to_k_i2t(logits, positives).mean().backward()
        optimizer.step()
    probabilities = logits.detach().softmax(1)[0]
    assert torch.allclose(
        probabilities[:languages], torch.full((languages,), 1 / languages), atol=1e-3
    )


def test_language_and_instance_permutations_leave_loss_unchanged():
    batch, languages = 5, 3
    image, text = random_features(batch, languages, seed=7)
    base = kcl(image, text, 0.1)
    gen = torch.Generator().manual_seed(0)
    within = torch.cat(
        [j * languages + torch.randperm(languages, generator=gen) for j in range(batch)]
    )
    shuffled_languages = kcl(image, text[within], 0.1)
    order = torch.randperm(batch, generator=gen)
    rows = (order[:, None] * languages + torch.arange(languages)).flatten()
    shuffled_instances = kcl(image[order], text[rows], 0.1)
    for other in (shuffled_languages, shuffled_instances):
        assert torch.allclose(other.i2t, base.i2t, atol=1e-6)
        assert torch.allclose(other.t2i, base.t2i, atol=1e-6)


def test_local_queries_against_global_candidates_split_the_global_mean():
    batch, languages, half = 6, 2, 3
    image, text = random_features(batch, languages, seed=11)
    full = kcl(image, text, 0.1)
    parts = [
        one_to_k_terms(
            image[s : s + half],
            text[s * languages : (s + half) * languages],
            image,
            text,
            0.1,
            layout=RowLayout(counts=(half, batch - half), rank=r),
        )
        for r, s in enumerate((0, half))
    ]
    assert torch.allclose((parts[0].i2t + parts[1].i2t) / 2, full.i2t, atol=1e-6)
    assert torch.allclose((parts[0].t2i + parts[1].t2i) / 2, full.t2i, atol=1e-6)


def test_absent_captions_are_neither_candidates_nor_queries():
    batch, languages = 4, 3
    image, text = random_features(batch, languages, seed=5)
    present = torch.ones(batch * languages, dtype=torch.bool)
    present[[1, 2]] = False  # instance 0 keeps only language 0
    masked = kcl(image, text, 0.1, present_query=present, present_all=present)
    poisoned = text.clone()
    poisoned[[1, 2]] = image[1]  # absent rows hold junk that would change a loss that used them
    assert torch.allclose(
        kcl(image, poisoned, 0.1, present_query=present, present_all=present).total, masked.total
    )
    kept = present.nonzero().squeeze(1)
    logits = image @ text[kept].t() / 0.1
    owner = torch.arange(batch).repeat_interleave(languages)[kept]
    expected_t2i = F.cross_entropy(logits.t(), owner)
    assert torch.allclose(masked.t2i, expected_t2i, atol=1e-6)


def test_rejects_unknown_weighting_and_ragged_text():
    image, text = random_features(2, 2)
    with pytest.raises(ValueError, match="weighting"):
        kcl(image, text, 0.1, weighting="mean")
    with pytest.raises(ValueError, match="K per image"):
        kcl(image, text[:3], 0.1)
