"""The 1-to-K contrastive loss of CCRk (spec ccrk.md §3.1).

Texts are flattened image-major: row ``j * K + k`` is instance ``j`` in language ``k``. Image→text is a
soft-label cross-entropy over all B·K captions with target 1/K on each of the instance's K captions;
text→image is an ordinary InfoNCE over the B images.

The loss is written in "local loss over gathered candidates" form so that it works unchanged on one
or many processes: the queries are this process's images and captions, the candidates are the
features gathered (with gradient) from every process in rank order, and a ``RowLayout`` says where
this process's instances sit among them (processes may hold different numbers of instances). On
one process queries and candidates are the same tensors. Each process returns its share of the
global-batch mean (``RowLayout.global_mean``); averaging over processes (what DDP does to the
gradients) then gives the global-batch loss and its gradient.

Captions that are missing (``present`` false) are neither candidates nor queries, and an
instance's soft target is spread over its present captions only; with every caption present this
is exactly the spec's formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ccr.methods.layers.contrastive import similarity_logits
from ccr.methods.layers.distributed import RowLayout, gather_with_grad, row_layout

WEIGHTINGS = ("paper", "reference")


@dataclass
class OneToKTerms:
    """The two directions of the 1-to-K loss and their weighted total."""

    i2t: Tensor
    t2i: Tensor
    total: Tensor


def positive_mask(query_instances: Tensor, num_instances: int, languages: int) -> Tensor:
    """Bool [Q, num_instances * languages]: True where the caption column belongs to the query's instance."""
    caption_owner = torch.arange(num_instances, device=query_instances.device).repeat_interleave(
        languages
    )
    return caption_owner[None, :] == query_instances[:, None]


def one_to_k_i2t(
    logits: Tensor, positives: Tensor, candidate_present: Tensor | None = None
) -> Tensor:
    """Image→text soft-label cross-entropy of each query image, [Q].

    logits [Q, C] image-to-caption scores (already divided by τ); positives bool [Q, C]; the target
    puts 1/K_j on each present positive of query j (K_j = its number of present captions).
    """
    if candidate_present is not None:
        logits = logits.masked_fill(~candidate_present[None, :], float("-inf"))
        positives = positives & candidate_present[None, :]
    counts = positives.sum(1, keepdim=True)
    if bool((counts == 0).any()):
        raise ValueError("one_to_k_i2t: an image query has no present caption among the candidates")
    target = positives.to(logits.dtype) / counts.to(logits.dtype)
    log_probs = logits.log_softmax(dim=1).masked_fill(~positives, 0.0)
    return -(target * log_probs).sum(1)


def one_to_k_terms(
    image_query: Tensor,
    text_query: Tensor,
    image_all: Tensor,
    text_all: Tensor,
    temperature: Tensor | float,
    layout: RowLayout | None = None,
    present_query: Tensor | None = None,
    present_all: Tensor | None = None,
    weighting: str = "paper",
) -> OneToKTerms:
    """1-to-K contrastive loss of this process's queries against all gathered candidates.

    image_query [b, D], text_query [b*K, D]: this process's L2-normalised features (image-major).
    image_all [B, D], text_all [B*K, D]: every process's features concatenated by rank.
    layout: every process's image count (None: one process holding all of them).
    present_query [b*K] / present_all [B*K]: which captions exist (None: all of them).
    weighting: "paper" sums the two directions (Eq. 6); "reference" gives (i2t + t2i / K) / 2.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(
            f"one_to_k_terms: weighting must be one of {WEIGHTINGS}, got {weighting!r}"
        )
    layout = RowLayout(counts=(image_query.size(0),), rank=0) if layout is None else layout
    local_b, total_b = image_query.size(0), image_all.size(0)
    if layout.local != local_b or layout.total != total_b:
        raise ValueError(
            f"one_to_k_terms: layout {layout.counts} (rank {layout.rank}) does not fit "
            f"{local_b} local and {total_b} gathered images"
        )
    if text_all.size(0) % total_b or text_query.size(0) != text_all.size(0) // total_b * local_b:
        raise ValueError(
            f"one_to_k_terms: text rows must be K per image (local {tuple(text_query.shape)} for "
            f"{local_b} images, global {tuple(text_all.shape)} for {total_b} images)"
        )
    languages = text_all.size(0) // total_b
    query_instances = torch.arange(local_b, device=image_query.device) + layout.offset

    i2t_logits = similarity_logits(image_query, text_all, temperature)
    i2t_rows = one_to_k_i2t(
        i2t_logits, positive_mask(query_instances, total_b, languages), present_all
    )
    i2t = layout.global_mean(i2t_rows)

    t2i_logits = similarity_logits(text_query, image_all, temperature)
    text_owner = query_instances.repeat_interleave(languages)
    if present_query is not None:
        t2i_logits, text_owner = t2i_logits[present_query], text_owner[present_query]
    t2i_rows = F.cross_entropy(t2i_logits, text_owner, reduction="none")
    t2i = _caption_layout(layout, languages, present_all).global_mean(t2i_rows)

    if weighting == "paper":
        total = i2t + t2i
    else:
        total = 0.5 * i2t + 0.5 * t2i / languages
    return OneToKTerms(i2t=i2t, t2i=t2i, total=total)


def _caption_layout(images: RowLayout, languages: int, present_all: Tensor | None) -> RowLayout:
    """Every process's count of caption queries (its present captions), from the image layout."""
    if present_all is None:
        return RowLayout(counts=tuple(c * languages for c in images.counts), rank=images.rank)
    blocks = present_all.split([c * languages for c in images.counts])
    return RowLayout(counts=tuple(int(block.sum()) for block in blocks), rank=images.rank)


def one_to_k_loss(
    image_feat: Tensor,
    text_feat: Tensor,
    temperature: Tensor | float,
    present: Tensor | None = None,
    weighting: str = "paper",
) -> OneToKTerms:
    """1-to-K loss over the global batch: gathers [b, D] images and their [b*K, D] caption blocks from
    every process in rank order (image-major order and positives stay aligned; b may differ
    between processes), then the local loss."""
    image_layout = row_layout(image_feat.size(0), image_feat.device)
    text_layout = row_layout(text_feat.size(0), text_feat.device)
    image_all = gather_with_grad(image_feat, image_layout)
    text_all = gather_with_grad(text_feat, text_layout)
    present_all = (
        None if present is None else gather_with_grad(present.to(torch.uint8), text_layout).bool()
    )
    return one_to_k_terms(
        image_feat,
        text_feat,
        image_all,
        text_all,
        temperature,
        layout=image_layout,
        present_query=present,
        present_all=present_all,
        weighting=weighting,
    )
