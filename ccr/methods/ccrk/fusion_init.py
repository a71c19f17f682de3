"""Seed a :class:`FusionEncoder` from BERT/XLM-R transformer layers (spec ccrk.md §2).

CCRk's fusion encoder starts from the upper layers of XLM-R-large: each fusion layer takes the self-
attention, its output LayerNorm and the FFN of one XLM-R layer, while the cross-attention (and its
LayerNorm) starts random. The fusion layers use the same post-LayerNorm layout, so the copy is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ccr.methods.layers.fusion import FusionEncoder, FusionLayer


@torch.no_grad()
def copy_hf_layer(target: FusionLayer, source: nn.Module) -> None:
    """Copy one Hugging Face BERT-family layer (``attention``, ``intermediate``, ``output``)."""
    attention = source.attention.self
    target.self_attn.in_proj_weight.copy_(
        torch.cat([attention.query.weight, attention.key.weight, attention.value.weight])
    )
    target.self_attn.in_proj_bias.copy_(
        torch.cat([attention.query.bias, attention.key.bias, attention.value.bias])
    )
    target.self_attn.out_proj.load_state_dict(source.attention.output.dense.state_dict())
    target.norm_self.load_state_dict(source.attention.output.LayerNorm.state_dict())
    target.ffn[0].load_state_dict(source.intermediate.dense.state_dict())
    target.ffn[2].load_state_dict(source.output.dense.state_dict())
    target.norm_ffn.load_state_dict(source.output.LayerNorm.state_dict())


def fusion_from_hf_layers(
    layers: Sequence[nn.Module], width: int, image_dim: int, heads: int, mlp_ratio: float
) -> FusionEncoder:
    """A FusionEncoder with one fusion layer per given HF layer, seeded from it."""
    fusion = FusionEncoder(width, image_dim, layers=len(layers), heads=heads, mlp_ratio=mlp_ratio)
    for target, source in zip(fusion.layers, layers, strict=True):
        copy_hf_layer(target, source)
    return fusion
