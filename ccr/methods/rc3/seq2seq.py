"""RC3's single-stream encoder–decoder on an mBART backbone (spec docs/specs/rc3.md §2).

One ``transformers.MBartModel`` serves every size: the tiny CPU configuration is built from an
``MBartConfig``, the paper preset loads a local mBART-50 folder. Visual tokens (raw-pixel patches or
precomputed ROI features) enter the same encoder as the words (early fusion, no image transformer):

* text only:   ``[BOS] x_1..x_n [LAN_x]``                  -> TR  = final state at index 0
* image+text:  ``[CLS] v_1..v_k [BOS] x_1..x_n [LAN_x]``  -> VtR = final state at index 0
* combined:    ``[CLS] roi_1..roi_k [SEP] p_1..p_P [BOS] x [LAN_x]``
* decoder:     ``[LAN_y] y_1..y_m`` -> targets ``y_1..y_m [EOS]`` (cross-attends to every encoder state)

The suite's tokenizer writes ``<s> x </s>``; the language tag takes the place of ``</s>`` in source
texts and of ``<s>`` in decoder inputs. Language tags and ``[CLS]``/``[SEP]``/``[SEP']`` are new
rows appended to the token table; ``[CLS]`` starts as a copy of ``<s>``, the separators of ``</s>``.
Token embeddings are scaled by √d, visual tokens are not; positions count over the whole sequence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SPECIALS = ("cls", "sep", "sep2")


@dataclass
class Encoded:
    """Final encoder states ``[N, S, d]`` and their attention mask ``[N, S]`` (True on real)."""

    states: Tensor
    mask: Tensor

    @property
    def pooled(self) -> Tensor:
        """The state at index 0: TR for text-only inputs, VtR for fused ones."""
        return self.states[:, 0]


WORLD = "world"
ARCHITECTURE = {
    "d_model": "d_model",
    "heads": "encoder_attention_heads",
    "ffn_dim": "encoder_ffn_dim",
    "encoder_layers": "encoder_layers",
    "decoder_layers": "decoder_layers",
}


def world_backbone(backbone: Mapping[str, Any], data: Any) -> dict[str, Any]:
    """``backbone`` with ``pretrained: world`` (the synthetic world's pretrained tiny mBART,
    ``DataInfo.backbones["seq2seq"]``) turned into its local folder; other settings as they are."""
    backbone = dict(backbone)
    if backbone.get("pretrained") != WORLD:
        return backbone
    provided = getattr(data, "backbones", None) or {}
    if "seq2seq" not in provided:
        raise ValueError(
            "method.backbone.pretrained=world is the synthetic world's pretrained mBART, "
            "which this data does not provide (only data=synthetic with data.backbones "
            "set); name a local mBART folder or null (random init)"
        )
    folder = provided["seq2seq"]["pretrained"]
    config = json.loads((Path(folder) / "config.json").read_text())
    differing = [
        f"{key}={backbone[key]} (world mBART: {config[field]})"
        for key, field in ARCHITECTURE.items()
        if key in backbone and backbone[key] != config[field]
    ]
    if differing:
        raise ValueError(
            f"method.backbone: {', '.join(differing)}; with pretrained=world the "
            f"world mBART fixes the architecture"
        )
    return {**backbone, "pretrained": folder}


def build_mbart(
    backbone: Mapping[str, Any],
    vocab_size: int,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
):
    """An ``MBartModel``: random init from the tiny fields of ``backbone``, or the local folder
    ``backbone.pretrained`` (``save_pretrained`` layout; nothing is downloaded)."""
    from transformers import MBartConfig, MBartModel

    pretrained = backbone.get("pretrained")
    if pretrained:
        if not Path(str(pretrained)).is_dir():
            raise FileNotFoundError(
                f"method.backbone.pretrained {pretrained!r}: not a local folder with an mBART "
                f"checkpoint (save_pretrained layout); nothing is downloaded"
            )
        return MBartModel.from_pretrained(str(pretrained))
    config = MBartConfig(
        vocab_size=vocab_size,
        d_model=backbone["d_model"],
        encoder_layers=backbone["encoder_layers"],
        decoder_layers=backbone["decoder_layers"],
        encoder_attention_heads=backbone["heads"],
        decoder_attention_heads=backbone["heads"],
        encoder_ffn_dim=backbone["ffn_dim"],
        decoder_ffn_dim=backbone["ffn_dim"],
        max_position_embeddings=backbone["max_positions"],
        dropout=backbone["dropout"],
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        scale_embedding=True,
        init_std=backbone["init_std"],
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    return MBartModel(config)


class VisualTokenizer(nn.Module):
    """Images or ROI features -> visual tokens ``[B, k, d]`` (spec §2.3); no transformer.

    Patch: the image is cut into ``patch_size`` squares of raw pixels, ``patch_embed`` then
    ``patch_proj`` map each to d. ROI: ``roi_proj`` maps each precomputed region feature to d.
    """

    def __init__(self, d_model: int, patch_size: int, patch_embed_dim: int, roi_dim: int | None):
        super().__init__()
        self.patch_size = patch_size
        self.patch_embed = nn.Linear(3 * patch_size * patch_size, patch_embed_dim)
        self.patch_proj = nn.Linear(patch_embed_dim, d_model)
        # only when ROI features are read: an unused layer would stall DDP's gradient reduction
        self.roi_proj = nn.Linear(roi_dim, d_model) if roi_dim else None

    def patches(self, images: Tensor) -> Tensor:
        """``[B,3,H,W]`` -> ``[B, (H/p)(W/p), d]``, patches in row-major order."""
        p = self.patch_size
        if images.shape[-1] % p or images.shape[-2] % p:
            raise ValueError(
                f"image side {tuple(images.shape[-2:])} is not a multiple of patch {p}"
            )
        pixels = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)  # [B, P, 3p²]
        return self.patch_proj(self.patch_embed(pixels))

    def rois(self, features: Tensor) -> Tensor:
        """``[B, k, roi_dim]`` -> ``[B, k, d]``."""
        if self.roi_proj is None:
            raise ValueError("this model reads no ROI features (method.visual.strict_input=patch)")
        return self.roi_proj(features)


class SingleStreamSeq2Seq(nn.Module):
    """The mBART encoder–decoder with RC3's inputs, tags, visual tokens and output heads."""

    def __init__(
        self,
        backbone: Mapping[str, Any],
        languages: Sequence[str],
        vocab_size: int,
        pad_token_id: int,
        bos_token_id: int,
        eos_token_id: int,
        roi_dim: int | None,
    ):
        super().__init__()
        self.languages = list(languages)
        self.model = build_mbart(backbone, vocab_size, pad_token_id, bos_token_id, eos_token_id)
        self.pad_token_id, self.bos_token_id, self.eos_token_id = (
            pad_token_id,
            bos_token_id,
            eos_token_id,
        )
        d = self.model.config.d_model
        base = vocab_size
        self.tag_ids = {lang: base + i for i, lang in enumerate(self.languages)}
        self.special_ids = {name: base + len(self.languages) + i for i, name in enumerate(SPECIALS)}
        self._grow_vocabulary(base + len(self.languages) + len(SPECIALS))
        self.register_buffer("final_logits_bias", torch.zeros(self.vocab_size), persistent=True)
        self.visual = VisualTokenizer(
            d, backbone["patch_size"], backbone["patch_embed_dim"], roi_dim
        )
        self.d_model = d

    @property
    def vocab_size(self) -> int:
        return self.model.shared.num_embeddings

    def _grow_vocabulary(self, size: int) -> None:
        """Append the language tags and specials; [CLS] copies <s>, [SEP]/[SEP'] copy </s>."""
        have = self.model.shared.num_embeddings
        if have != min(self.tag_ids.values()):
            raise ValueError(
                f"the mBART checkpoint has {have} token rows but the data tokenizer has "
                f"{min(self.tag_ids.values())}: use the checkpoint's tokenizer (data.tokenizer.name)"
            )
        self.model.resize_token_embeddings(size, mean_resizing=False)
        weight = self.model.shared.weight
        with torch.no_grad():
            weight[self.special_ids["cls"]] = weight[self.bos_token_id]
            weight[self.special_ids["sep"]] = weight[self.eos_token_id]
            weight[self.special_ids["sep2"]] = weight[self.eos_token_id]

    # ---- inputs -----------------------------------------------------------------------------

    def tag_source(self, input_ids: Tensor, attention_mask: Tensor, language: str) -> Tensor:
        """``<s> x </s>`` -> ``<s> x [LAN]``: the tag replaces the last real token."""
        last = attention_mask.long().sum(1).clamp_min(1) - 1
        tagged = input_ids.clone()
        tagged[torch.arange(len(tagged), device=tagged.device), last] = self.tag_ids[language]
        return tagged

    def embed(self, ids: Tensor) -> Tensor:
        """Scaled token embeddings (× √d when the backbone scales them)."""
        return self.model.shared(ids)

    def encode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        visual: Tensor | None = None,
        visual_mask: Tensor | None = None,
    ) -> Encoded:
        """Text only (``visual`` None) or ``[CLS] visual text`` through the shared encoder."""
        embeds, mask = self.embed(input_ids), attention_mask.bool()
        if visual is not None:
            n = len(input_ids)
            cls = self.embed(input_ids.new_full((n, 1), self.special_ids["cls"]))
            if visual_mask is None:
                visual_mask = mask.new_ones(visual.shape[:2])
            embeds = torch.cat([cls, visual.to(embeds.dtype), embeds], 1)
            mask = torch.cat([mask.new_ones(n, 1), visual_mask.bool(), mask], 1)
        states = self.model.encoder(
            inputs_embeds=embeds, attention_mask=mask.long()
        ).last_hidden_state
        return Encoded(states, mask)

    def combined_tokens(self, roi_tokens: Tensor, patch_tokens: Tensor) -> Tensor:
        """``roi [SEP] patches`` (Combined input, spec §2.2)."""
        n = len(roi_tokens)
        sep = self.embed(torch.full((n, 1), self.special_ids["sep"], device=roi_tokens.device))
        return torch.cat([roi_tokens, sep, patch_tokens], 1)

    # ---- decoder ----------------------------------------------------------------------------

    def lm_logits(self, states: Tensor) -> Tensor:
        """mBART's tied LM head: shared embedding matrix + ``final_logits_bias``."""
        return F.linear(states, self.model.shared.weight) + self.final_logits_bias

    def translation_nll(
        self, encoded: Encoded, target_ids: Tensor, target_mask: Tensor, language: str
    ) -> tuple[Tensor, Tensor]:
        """Per-token NLL ``[N, T]`` of ``y_1..y_m [EOS]`` given ``[LAN_y] y_1..y_m`` and the encoder
        states, and the mask ``[N, T]`` of the real target tokens (the caller takes the token mean,
        over the global batch under DDP)."""
        decoder_in = target_ids.clone()
        decoder_in[:, 0] = self.tag_ids[language]
        decoder_in, decoder_mask = decoder_in[:, :-1], target_mask[:, :-1]
        targets = target_mask[:, 1:].bool()
        states = self.model.decoder(
            input_ids=decoder_in,
            attention_mask=decoder_mask.long(),
            encoder_hidden_states=encoded.states,
            encoder_attention_mask=encoded.mask.long(),
        ).last_hidden_state
        logits = self.lm_logits(states).float()
        nll = F.cross_entropy(logits.transpose(1, 2), target_ids[:, 1:], reduction="none")
        return nll.masked_fill(~targets, 0.0), targets
