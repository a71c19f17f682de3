"""Small output heads: projection into the retrieval space, image-text matching, masked LM."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class ProjectionHead(nn.Module):
    """Linear map into the shared retrieval space; ``normalize`` L2-normalises the output."""

    def __init__(self, in_dim: int, out_dim: int, normalize: bool = True, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim, bias=bias)
        self.normalize = normalize

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear(x)
        return F.normalize(x, dim=-1) if self.normalize else x


class ITMHead(nn.Module):
    """Image-text matching: Linear -> LayerNorm -> GELU -> Linear(2); logit 1 = match."""

    def __init__(self, in_dim: int, hidden_dim: int | None = None):
        super().__init__()
        hidden_dim = hidden_dim or 2 * in_dim
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.LayerNorm(hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, 2),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x)


class MLMHead(nn.Module):
    """Masked-LM head: dense -> GELU -> LayerNorm -> vocabulary decoder.

    ``tie_to`` shares the decoder weight with a token embedding table (its width must match).
    """

    def __init__(self, width: int, vocab_size: int, tie_to: nn.Embedding | None = None):
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.decoder = nn.Linear(width, vocab_size)
        if tie_to is not None:
            if tuple(tie_to.weight.shape) != (vocab_size, width):
                raise ValueError(
                    f"cannot tie MLM decoder [{vocab_size}, {width}] to embeddings "
                    f"{list(tie_to.weight.shape)}"
                )
            self.decoder.weight = tie_to.weight

    def forward(self, states: Tensor) -> Tensor:
        return self.decoder(self.transform(states))
