"""``clip``: the 1-to-1 symmetric InfoNCE baseline every method is compared against.

Per step, each image is paired with the caption of ONE of its languages, drawn uniformly among
the languages it has; the loss is symmetric InfoNCE over the (global) batch with a learnable
temperature.

``projection: none`` uses the encoders' own embeddings (a pretrained dual encoder's, whose towers
already project into its joint space) instead of a new linear head; ``lit: true`` is LiT (Zhai et
al. 2022, "LiT: Zero-Shot Transfer with Locked-image text Tuning"): the image tower is locked (no
gradient, eval mode), only the text tower and the temperature train.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ccr.methods.base import RetrievalModule
from ccr.methods.layers.batches import sample_one_language
from ccr.methods.layers.contrastive import LearnableTemperature, info_nce
from ccr.methods.layers.encoders import ImageEncoder, TextEncoder
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.layers.heads import ProjectionHead
from ccr.methods.registry import register


class Normalize(nn.Module):
    """L2-normalise: the head of a tower whose embedding is already in the joint space."""

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=-1)


@register("clip")
class CLIPModule(RetrievalModule):
    """Image and text encoders, one projection each into ``embed_dim``, learnable temperature."""

    caption_length_invariant = True  # masked encoders, no draws over token positions
    supports_grad_cache = True

    def __init__(self, method, optim, data, evaluation):
        super().__init__(method, optim, data, evaluation)
        method, data = self.method_cfg, self.data_info
        self.image_encoder = ImageEncoder.from_config(method.image_encoder, data)
        self.text_encoder = TextEncoder.from_config(method.text_encoder, data)
        projection = method.projection
        if projection == "linear":
            self.image_proj = ProjectionHead(self.image_encoder.out_dim, method.embed_dim)
            self.text_proj = ProjectionHead(self.text_encoder.out_dim, method.embed_dim)
        elif projection == "none":
            if self.image_encoder.out_dim != self.text_encoder.out_dim:
                raise ValueError(
                    f"method.projection=none needs encoders of one width (image "
                    f"{self.image_encoder.out_dim}, text {self.text_encoder.out_dim})"
                )
            self.image_proj, self.text_proj = Normalize(), Normalize()
        else:
            raise ValueError(f"method.projection={projection!r}: expected linear or none")
        self.temperature = LearnableTemperature(**method.temperature)
        self.lit = bool(method.lit)
        if self.lit:
            for param in self.image_tower_parameters():
                param.requires_grad_(False)

    def image_tower_parameters(self):
        """The image encoder's and its head's parameters (what LiT locks)."""
        yield from self.image_encoder.parameters()
        yield from self.image_proj.parameters()

    def train(self, mode: bool = True) -> CLIPModule:
        """LiT keeps the locked image tower in eval mode (no dropout, no batch statistics)."""
        super().train(mode)
        if self.lit:
            self.image_encoder.eval()
            self.image_proj.eval()
        return self

    def encode_images(self, images: Tensor) -> Tensor:
        return self.image_proj(self.image_encoder(images)[:, 0])

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.text_proj(self.text_encoder(input_ids, attention_mask).pooled)

    def contrastive_loss(self, batch: dict) -> Tensor:
        """Symmetric InfoNCE between every image and its caption in one random present language
        (both encoded in ``optim.grad_cache_chunks`` micro-batches)."""
        rows = torch.arange(len(batch["present"]), device=batch["present"].device)
        language = sample_one_language(batch["present"])
        chunks = self.grad_cache_chunks
        text_emb = encode_in_chunks(
            self.encode_texts,
            batch["input_ids"][rows, language],
            batch["attention_mask"][rows, language],
            chunks=chunks,
        )
        image_emb = encode_in_chunks(self.encode_images, batch["images"], chunks=chunks)
        return info_nce(image_emb, text_emb, self.temperature())

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.contrastive_loss(batch)
        self.log("train/temperature", self.temperature().detach(), batch_size=len(batch["present"]))
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:
        """Clamp τ in place to its bounds after each optimiser step (as CLIP clamps its logit
        scale): past a bound the clamped forward has no gradient and τ would stay there."""
        super().optimizer_step(*args, **kwargs)
        self.temperature.clamp_()
