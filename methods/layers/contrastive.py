"""Symmetric InfoNCE over the global batch with a learnable temperature."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from methods.layers.distributed import gather_with_grad, rank


class LearnableTemperature(nn.Module):
    """Temperature tau = exp(log_tau), clamped to [min_value, max_value] (the clamp stops its
    gradient at the bounds). Log-parameterised so it stays positive and updates are relative."""

    def __init__(
        self,
        init: float = 0.07,
        min_value: float = 0.001,
        max_value: float = 0.5,
        learnable: bool = True,
    ):
        super().__init__()
        if not min_value <= init <= max_value:
            raise ValueError(f"temperature init {init} outside [{min_value}, {max_value}]")
        self.log_tau = nn.Parameter(torch.tensor(math.log(init)), requires_grad=learnable)
        self.min_value, self.max_value = min_value, max_value

    def forward(self) -> Tensor:
        return self.log_tau.exp().clamp(self.min_value, self.max_value)


def info_nce(image_emb: Tensor, text_emb: Tensor, temperature: Tensor) -> Tensor:
    """Symmetric 1-to-1 InfoNCE; row i of ``image_emb`` [B, D] matches row i of ``text_emb`` [B, D].

    Local loss: this process's B queries are scored against the keys gathered from every process
    (negatives from the global batch); the positive of local row i is global column rank*B + i. The
    loss is the mean of the image->text and text->image cross-entropies.
    """
    all_images, all_texts = gather_with_grad(image_emb), gather_with_grad(text_emb)
    labels = torch.arange(len(image_emb), device=image_emb.device) + rank() * len(image_emb)
    logits_i2t = image_emb @ all_texts.t() / temperature
    logits_t2i = text_emb @ all_images.t() / temperature
    return (
        F.cross_entropy(logits_i2t.float(), labels) + F.cross_entropy(logits_t2i.float(), labels)
    ) / 2
