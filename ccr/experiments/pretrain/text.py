"""Pretrain the world's multilingual text encoder: a tiny XLM-R trained, as XLM is, with masked
language modelling (MLM) on single captions of every language and translation language modelling
(TLM) on a caption concatenated with its translation, so masked words can be read off the other
language. It learns from the world's ``pretrain`` scenes only, never from the retrieval splits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM

from ccr.datamodules.records import Record
from ccr.datamodules.tokenization import Tokenizer

IGNORE = -100
FINE_TUNING_DROPOUT = 0.1  # XLM-R's hidden and attention dropout, which the saved config carries


@dataclass(frozen=True)
class TextRecipe:
    """Architecture and schedule of the text backbone (``data.backbones.text``)."""

    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    intermediate_size: int = 256
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1.0e-3
    warmup_steps: int = 100
    mask_probability: float = 0.15
    tlm_share: float = 0.5  # chance that a step trains on translation pairs (TLM) instead of MLM
    translation_ranking: float = 1.0  # weight of the in-batch translation-ranking loss
    ranking_temperature: float = 0.05
    dropout: float = 0.0  # while pretraining (the saved config carries XLM-R's for fine-tuning)


class CaptionTable:
    """Every pretrain caption tokenised once: ``ids[record, language, k]`` without padding."""

    def __init__(
        self, records: list[Record], languages: list[str], tokenizer: Tokenizer, max_length: int
    ):
        self.languages = languages
        texts = [t for r in records for lang in languages for t in r.captions[lang]]
        tokens = tokenizer(texts, max_length)
        lengths = tokens["attention_mask"].sum(1).tolist()
        flat = [row[:n] for row, n in zip(tokens["input_ids"].tolist(), lengths, strict=True)]
        per_record = len(languages) * len(records[0].captions[languages[0]])
        self.rows = [flat[i : i + per_record] for i in range(0, len(flat), per_record)]
        self.captions = per_record // len(languages)

    def ids(self, record: int, language: int, k: int) -> list[int]:
        return self.rows[record][language * self.captions + k]


def build_text_model(recipe: TextRecipe, tokenizer: Tokenizer, max_length: int):
    """A random-init XLM-R masked LM whose vocabulary and special ids are the data tokenizer's;
    its position table fits a TLM pair (two captions of ``max_length``)."""
    config = XLMRobertaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=2 * max_length + tokenizer.pad_token_id + 1,
        type_vocab_size=1,
        hidden_dropout_prob=recipe.dropout,
        attention_probs_dropout_prob=recipe.dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return XLMRobertaForMaskedLM(config)


def pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence in one tensor construction (a copy per row would cost
    a tenth of a training step)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], dtype=torch.long)
    return ids, (ids != pad_id).long()


def mask_for_mlm(
    ids: torch.Tensor,
    special: torch.Tensor,
    recipe: TextRecipe,
    tokenizer: Tokenizer,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: ``mask_probability`` of the ordinary tokens are predicted; of those 80 % become
    <mask>, 10 % a random token and 10 % stay. At least one token per row is predicted."""
    chosen = (torch.rand(ids.shape, generator=generator) < recipe.mask_probability) & ~special
    first = (~special).float().argmax(1)
    chosen[torch.arange(len(ids)), first] |= ~chosen.any(1)
    labels = ids.masked_fill(~chosen, IGNORE)
    roll = torch.rand(ids.shape, generator=generator)
    inputs = ids.masked_fill(chosen & (roll < 0.8), tokenizer.mask_token_id)
    random_ids = torch.randint(tokenizer.vocab_size, ids.shape, generator=generator)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs = torch.where(swap, random_ids, inputs)
    return inputs, labels


