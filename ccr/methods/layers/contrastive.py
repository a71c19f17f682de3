"""Symmetric InfoNCE over the global batch, a learnable temperature, and the fp32 similarity
logits every contrastive and matching loss uses."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ccr.methods.layers.distributed import gather_with_grad, row_layout


class LearnableTemperature(nn.Module):
    """Temperature tau = exp(log_tau), clamped to [min_value, max_value] (the clamp stops its
    gradient at the bounds). Log-parameterised so it stays positive and updates are relative.
    Owners call ``clamp_`` after each optimiser step so a tau pushed past a bound moves back."""

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

    @torch.no_grad()
    def clamp_(self) -> None:
        """Clamp the parameter itself into the bounds, where its gradient is not zero."""
        self.log_tau.clamp_(math.log(self.min_value), math.log(self.max_value))


def _autocast_off(device: torch.device):
    """A context with autocast disabled on ``device`` (a no-op where autocast does not exist)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def similarity_logits(queries: Tensor, keys: Tensor, temperature: Tensor | float = 1.0) -> Tensor:
    """``queries [Q, D] @ keys [C, D].T / temperature`` in float32 (float64 stays), autocast off.

    Under bf16 autocast a bf16 matmul resolves a logit of 14 only to about 0.06; the softmax of a
    contrastive loss needs the fp32 product. Half-precision features are cast up (their own
    rounding stays); the product and the division by the temperature are fp32.
    """
    dtype = torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), torch.float32)
    with _autocast_off(queries.device):
        logits = queries.to(dtype) @ keys.to(dtype).t()
        if isinstance(temperature, Tensor):
            temperature = temperature.to(dtype)
        return logits / temperature


def info_nce(image_emb: Tensor, text_emb: Tensor, temperature: Tensor | float) -> Tensor:
    """Symmetric 1-to-1 InfoNCE; row i of ``image_emb`` [n, D] matches row i of ``text_emb`` [n, D].

    Local loss: this process's n queries are scored against the keys gathered from every process
    (negatives from the global batch; n may differ between processes and may be 0); the positive
    of local row i is global column offset + i. The loss is the mean of the image->text and
    text->image cross-entropies over the global batch, as this process's share
    (``RowLayout.global_mean``): averaged over processes it is the global-batch loss.
    """
    layout = row_layout(len(image_emb), image_emb.device)
    all_images = gather_with_grad(image_emb, layout)
    all_texts = gather_with_grad(text_emb, layout)
    labels = torch.arange(len(image_emb), device=image_emb.device) + layout.offset
    i2t = F.cross_entropy(
        similarity_logits(image_emb, all_texts, temperature), labels, reduction="none"
    )
    t2i = F.cross_entropy(
        similarity_logits(text_emb, all_images, temperature), labels, reduction="none"
    )
    return layout.global_mean(i2t + t2i) / 2
