"""Hard positive / hard negative sampling and the image–text matching loss (spec ccrk.md §3.2–3.3).

For every instance j of the local batch we draw, without gradient:
- a *hard positive* caption: one of j's K captions, favouring the language the image matches worst;
- a *hard negative* caption: any caption (any language) of another instance, favouring similar ones;
- a *hard negative* image: another instance's image, favouring images similar to j's hard positive.

Three weightings are available: ``"reference"`` (softmax-weighted, the adopted default, §3.2),
``"paper"`` (Eqs. 8–9 on raw cosines, normalised and clamped at 0) and ``"uniform"`` (the w/o-hard-
mining ablations). All indices are rows of the image-major caption matrix (``j * K + k``) or image
indices. Captions marked absent are never drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ccr.methods.layers.contrastive import similarity_logits

MINING_MODES = ("reference", "paper", "uniform")
_REFERENCE_EPS = 1e-5
_PAPER_EPS = 1e-6


@dataclass
class SamplingWeights:
    """Unnormalised draw weights: positive [B, K], negative_text [B, B*K], negative_image [B*K, B]
    (row r: weights over images when caption r is the hard positive)."""

    positive: Tensor
    negative_text: Tensor
    negative_image: Tensor


@dataclass
class HardSamples:
    """Sampled rows: positive_text [B] and negative_text [B] index captions, negative_image [B] images."""

    positive_text: Tensor
    negative_text: Tensor
    negative_image: Tensor


def caption_owner_mask(num_instances: int, languages: int, device: torch.device) -> Tensor:
    """Bool [B, B*K]: True where caption column belongs to instance row."""
    instances = torch.arange(num_instances, device=device)
    return instances.repeat_interleave(languages)[None, :] == instances[:, None]


def own_block(matrix: Tensor, languages: int) -> Tensor:
    """[B, K]: each instance's entries for its own K captions out of ``matrix`` [B, B*K], by a view
    (a boolean mask would read the selected count back to the host, a GPU sync)."""
    batch = matrix.size(0)
    return matrix.view(batch, batch, languages).diagonal(dim1=0, dim2=1).t()


def _reference_weights(sim: Tensor, present: Tensor, languages: int) -> SamplingWeights:
    """ALBEF-style softmax weights on sim = cos/τ; the positive weight falls as similarity rises."""
    w_i2t = sim.masked_fill(~present[None, :], float("-inf")).softmax(1) + _REFERENCE_EPS
    w_t2i = sim.t().softmax(1) + _REFERENCE_EPS
    own_weights = own_block(w_i2t, languages)
    positive = (w_i2t.max() + _REFERENCE_EPS) - own_weights
    return SamplingWeights(positive=positive, negative_text=w_i2t, negative_image=w_t2i)


def _paper_weights(cos: Tensor, present: Tensor, languages: int) -> SamplingWeights:
    """Paper Eqs. 8–9 on cosines clamped at 0: P(k) ∝ 1 − s_k / Σ_k' s_k', P(j') ∝ Σ_k s(t_jk, i_j')."""
    batch = cos.size(0)
    clamped = cos.clamp(min=0) + _PAPER_EPS
    own_cos = own_block(clamped, languages) * present.view(batch, languages)
    positive = 1 - own_cos / own_cos.sum(1, keepdim=True) + _PAPER_EPS
    per_instance = (
        (cos * present[None, :]).view(batch, batch, languages).sum(2).t()
    )  # [inst, image]
    negative_image = (per_instance.clamp(min=0) + _PAPER_EPS).repeat_interleave(languages, dim=0)
    return SamplingWeights(positive=positive, negative_text=clamped, negative_image=negative_image)


def _uniform_weights(batch: int, languages: int, device: torch.device) -> SamplingWeights:
    """Equal weights everywhere: the w/o-hard-mining ablations."""
    return SamplingWeights(
        positive=torch.ones(batch, languages, device=device),
        negative_text=torch.ones(batch, batch * languages, device=device),
        negative_image=torch.ones(batch * languages, batch, device=device),
    )


@torch.no_grad()
def sampling_weights(
    image_feat: Tensor,
    text_feat: Tensor,
    temperature: Tensor | float,
    mode: str = "reference",
    present: Tensor | None = None,
) -> SamplingWeights:
    """Draw weights from normalised features image_feat [B, D], text_feat [B*K, D] (image-major).

    Weights that must never be drawn (own captions as negatives, the own image, absent captions)
    are zero.
    """
    if mode not in MINING_MODES:
        raise ValueError(f"sampling_weights: mode must be one of {MINING_MODES}, got {mode!r}")
    batch = image_feat.size(0)
    if batch < 2:
        raise ValueError(
            f"hard negative mining needs at least 2 instances per process, got {batch}"
        )
    if text_feat.size(0) % batch:
        raise ValueError(f"sampling_weights: {text_feat.size(0)} caption rows for {batch} images")
    languages = text_feat.size(0) // batch
    device = image_feat.device
    present = (
        torch.ones(batch * languages, dtype=torch.bool, device=device)
        if present is None
        else present
    )
    if not bool(present.view(batch, languages).any(1).all()):
        raise ValueError("sampling_weights: an instance has no present caption")
    own = caption_owner_mask(batch, languages, device)
    cos = similarity_logits(image_feat, text_feat)
    if mode == "reference":
        weights = _reference_weights(cos / temperature, present, languages)
    elif mode == "paper":
        weights = _paper_weights(cos, present, languages)
    else:
        weights = _uniform_weights(batch, languages, device)
    same_image = torch.eye(batch, dtype=torch.bool, device=device).repeat_interleave(
        languages, dim=0
    )
    return SamplingWeights(
        positive=weights.positive * present.view(batch, languages),
        negative_text=weights.negative_text.masked_fill(own | ~present[None, :], 0.0),
        negative_image=weights.negative_image.masked_fill(same_image, 0.0),
    )


@torch.no_grad()
def draw_positive_text(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One caption row per instance from positive weights [B, K]: row j*K + k."""
    batch, languages = weights.shape
    choice = torch.multinomial(weights, 1, generator=generator).squeeze(1)
    return torch.arange(batch, device=weights.device) * languages + choice


