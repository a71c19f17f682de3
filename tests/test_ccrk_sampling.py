"""Hard positive / negative samplers, the ITM loss and the MLM masking helper (spec ccrk.md §10, 8–10)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ccr.methods.ccrk.hard_sampling import (
    HardSamples,
    matching_loss,
    sample_hard_examples,
    sampling_weights,
)
from ccr.methods.layers.masking import IGNORE_INDEX, mask_tokens


def features_with_cosines(cosines):
    """One image e1 and K captions whose cosine with it is given (2-d unit vectors)."""
    cos = torch.tensor(cosines)
    text = torch.stack([cos, (1 - cos**2).sqrt()], dim=1)
    return torch.tensor([[1.0, 0.0]]), text


def two_instances(cosines):
    """Instance 0 has the given cosines; instance 1 is orthogonal filler (needed: B >= 2)."""
    image, text = features_with_cosines(cosines)
    image = F.pad(image, (0, 1))
    text = F.pad(text, (0, 1))
    filler = torch.tensor([[0.0, 0.0, 1.0]])
    return torch.cat([image, filler]), torch.cat([text, filler.repeat(len(cosines), 1)])


def random_batch(batch, languages, seed=0, dim=16):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=gen), dim=1)
    text = F.normalize(torch.randn(batch * languages, dim, generator=gen), dim=1)
    return image, text


@pytest.mark.parametrize(
    "cosines, expected", [((0.5, 0.3, 0.2), (0.25, 0.35, 0.40)), ((0.8, 0.2), (0.2, 0.8))]
)
def test_paper_hard_positive_probabilities(cosines, expected):
    image, text = two_instances(cosines)
    weights = sampling_weights(image, text, 0.07, mode="paper").positive[0]
    assert torch.allclose(weights / weights.sum(), torch.tensor(expected), atol=1e-5)


@pytest.mark.parametrize("mode", ["reference", "paper"])
def test_hard_positive_frequency_falls_as_similarity_rises(mode):
    image, text = two_instances((0.9, 0.5, 0.1))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        samples = sample_hard_examples(image, text, 0.5, mode=mode, generator=gen)
        counts[samples.positive_text[0]] += 1
    assert counts[0] < counts[1] < counts[2]


@pytest.mark.parametrize("mode", ["reference", "paper", "uniform"])
def test_sampled_rows_respect_instances(mode):
    batch, languages = 6, 3
    image, text = random_batch(batch, languages, seed=2)
    gen = torch.Generator().manual_seed(1)
    negative_languages = set()
    for _ in range(200):
        samples = sample_hard_examples(image, text, 0.1, mode=mode, generator=gen)
        owner_pos = samples.positive_text // languages
        owner_neg = samples.negative_text // languages
        assert torch.equal(owner_pos, torch.arange(batch))
        assert bool((owner_neg != torch.arange(batch)).all())
        assert bool((samples.negative_image != torch.arange(batch)).all())
        negative_languages.update((samples.negative_text % languages).tolist())
    assert negative_languages == {0, 1, 2}


def test_single_language_positive_is_the_instance_row():
    image, text = random_batch(5, 1, seed=4)
    for mode in ("reference", "paper", "uniform"):
        assert torch.equal(
            sample_hard_examples(image, text, 0.1, mode=mode).positive_text, torch.arange(5)
        )


def test_two_instances_force_the_negative():
    image, text = random_batch(2, 3, seed=6)
    for _ in range(20):
        samples = sample_hard_examples(image, text, 0.1)
        assert torch.equal(samples.negative_image, torch.tensor([1, 0]))
        assert torch.equal(samples.negative_text // 3, torch.tensor([1, 0]))


def test_one_instance_is_rejected():
    image, text = random_batch(1, 2)
    with pytest.raises(ValueError, match="at least 2 instances"):
        sample_hard_examples(image, text, 0.1)


def test_sampler_carries_no_gradient():
    image, text = random_batch(4, 2)
    image.requires_grad_(True)
    weights = sampling_weights(image, text, 0.1)
    samples = sample_hard_examples(image, text, 0.1)
    assert not weights.positive.requires_grad and not weights.negative_text.requires_grad
    assert not samples.positive_text.requires_grad


def test_absent_captions_are_never_drawn():
    batch, languages = 4, 3
    image, text = random_batch(batch, languages, seed=8)
    present = torch.ones(batch * languages, dtype=torch.bool)
    present[[0, 1, 5, 7]] = False
    gen = torch.Generator().manual_seed(2)
    for mode in ("reference", "paper", "uniform"):
        for _ in range(100):
            samples = sample_hard_examples(
                image, text, 0.1, mode=mode, present=present, generator=gen
            )
            assert bool(present[samples.positive_text].all())
            assert bool(present[samples.negative_text].all())


def test_hard_negative_text_prefers_similar_captions():
    image = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    text = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.9, 0.0, 0.436]])  # K=1
    gen = torch.Generator().manual_seed(3)
    hits = sum(
        int(sample_hard_examples(image, text, 0.1, generator=gen).negative_text[0] == 2)
        for _ in range(300)
    )
    assert hits > 250


class RecordingFusion:
    """Fusion stand-in: returns text states plus the image's first token, records its inputs."""

    def __call__(self, text_states, text_mask, image_states):
        self.inputs = (text_states, text_mask, image_states)
        return text_states + image_states[:, :1]


