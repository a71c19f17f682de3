"""Stage-1 text-only training of a multilingual text encoder (mCLIP §3.3): a translation decoder
over the encoder's token states, its sentence-level NLL, and the contrastive translation loss (CTL)
between mean-pooled parallel sentences.

Token ids follow the suite's convention: `<cls> y <eos>` right-padded, so a target sequence gives
the decoder input `[<2tgt>] + y` and the gold `y + [<eos>]` by shifting one position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ccr.methods.layers.batches import trim_padding
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.layers.encoders import TextEncoder
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.mclip.distillation import freeze


def masked_mean(states: Tensor, mask: Tensor) -> Tensor:
    """Mean of `states [N, L, D]` over the non-pad positions of `mask [N, L]` (<cls>/<eos>
    included), so extra right padding never changes the result."""
    weights = mask.to(states.dtype).unsqueeze(-1)
    return (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def translation_nll(
    logits: Tensor, gold: Tensor, pad_token_id: int, label_smoothing: float = 0.0
) -> Tensor:
    """Sum of token NLLs over the non-pad gold positions (|y|+1 per sentence), averaged over
    the N sentences, as the paper writes L_NMT."""
    total = F.cross_entropy(
        logits.flatten(0, 1),
        gold.flatten(),
        ignore_index=pad_token_id,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total / gold.size(0)


def sentence_nll(
    logits: Tensor, gold: Tensor, pad_token_id: int, label_smoothing: float = 0.0
) -> Tensor:
    """Per sentence ``[N]``: the sum of its token NLLs over the non-pad gold positions (their mean
    over the sentences is ``translation_nll``)."""
    tokens = F.cross_entropy(
        logits.flatten(0, 1),
        gold.flatten(),
        ignore_index=pad_token_id,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return tokens.view(gold.shape).sum(1)


def contrastive_translation_loss(
    src_states: Tensor,
    src_mask: Tensor,
    tgt_states: Tensor,
    tgt_mask: Tensor,
    temperature: float = 0.1,
) -> Tensor:
    """L_CTL: symmetric InfoNCE between L2-normalised masked means of source and target states,
    other sentences of the batch as negatives."""
    h_src = F.normalize(masked_mean(src_states, src_mask), dim=-1)
    h_tgt = F.normalize(masked_mean(tgt_states, tgt_mask), dim=-1)
    return info_nce(h_src, h_tgt, temperature)


def sinusoidal_positions(length: int, dim: int, device=None) -> Tensor:
    """Fixed sine/cosine position codes `[length, dim]` (the decoder has no learned positions)."""
    position = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )
    codes = torch.zeros(length, dim, device=device)
    codes[:, 0::2] = torch.sin(position * frequency)
    codes[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    return codes


class TranslationDecoder(nn.Module):
    """Pre-LN Transformer decoder whose input and output embeddings are the encoder's (frozen) word
    embedding matrix, passed to `forward`; the start symbol is a trainable target-language tag."""

    def __init__(
        self, languages: list[str], dim: int, layers: int, heads: int, ffn: int, dropout: float
    ):
        super().__init__()
        self.languages = list(languages)
        self.language_tags = nn.Embedding(len(languages), dim)
        nn.init.normal_(self.language_tags.weight, std=dim**-0.5)
        layer = nn.TransformerDecoderLayer(
            dim, heads, ffn, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerDecoder(layer, layers, norm=nn.LayerNorm(dim))
        self.dropout = nn.Dropout(dropout)

    def language_index(self, language: str) -> int:
        if language not in self.languages:
            raise KeyError(
                f"target language {language!r} has no decoder tag; known: {self.languages}"
            )
        return self.languages.index(language)

    def forward(
        self,
        tgt_input_ids: Tensor,
        memory: Tensor,
        memory_mask: Tensor,
        tgt_language: str,
        word_embeddings: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Teacher-forced logits `[N, L-1, V]` and their gold ids `[N, L-1]` for targets
        `<cls> y <eos>` (right-padded), attending to `memory [N, Ls, D]` where `memory_mask`."""
        n, length = tgt_input_ids.shape
        dim = word_embeddings.size(1)
        tag = self.language_tags.weight[self.language_index(tgt_language)]
        tokens = F.embedding(tgt_input_ids[:, 1:-1], word_embeddings)
        inputs = torch.cat([tag.expand(n, 1, dim), tokens], dim=1) * math.sqrt(dim)
        inputs = self.dropout(inputs + sinusoidal_positions(length - 1, dim, inputs.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length - 1, device=inputs.device)
        hidden = self.layers(
            inputs,
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            memory_key_padding_mask=~memory_mask.bool(),
        )
        return hidden @ word_embeddings.T, tgt_input_ids[:, 1:]


def inverse_sqrt_factor(
    step: int, warmup_steps: int, decay_from_step: int, initial_ratio: float
) -> float:
    """LR multiplier of mCLIP's schedules: a linear ramp from `initial_ratio` over `warmup_steps`,
    then `min(1, sqrt(decay_from_step / step))`. Stage 1a and TriKD decay from the end of the
    warm-up; Stage 1b has no warm-up and anchors the decay at step 10."""
    if step < warmup_steps:
        return initial_ratio + (1.0 - initial_ratio) * step / warmup_steps
    return min(1.0, math.sqrt(max(decay_from_step, 1) / max(step, 1)))


def clip_gradient_norm(module: nn.Module, max_norm: float) -> None:
    """Clip the gradient norm of `module`'s trainable parameters (mCLIP clips at 2.0 in every
    stage, whatever the trainer preset says)."""
    torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], max_norm)