@torch.no_grad()
def sample_hard_examples(
    image_feat: Tensor,
    text_feat: Tensor,
    temperature: Tensor | float,
    mode: str = "reference",
    present: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> HardSamples:
    """Hard positive caption, hard negative caption and hard negative image for each instance."""
    weights = sampling_weights(image_feat, text_feat, temperature, mode, present)
    positive = draw_positive_text(weights.positive, generator)
    negative_text = torch.multinomial(weights.negative_text, 1, generator=generator).squeeze(1)
    negative_image = torch.multinomial(
        weights.negative_image[positive], 1, generator=generator
    ).squeeze(1)
    return HardSamples(
        positive_text=positive, negative_text=negative_text, negative_image=negative_image
    )


@dataclass
class MatchingOutput:
    """ITM loss over the 3B pairs, with the logits [3B, 2] and labels [3B] it was computed from."""

    loss: Tensor
    logits: Tensor
    labels: Tensor


Fuse = Callable[[Tensor, Tensor, Tensor], Tensor]
"""fuse(text_states [N, L, D], text_mask [N, L], image_states [N, P, Dv]) -> fused text states [N, L, D]."""


def matching_loss(
    fuse: Fuse,
    itm_head: nn.Module,
    text_states: Tensor,
    text_mask: Tensor,
    image_states: Tensor,
    samples: HardSamples,
) -> MatchingOutput:
    """Binary ITM cross-entropy over (i_j, t_j^pos)=1, (i_j, t_j^neg)=0 and (i_j^neg, t_j^pos)=0.

    text_states [B*K, L, D] are the unmasked text-encoder outputs, image_states [B, P, Dv]. The three
    groups of B pairs run through the fusion encoder in one batch, scored on token 0.
    """
    batch = image_states.size(0)
    rows = torch.cat([samples.positive_text, samples.negative_text, samples.positive_text])
    images = torch.cat([image_states, image_states, image_states[samples.negative_image]])
    fused = fuse(text_states[rows], text_mask[rows], images)
    logits = itm_head(fused[:, 0])
    labels = torch.zeros(3 * batch, dtype=torch.long, device=logits.device)
    labels[:batch] = 1
    return MatchingOutput(loss=F.cross_entropy(logits, labels), logits=logits, labels=labels)
