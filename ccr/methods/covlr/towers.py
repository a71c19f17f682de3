"""An encoder and its width adapter as one module, so a functional call (``torch.func``) can run the
pair with substituted parameters (CoVLR's virtual step: spec §2.2, the adapter belongs to Θ).

The adapter is a linear map to ``width`` when the encoder's width differs, the identity otherwise.
"""

from __future__ import annotations

from torch import Tensor, nn

from ccr.methods.layers.encoders import ImageEncoder, TextEncoder


def adapter(in_dim: int, out_dim: int) -> nn.Module:
    return nn.Identity() if in_dim == out_dim else nn.Linear(in_dim, out_dim)


class ImageTower(nn.Module):
    """Images ``[B,3,H,W]`` -> token states ``[B, 1+P, width]``, the global token first."""

    def __init__(self, encoder: ImageEncoder, width: int):
        super().__init__()
        self.encoder, self.adapter = encoder, adapter(encoder.out_dim, width)

    def forward(self, images: Tensor) -> Tensor:
        return self.adapter(self.encoder(images))


class TextTower(nn.Module):
    """Token ids + mask ``[N, L]`` -> (token states ``[N, L, width]``, pooled ``[N, width]``)."""

    def __init__(self, encoder: TextEncoder, width: int):
        super().__init__()
        self.encoder, self.adapter = encoder, adapter(encoder.out_dim, width)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        out = self.encoder(input_ids, attention_mask)
        return self.adapter(out.states), self.adapter(out.pooled)
