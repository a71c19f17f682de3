"""CL2CM's training view: triples (image, source caption, its translation) (spec cl2cm.md §4).

Caption i of a target language is the translation of source caption i (the synthetic world
realises one plan per index in every language, ``mt_noise`` garbling the non-English ones; real
MT caption files are line-parallel). Every (record, source caption i, target language) with both
captions is one triple, so every English caption yields its own triple per target language.
Weakly aligned records (whose languages describe different things) are left out, and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from .records import Record
from .tokenization import Tokenizer

if TYPE_CHECKING:
    from .datamodule import CCRDataModule


def triple_index(
    records: list[Record], source: str, targets: list[str]
) -> list[tuple[int, int, str]]:
    """(record index, caption index, target language) of every triple, in record order."""
    return [
        (r, i, language)
        for r, record in enumerate(records)
        for language in targets
        for i in range(
            min(len(record.captions.get(source, [])), len(record.captions.get(language, [])))
        )
    ]


class TripleDataset(Dataset):
    """One item per triple: the image, the source caption and its translation."""

    def __init__(
        self,
        records: list[Record],
        index: list[tuple[int, int, str]],
        source: str,
        image_root: Path,
        transform: Callable[[Path], torch.Tensor],
    ):
        self.records, self.index, self.source = records, index, source
        self.image_root, self.transform = image_root, transform

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: int) -> dict:
        r, i, language = self.index[item]
        record = self.records[r]
        return {
            "image": self.transform(self.image_root / record.image),
            "source": record.captions[self.source][i],
            "target": record.captions[language][i],
            "language": language,
            "id": record.id,
        }


class TripleCollate:
    """Batch ``images [B,3,H,W]``, ``src_input_ids``/``src_attention_mask`` and
    ``tgt_input_ids``/``tgt_attention_mask [B,L]``, ``tgt_languages`` and ``ids`` (lists)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, items: list[dict]) -> dict:
        source = self.tokenizer([item["source"] for item in items], self.max_length)
        target = self.tokenizer([item["target"] for item in items], self.max_length)
        return {
            "images": torch.stack([item["image"] for item in items]),
            "src_input_ids": source["input_ids"],
            "src_attention_mask": source["attention_mask"],
            "tgt_input_ids": target["input_ids"],
            "tgt_attention_mask": target["attention_mask"],
            "tgt_languages": [item["language"] for item in items],
            "ids": [item["id"] for item in items],
        }


def resolve_targets(datamodule: CCRDataModule, source: str, targets: list[str] | None) -> list[str]:
    """The target languages: the configured ones other than ``source`` when ``targets`` is None;
    a language that is not configured (or the source itself) is an error."""
    configured = list(datamodule.languages)
    if source not in configured:
        raise ValueError(
            f"CL2CM source language {source!r} is not among data.languages {configured}"
        )
    chosen = [lang for lang in configured if lang != source] if targets is None else list(targets)
    bad = [lang for lang in chosen if lang not in configured or lang == source]
    if bad or not chosen:
        raise ValueError(
            f"method.target_languages {chosen}: each must be a configured language "
            f"other than the source {source!r} (data.languages {configured})"
        )
    return chosen


def triple_dataloader(
    datamodule: CCRDataModule, source: str = "en", targets: list[str] | None = None
) -> DataLoader:
    """Shuffled batches of triples of the training split (full batches only, as every training
    loader: the global-batch losses need equal batch sizes on every process)."""
    targets = resolve_targets(datamodule, source, targets)
    records = datamodule.records("train")
    strict = [r for r in records if r.extras.get("alignment") != "weak"]
    index = triple_index(strict, source, targets)
    rank_zero_info(
        f"cl2cm triples: {len(index)} ({source} -> {targets}) from {len(strict)} records; "
        f"{len(records) - len(strict)} weakly aligned records left out"
    )
    if not index:
        raise ValueError(
            f"no training triples: no train record has captions in {source!r} and one of {targets}"
        )
    images = datamodule.images([datamodule.image_root / r.image for r in strict])
    loader = datamodule.loader
    return DataLoader(
        TripleDataset(strict, index, source, datamodule.image_root, images),
        batch_size=int(datamodule.cfg.batch_size),
        shuffle=True,
        drop_last=True,
        persistent_workers=loader["num_workers"] > 0,
        **loader,
        collate_fn=TripleCollate(datamodule.tokenizer, datamodule.info.max_length),
    )
