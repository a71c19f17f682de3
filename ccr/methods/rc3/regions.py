"""Pseudo-ROI features: region features from a frozen pretrained image backbone (spec rc3 §2.8).

RC3 reads detector ROI features as an input. Where a dataset ships none, the spec's second choice
is a grid of features from a frozen, locally available image backbone: every patch (or CNN grid
cell) state becomes one region. On the synthetic world that backbone is the world's pretrained
tiny ViT (``name: world``); on real data a local timm model (e.g. ResNet-50's C5 grid).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ccr.methods.layers.encoders import ImageEncoder


class GridRegions(nn.Module):
    """Images ``[B,3,H,W]`` -> region features ``[B, k, dim]``: the grid token states of a frozen
    image backbone (its global token dropped). Never trained and always in eval mode, as detector
    features are fixed inputs the method does not learn."""

    def __init__(self, encoder: ImageEncoder):
        super().__init__()
        self.encoder = encoder.requires_grad_(False).eval()
        self.dim = encoder.out_dim

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], data: Any) -> GridRegions:
        return cls(ImageEncoder.from_config(cfg, data))

    def train(self, mode: bool = True) -> GridRegions:
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        return self.encoder(images)[:, 1:]