def test_matching_loss_pairs_and_labels():
    batch, languages, length, width = 3, 2, 4, 6
    gen = torch.Generator().manual_seed(0)
    text_states = torch.randn(batch * languages, length, width, generator=gen)
    text_mask = torch.ones(batch * languages, length, dtype=torch.long)
    image_states = torch.randn(batch, 5, width, generator=gen)
    samples = HardSamples(
        positive_text=torch.tensor([1, 2, 5]),
        negative_text=torch.tensor([3, 0, 1]),
        negative_image=torch.tensor([2, 0, 1]),
    )
    fuse, head = RecordingFusion(), nn.Linear(width, 2)
    out = matching_loss(fuse, head, text_states, text_mask, image_states, samples)
    assert out.labels.tolist() == [1] * batch + [0] * (2 * batch)
    fused_text, _, fused_image = fuse.inputs
    assert torch.equal(fused_text, text_states[[1, 2, 5, 3, 0, 1, 1, 2, 5]])
    assert torch.equal(fused_image, image_states[[0, 1, 2, 0, 1, 2, 2, 0, 1]])
    expected_logits = head((text_states[[1, 2, 5, 3, 0, 1, 1, 2, 5]] + fused_image[:, :1])[:, 0])
    assert torch.allclose(out.logits, expected_logits)
    assert torch.allclose(out.loss, F.cross_entropy(expected_logits, out.labels))


SPECIALS = {"pad": 0, "cls": 1, "eos": 2, "mask": 3}


def token_batch(rows=400, length=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=gen)
    lengths = torch.randint(3, length + 1, (rows,), generator=gen)
    positions = torch.arange(length)[None, :]
    mask = (positions < lengths[:, None]).long()
    ids[:, 0] = SPECIALS["cls"]
    ids[torch.arange(rows), lengths - 1] = SPECIALS["eos"]
    ids[mask == 0] = SPECIALS["pad"]
    return ids, mask


def masked(ids, mask, probability=0.15, seed=1):
    return mask_tokens(
        ids,
        mask,
        SPECIALS["mask"],
        50,
        SPECIALS.values(),
        probability,
        generator=torch.Generator().manual_seed(seed),
    )


def test_masking_rate_and_protected_tokens():
    ids, mask = token_batch()
    out = masked(ids, mask)
    selected = out.labels != IGNORE_INDEX
    maskable = (mask == 1) & (ids > 3)
    assert not bool((selected & ~maskable).any())
    assert bool(selected.any(1).all())
    rate = selected.sum().item() / maskable.sum().item()
    assert 0.13 < rate < 0.21  # 15 % plus the forced one on short texts
    assert torch.equal(out.labels[selected], ids[selected])
    assert torch.equal(out.input_ids[~selected], ids[~selected])
    replaced = out.input_ids[selected]
    share_mask = (replaced == SPECIALS["mask"]).float().mean().item()
    assert 0.72 < share_mask < 0.88
    assert not bool(
        torch.isin(replaced[replaced != SPECIALS["mask"]], torch.tensor([0, 1, 2])).any()
    )


def test_masking_forces_one_token_on_short_texts():
    ids, mask = token_batch(rows=50, length=16)
    out = masked(ids, mask, probability=1e-6)  # the draw itself selects nothing
    assert torch.equal((out.labels != IGNORE_INDEX).sum(1), torch.ones(50, dtype=torch.long))


def test_masking_rejects_bad_probability():
    ids, mask = token_batch(rows=2)
    with pytest.raises(ValueError, match="probability"):
        masked(ids, mask, probability=0.0)
