"""Triangle cross-modal knowledge distillation (TriKD) losses, as used by mCLIP.

TriKD aligns a student text encoder with a frozen image-text teacher through two symmetric InfoNCE
terms: image <-> student text (ITC, learnable temperature) and teacher text <-> student text (TTC,
fixed temperature). There is no regression onto teacher vectors: "distillation" is contrastive.
Every function takes L2-normalised features; rows with the same index are the positive pairs, and
the negatives come from the global batch (`methods.layers.contrastive.info_nce`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from methods.layers.contrastive import info_nce


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
    itc: Tensor
    ttc: Tensor | None  # None when the captions are not English (no teacher text)


def trikd_loss(h_image: Tensor, h_student: Tensor, logit_scale: Tensor,
               h_teacher_text: Tensor | None = None, *, ttc_weight: float = 0.1,
               ttc_temperature: float = 0.07, max_scale: float = 100.0) -> TriKDLoss:
    """`L_ITC + ttc_weight·L_TTC` for English captions; `L_ITC` alone when `h_teacher_text` is None
    (non-English captions, which the English teacher text tower cannot read)."""
    itc = info_nce(h_image, h_student, 1.0 / clamped_logit_scale(logit_scale, max_scale))
    if h_teacher_text is None:
        return TriKDLoss(total=itc, itc=itc, ttc=None)
    ttc = info_nce(h_teacher_text, h_student, ttc_temperature)
    return TriKDLoss(total=itc + ttc_weight * ttc, itc=itc, ttc=ttc)


def freeze(module: nn.Module) -> nn.Module:
    """Stop every gradient into `module` and put it in eval mode (no dropout), so a frozen tower
    is a deterministic teacher. Owners re-assert eval() in their `train()` override."""
    module.requires_grad_(False)
    return module.eval()
