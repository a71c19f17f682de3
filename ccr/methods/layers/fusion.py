"""Cross-modal fusion: text tokens attend to image tokens (the image side is never updated)."""

from __future__ import annotations

from torch import Tensor, nn


class FusionLayer(nn.Module):
    """Text self-attention -> cross-attention (queries: text, keys/values: image) -> FFN, each
    with a residual and a post-LayerNorm, as in BERT/XLM-R layers (so such layers can seed it)."""

    def __init__(
        self, width: int, image_dim: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0
    ):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(
            width, heads, dropout=dropout, batch_first=True, kdim=image_dim, vdim=image_dim
        )
        self.ffn = nn.Sequential(
            nn.Linear(width, int(width * mlp_ratio)),
            nn.GELU(),
            nn.Linear(int(width * mlp_ratio), width),
        )
        self.norm_self, self.norm_cross, self.norm_ffn = (
            nn.LayerNorm(width),
            nn.LayerNorm(width),
            nn.LayerNorm(width),
        )
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, text: Tensor, text_pad: Tensor, image: Tensor, image_pad: Tensor | None
    ) -> Tensor:
        attended = self.self_attn(text, text, text, key_padding_mask=text_pad, need_weights=False)[
            0
        ]
        text = self.norm_self(text + self.dropout(attended))
        attended = self.cross_attn(
            text, image, image, key_padding_mask=image_pad, need_weights=False
        )[0]
        text = self.norm_cross(text + self.dropout(attended))
        return self.norm_ffn(text + self.dropout(self.ffn(text)))


class FusionEncoder(nn.Module):
    """``(text_states [N,L,Dt], text_mask [N,L], image_states [N,1+P,Dv], image_mask) -> [N,L,Dt]``.

    Masks are True on real tokens; ``image_mask`` None means every image token is real.
    """

    def __init__(
        self,
        width: int,
        image_dim: int,
        layers: int = 2,
        heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            FusionLayer(width, image_dim, heads, mlp_ratio, dropout) for _ in range(layers)
        )
        self.out_dim = width

    def forward(
        self,
        text_states: Tensor,
        text_mask: Tensor,
        image_states: Tensor,
        image_mask: Tensor | None = None,
    ) -> Tensor:
        text_pad = ~text_mask.bool()
        image_pad = None if image_mask is None else ~image_mask.bool()
        for layer in self.layers:
            text_states = layer(text_states, text_pad, image_states, image_pad)
        return text_states
