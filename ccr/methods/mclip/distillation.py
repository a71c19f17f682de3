"""Triangle cross-modal knowledge distillation (TriKD) losses, as used by mCLIP.

TriKD aligns a student text encoder with a frozen image-text teacher through two symmetric InfoNCE
terms: image <-> student text (ITC, learnable temperature) and teacher text <-> student text (TTC,
fixed temperature). There is no regression onto teacher vectors: "distillation" is contrastive.
Every function takes L2-normalised features; rows with the same index are the positive pairs, and
the negatives come from the global batch (`ccr.methods.layers.contrastive.info_nce`). Fine-tuning
after TriKD uses the multi-positive form, where rows showing the same image are all positives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from ccr.methods.layers.contrastive import info_nce, similarity_logits
from ccr.methods.layers.distributed import gather_with_grad, row_layout


def clamped_logit_scale(logit_scale: Tensor, max_scale: float = 100.0) -> Tensor:
    """The ITC similarity multiplier `min(exp(logit_scale), max_scale)`."""
    return logit_scale.exp().clamp(max=max_scale)


def fixed_ttc_temperature(temperature: float, mode: str = "paper") -> float:
    """The fixed TTC temperature. "paper": τ itself. "reference": 1/ln(1/τ), because the public
    code multiplies similarities by ln(1/τ) (about 0.376 for τ = 0.07); kept to reproduce it."""
    if mode == "paper":
        return temperature
    if mode == "reference":
        return 1.0 / math.log(1.0 / temperature)
    raise ValueError(f"ttc_scale_mode must be 'paper' or 'reference', got {mode!r}")


@dataclass
class TriKDLoss:
    total: Tensor
    itc: Tensor | None  # None when the ITC term is ablated
    ttc: Tensor | None  # None when the captions are not English (no teacher text) or TTC is ablated


def trikd_loss(
    h_image: Tensor,
    h_student: Tensor,
    logit_scale: Tensor,
    h_teacher_text: Tensor | None = None,
    *,
    ttc_weight: float = 0.1,
    ttc_temperature: float = 0.07,
    max_scale: float = 100.0,
    itc: bool = True,
) -> TriKDLoss:
    """`L_ITC + ttc_weight·L_TTC` for English captions; `L_ITC` alone when `h_teacher_text` is None
    (non-English captions, which the English teacher text tower cannot read, or TTC ablated);
    `ttc_weight·L_TTC` alone when `itc` is False (the "- L_ITC" ablation)."""
    if not itc and h_teacher_text is None:
        raise ValueError("TriKD without ITC needs the teacher's text embeddings (TTC)")
    itc_loss = ttc_loss = None
    if itc:
        itc_loss = info_nce(h_image, h_student, 1.0 / clamped_logit_scale(logit_scale, max_scale))
    if h_teacher_text is not None:
        ttc_loss = info_nce(h_teacher_text, h_student, ttc_temperature)
    if ttc_loss is None:
        total = itc_loss
    elif itc_loss is None:
        total = ttc_weight * ttc_loss
    else:
        total = itc_loss + ttc_weight * ttc_loss
    return TriKDLoss(total=total, itc=itc_loss, ttc=ttc_loss)


def multi_positive_info_nce(
    h_text: Tensor, h_image: Tensor, image_keys: Tensor, scale: Tensor | float
) -> Tensor:
    """mCLIP's fine-tuning loss (spec §5): symmetric InfoNCE over (caption, image) rows where row j
    is a positive of row i whenever both show the same image (``image_keys`` equal), so the
    captions of one image never push each other away. Per query row the loss is the sum of
    -log softmax over its positives, averaged over the rows of the global batch (as in the
    reference code); with every key distinct it is exactly the 1-to-1 InfoNCE."""
    layout = row_layout(len(h_text), h_text.device)
    all_text = gather_with_grad(h_text, layout)
    all_image = gather_with_grad(h_image, layout)
    all_keys = gather_with_grad(image_keys, layout)
    positives = (image_keys[:, None] == all_keys[None, :]).float()

    def positives_nll(queries: Tensor, keys: Tensor) -> Tensor:
        log_probs = F.log_softmax(similarity_logits(queries, keys) * scale, dim=1)
        return -(positives * log_probs).sum(1)

    text_to_image, image_to_text = (
        positives_nll(h_text, all_image),
        positives_nll(h_image, all_text),
    )
    return layout.global_mean(text_to_image + image_to_text) / 2


def freeze(module: nn.Module) -> nn.Module:
    """Stop every gradient into `module` and put it in eval mode (no dropout), so a frozen tower
    is a deterministic teacher. Owners re-assert eval() in their `train()` override."""
    module.requires_grad_(False)
    return module.eval()
