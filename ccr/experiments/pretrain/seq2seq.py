"""Pretrain the world's multilingual encoder–decoder: a tiny mBART trained, as mBART is, to
reconstruct captions of every language from a noised copy (text infilling: spans covering
``mask_ratio`` of the tokens, lengths drawn from Poisson(``span_mean``), each span replaced by one
``<mask>``). RC3 starts from it as the paper starts from mBART-50 (``method.backbone.pretrained:
world``). It learns from the world's ``pretrain`` scenes only, never from the retrieval splits.

The vocabulary is the data tokenizer's, without language tags: RC3 appends its tags and special
rows to the table when it loads the model, as it does for a real checkpoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import MBartConfig, MBartModel

from ccr.datamodules.records import Record
from ccr.datamodules.tokenization import Tokenizer
from ccr.experiments.pretrain.text import CaptionTable, pad


@dataclass(frozen=True)
class Seq2SeqRecipe:
    """Architecture (RC3's tiny size, spec §2.7) and schedule of the world mBART."""

    d_model: int = 64
    heads: int = 4
    ffn_dim: int = 128
    encoder_layers: int = 2
    decoder_layers: int = 1
    max_positions: int = 128  # room for [CLS] + visual tokens + a caption in RC3
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1.0e-3
    warmup_steps: int = 100
    mask_ratio: float = 0.35  # mBART's share of tokens inside masked spans
    span_mean: float = 3.5  # mBART's Poisson λ for span lengths


def build_seq2seq_model(recipe: Seq2SeqRecipe, tokenizer: Tokenizer) -> MBartModel:
    """A random-init mBART whose vocabulary and special ids are the data tokenizer's. Dropout is
    0, RC3's tiny setting (docs/rc3.md), and the saved config keeps it."""
    config = MBartConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=recipe.d_model,
        encoder_layers=recipe.encoder_layers,
        decoder_layers=recipe.decoder_layers,
        encoder_attention_heads=recipe.heads,
        decoder_attention_heads=recipe.heads,
        encoder_ffn_dim=recipe.ffn_dim,
        decoder_ffn_dim=recipe.ffn_dim,
        max_position_embeddings=recipe.max_positions,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return MBartModel(config)


def infill(
    ids: list[int], recipe: Seq2SeqRecipe, mask_id: int, rng: np.random.Generator
) -> list[int]:
    """``<s> x </s>`` with spans of its content replaced by one ``<mask>`` each, until
    ``mask_ratio`` of the content tokens are covered (at least one span)."""
    content = ids[1:-1]
    budget = max(1, round(recipe.mask_ratio * len(content)))
    hidden = np.zeros(len(content), dtype=bool)
    while hidden.sum() < budget:
        length = min(max(1, int(rng.poisson(recipe.span_mean))), budget - int(hidden.sum()))
        start = int(rng.integers(0, max(1, len(content) - length + 1)))
        hidden[start : start + length] = True
    noised, previous_hidden = [], False
    for token, masked in zip(content, hidden, strict=True):
        if not masked:
            noised.append(token)
        elif not previous_hidden:
            noised.append(mask_id)
        previous_hidden = masked
    return [ids[0], *noised, ids[-1]]


def denoising_loss(
    model: MBartModel, sources: list[list[int]], targets: list[list[int]], pad_id: int
) -> torch.Tensor:
    """Token-mean NLL of ``x_1..x_n </s>`` given the noised source, decoder input ``<s> x_1..x_n``
    (the LM head is the tied embedding table, as in mBART)."""
    source, source_mask = pad(sources, pad_id)
    target, target_mask = pad(targets, pad_id)
    states = model(
        input_ids=source,
        attention_mask=source_mask,
        decoder_input_ids=target[:, :-1],
        decoder_attention_mask=target_mask[:, :-1],
    ).last_hidden_state
    logits = F.linear(states, model.shared.weight)
    labels = target[:, 1:].masked_fill(target_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)


def pretrain_seq2seq(
    records: list[Record],
    languages: list[str],
    tokenizer: Tokenizer,
    max_length: int,
    recipe: Seq2SeqRecipe,
    seed: int,
) -> tuple[MBartModel, float]:
    """Train the denoiser for ``recipe.steps`` steps on random captions of random languages;
    returns it (eval mode) and the mean loss of the last 100 steps."""
    torch.manual_seed(seed)
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    table = CaptionTable(records, languages, tokenizer, max_length)
    model = build_seq2seq_model(recipe, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(
            (step + 1) / max(recipe.warmup_steps, 1), max(0.05, 1 - step / max(recipe.steps, 1))
        ),
    )
    losses = []
    model.train()
    for _ in range(recipe.steps):
        targets = [
            table.ids(
                rng.randrange(len(table.rows)),
                rng.randrange(len(languages)),
                rng.randrange(table.captions),
            )
            for _ in range(recipe.batch_size)
        ]
        sources = [infill(t, recipe, tokenizer.mask_token_id, noise) for t in targets]
        loss = denoising_loss(model, sources, targets, tokenizer.pad_token_id)
        losses.append(loss.item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    tail = losses[-100:]
    return model.eval(), sum(tail) / max(len(tail), 1)