def masked_lm_loss(
    model: XLMRobertaForMaskedLM,
    inputs: torch.Tensor,
    attention: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """Cross-entropy at the predicted positions only (the vocabulary projection of every other
    position would be most of the step's cost and add nothing)."""
    states = model.roberta(input_ids=inputs, attention_mask=attention).last_hidden_state
    chosen = labels != IGNORE
    return F.cross_entropy(model.lm_head(states[chosen]), labels[chosen])


def sample_batch(
    table: CaptionTable, tlm: bool, batch_size: int, rng: random.Random
) -> list[list[int]]:
    """MLM: random captions of random languages. TLM: a caption followed by its translation
    (the second's <s> dropped), two different languages of the same scene and caption index."""
    sequences = []
    for _ in range(batch_size):
        record, k = rng.randrange(len(table.rows)), rng.randrange(table.captions)
        if tlm:
            a, b = rng.sample(range(len(table.languages)), 2)
            sequences.append(table.ids(record, a, k) + table.ids(record, b, k)[1:])
        else:
            sequences.append(table.ids(record, rng.randrange(len(table.languages)), k))
    return sequences


def sample_translations(
    table: CaptionTable, batch_size: int, rng: random.Random
) -> tuple[list[list[int]], list[list[int]]]:
    """``batch_size`` captions of distinct scenes and their translations into another language."""
    sources, targets = [], []
    for record in rng.sample(range(len(table.rows)), min(batch_size, len(table.rows))):
        k = rng.randrange(table.captions)
        a, b = rng.sample(range(len(table.languages)), 2)
        sources.append(table.ids(record, a, k))
        targets.append(table.ids(record, b, k))
    return sources, targets


def mean_pooled(
    model: XLMRobertaForMaskedLM, ids: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    states = model.roberta(input_ids=ids, attention_mask=attention).last_hidden_state
    weights = attention.unsqueeze(-1).float()
    return F.normalize((states * weights).sum(1) / weights.sum(1), dim=-1)


def translation_ranking_loss(
    model: XLMRobertaForMaskedLM,
    table: CaptionTable,
    recipe: TextRecipe,
    pad_id: int,
    rng: random.Random,
) -> torch.Tensor:
    """Symmetric in-batch InfoNCE between captions and their translations."""
    sources, targets = sample_translations(table, recipe.batch_size, rng)
    a = mean_pooled(model, *pad(sources, pad_id))
    b = mean_pooled(model, *pad(targets, pad_id))
    logits = a @ b.T / recipe.ranking_temperature
    labels = torch.arange(len(a))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def pretrain_text(
    records: list[Record],
    languages: list[str],
    tokenizer: Tokenizer,
    max_length: int,
    recipe: TextRecipe,
    seed: int,
) -> tuple[XLMRobertaForMaskedLM, float]:
    """Train the masked LM for ``recipe.steps`` steps; returns it (in eval mode) and the mean MLM
    loss of the last 100 steps. Pretraining runs at ``recipe.dropout`` (none by default: dropout
    was 30 % of a step's time on CPU, and 10k scenes of short captions do not overfit 1000
    steps); the returned config asks XLM-R's dropout of whoever fine-tunes the saved model."""
    torch.manual_seed(seed)
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    table = CaptionTable(records, languages, tokenizer, max_length)
    model = build_text_model(recipe, tokenizer, max_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(
            (step + 1) / max(recipe.warmup_steps, 1), max(0.05, 1 - step / max(recipe.steps, 1))
        ),
    )
    specials = torch.tensor(
        [tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    )
    losses = []
    model.train()
    for _ in range(recipe.steps):
        tlm = len(languages) > 1 and rng.random() < recipe.tlm_share
        ids, attention = pad(
            sample_batch(table, tlm, recipe.batch_size, rng), tokenizer.pad_token_id
        )
        inputs, labels = mask_for_mlm(ids, torch.isin(ids, specials), recipe, tokenizer, generator)
        loss = masked_lm_loss(model, inputs, attention, labels)
        losses.append(loss.item())
        if recipe.translation_ranking > 0 and len(languages) > 1:
            ranking = translation_ranking_loss(model, table, recipe, tokenizer.pad_token_id, rng)
            loss = loss + recipe.translation_ranking * ranking
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = (
        FINE_TUNING_DROPOUT
    )
    tail = losses[-100:]
    return model.eval(), sum(tail) / max(len(tail), 1)
