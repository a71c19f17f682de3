"""Frozen pretrained encoders for a cross-encoder's first stage.

A single-stream model has no embedding space of its own to retrieve from; on CPU the suite
re-ranks a first stage's top k with it. Here that first stage reads a pretrained image encoder and
text encoder that never train (as detector features never do), and only the probe heads the method
puts on top learn. Which encoders is the method config's choice (``name: world`` on the synthetic
world, a timm / Hugging Face name elsewhere)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ccr.methods.layers.encoders import ImageEncoder, TextEncoder


class FrozenEncoders(nn.Module):
    """An image and a text encoder, always in eval mode and without gradient."""

    def __init__(self, image: Mapping[str, Any], text: Mapping[str, Any], data: Any):
        super().__init__()
        self.image = ImageEncoder.from_config(image, data).requires_grad_(False).eval()
        self.text = TextEncoder.from_config(text, data).requires_grad_(False).eval()
        self.image_dim, self.text_dim = self.image.out_dim, self.text.out_dim

    def train(self, mode: bool = True) -> FrozenEncoders:
        return super().train(False)

    @torch.no_grad()
    def image_features(self, images: Tensor) -> Tensor:
        """Mean of the encoder's output tokens ``[B, d]``."""
        return self.image(images).mean(1)

    @torch.no_grad()
    def text_features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The encoder's pooled caption state ``[N, d]`` (untagged ``<s> x </s>`` input)."""
        return self.text(input_ids, attention_mask).pooled