def mte_embeddings(mte: TextEncoder) -> nn.Module:
    """The embedding block (word and position embeddings, embedding LayerNorm) of a Hugging Face
    MTE, which Stage 1 keeps frozen; other backends are refused because mCLIP's MTE is XLM-R."""
    model = getattr(mte.backbone, "model", None)
    if model is None or not hasattr(model, "embeddings") or not hasattr(model, "encoder"):
        raise ValueError(
            "mCLIP's multilingual text encoder must be a Hugging Face encoder "
            "(text encoder name 'hf' or 'hf:<name or path>')"
        )
    return model.embeddings


class MTEEnhancement(L.LightningModule):
    """mCLIP Stage 1 on parallel text. `joint=False` (1a): only the decoder and its language tags
    train on L_NMT over the frozen MTE. `joint=True` (1b): the MTE's encoder layers train too, on
    L_NMT + ctl_weight·L_CTL; embeddings stay frozen unless `settings["train_embeddings"]` (only
    sensible for a random-init MTE, whose frozen random embeddings would leave the tied output
    layer nearly flat; the paper freezes XLM-R's pretrained ones).

    Ablations (spec Table 2): `decoder=None` drops L_NMT (1b on L_CTL alone, "- L_NMT");
    `ctl=False` drops L_CTL (1b on L_NMT alone, "- L_CTL"). `teacher` is carried unchanged
    (frozen) so the next stage can be built from this checkpoint.

    `grad_cache_chunks` > 1 (`optim.grad_cache_chunks`) runs the MTE's trained passes and the
    decoder (to each sentence's NLL, so no full-batch logits are kept) in that many micro-batches
    (`encode_in_chunks`); L_CTL still contrasts the whole batch.
    """

    def __init__(
        self,
        mte: TextEncoder,
        decoder: TranslationDecoder | None,
        settings: Mapping[str, Any],
        joint: bool,
        pad_token_id: int,
        teacher: nn.Module | None = None,
        ctl: bool = True,
        grad_cache_chunks: int = 1,
    ):
        super().__init__()
        if decoder is None and not (joint and ctl):
            raise ValueError(
                "Stage 1 without a decoder (no L_NMT) must be the joint stage with L_CTL"
            )
        self.mte, self.decoder, self.teacher = mte, decoder, teacher
        self.settings, self.joint, self.pad_token_id = dict(settings), joint, pad_token_id
        self.ctl, self.grad_cache_chunks = ctl, grad_cache_chunks
        self.mte.requires_grad_(False)
        embeddings = mte_embeddings(mte)  # fails early on a non-XLM-R backend
        if joint:
            self.mte.backbone.model.encoder.requires_grad_(True)
            embeddings.requires_grad_(bool(self.settings.get("train_embeddings", False)))
        if teacher is not None:
            freeze(teacher)

    def frozen_modules(self) -> list[nn.Module]:
        frozen = [] if self.joint else [self.mte]
        return frozen + ([self.teacher] if self.teacher is not None else [])

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.frozen_modules():
            module.eval()
        return self

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        src_ids, src_mask = trim_padding(batch["src_input_ids"], batch["src_attention_mask"])
        tgt_ids, tgt_mask = trim_padding(batch["tgt_input_ids"], batch["tgt_attention_mask"])
        chunks = self.grad_cache_chunks
        with torch.set_grad_enabled(self.joint):
            source = encode_in_chunks(self.mte, src_ids, src_mask, chunks=chunks)
        losses = []
        if self.decoder is not None:
            nmt = self.nmt_loss(tgt_ids, source.states, source.mask, batch["tgt_language"])
            self.log("train/nmt", nmt, batch_size=len(src_ids))
            losses.append(nmt)
        if self.joint and self.ctl:
            target = encode_in_chunks(self.mte, tgt_ids, tgt_mask, chunks=chunks)
            ctl = contrastive_translation_loss(
                source.states,
                source.mask,
                target.states,
                target.mask,
                self.settings["ctl_temperature"],
            )
            self.log("train/ctl", ctl, batch_size=len(src_ids))
            losses.append(self.settings["ctl_weight"] * ctl)
        return sum(losses[1:], losses[0])

    def nmt_loss(self, tgt_ids: Tensor, states: Tensor, mask: Tensor, language: str) -> Tensor:
        """L_NMT of translating the encoded sources into `tgt_ids` (in `language`); under
        grad_cache_chunks each micro-batch goes through the decoder to its sentences' NLLs."""
        word_embeddings = self.mte.input_embeddings().weight
        smoothing = self.settings["label_smoothing"]
        if self.grad_cache_chunks == 1:
            logits, gold = self.decoder(tgt_ids, states, mask, language, word_embeddings)
            return translation_nll(logits, gold, self.pad_token_id, smoothing)

        def per_sentence(ids: Tensor, memory: Tensor, memory_mask: Tensor) -> Tensor:
            logits, gold = self.decoder(ids, memory, memory_mask, language, word_embeddings)
            return sentence_nll(logits, gold, self.pad_token_id, smoothing)

        return encode_in_chunks(
            per_sentence, tgt_ids, states, mask, chunks=self.grad_cache_chunks
        ).mean()

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        clip_gradient_norm(self, self.settings["grad_clip"])

    def configure_optimizers(self):
        s = self.settings
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(
            trainable, lr=s["lr"], betas=tuple(s["betas"]), weight_decay=0.0
        )
        factor = partial(
            inverse_sqrt_factor,
            warmup_steps=s["warmup_steps"],
            decay_from_step=s["decay_from_step"],
            initial_ratio=s["initial_lr"] / s["lr"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
