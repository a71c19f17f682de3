"""BERT-style initialisation of newly added modules: truncated normal (std 0.02) weights, zero
biases, LayerNorm (1, 0); pretrained encoders are left alone."""

from __future__ import annotations

from torch import nn


def bert_init_(module: nn.Module, std: float = 0.02) -> None:
    """Re-initialise every Linear, Embedding, MultiheadAttention and LayerNorm inside ``module``."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(sub.weight, std=std, a=-2 * std, b=2 * std)
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.MultiheadAttention):
            for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                weight = getattr(sub, name, None)
                if weight is not None:
                    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)
            if sub.in_proj_bias is not None:
                nn.init.zeros_(sub.in_proj_bias)
        elif isinstance(sub, nn.LayerNorm) and sub.elementwise_affine:
            nn.init.ones_(sub.weight)
            nn.init.zeros_(sub.bias)
