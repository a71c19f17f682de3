"""CL2CM's training view: triples (image, source caption, its translation) (spec cl2cm.md §4).

Caption i of a target language is the translation of source caption i (the synthetic world
realises one plan per index in every language, ``mt_noise`` garbling the non-English ones; real
MT caption files are line-parallel). Every (record, source caption i, target language) with both
captions is one triple, so every English caption yields its own triple per target language.
Weakly aligned records (whose languages describe different things) are left out, and counted.

A streamed training split (``data=shards``) gives the same triples through the shard stream
(``TripleStream``): each sample expands into its triples before a slot's shuffle buffer, so the
stream's guarantees (equal batches on every rank, dropped samples counted, exact resume) hold for
triples, and an epoch of one slot with a buffer of one is the map-style triple index in order.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from .datamodule import training_loader
from .records import Record
from .shards import (
    CAPTIONS,
    ShardIndex,
    ShardStream,
    StreamLoader,
    decode_record,
    metadata_samples,
    requested,
)
from .tokenization import Tokenizer

if TYPE_CHECKING:
    from .datamodule import CCRDataModule


def record_triples(record: Record, source: str, targets: list[str]) -> list[tuple[int, str]]:
    """(caption index, target language) of every triple of one record, language by language."""
    return [
        (i, language)
        for language in targets
        for i in range(
            min(len(record.captions.get(source, [])), len(record.captions.get(language, [])))
        )
    ]


def triple_index(
    records: list[Record], source: str, targets: list[str]
) -> list[tuple[int, int, str]]:
    """(record index, caption index, target language) of every triple, in record order."""
    return [
        (r, i, language)
        for r, record in enumerate(records)
        for i, language in record_triples(record, source, targets)
    ]


def is_weak(record: Record) -> bool:
    """Whether the record's languages describe different things (not translations)."""
    return record.extras.get("alignment") == "weak"


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
    loader: the global-batch losses need equal batch sizes on every process); streamed from its
    shards when the split is (``data=shards``)."""
    targets = resolve_targets(datamodule, source, targets)
    if datamodule.is_sharded:
        return triple_stream_loader(datamodule, source, targets)
    records = datamodule.records("train")
    strict = [r for r in records if not is_weak(r)]
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
    return training_loader(  # seeded by (seed, epoch): a killed run resumes at the same triple
        TripleDataset(strict, index, source, datamodule.image_root, images),
        datamodule.seed,
        batch_size=int(datamodule.cfg.batch_size),
        drop_last=True,
        persistent_workers=loader["num_workers"] > 0,
        **loader,
        collate_fn=TripleCollate(datamodule.tokenizer, datamodule.info.max_length),
    )


# ---- streamed from shards ------------------------------------------------------------------------


def sample_record(
    sample: dict, caption_language: str | None, languages: Sequence[str]
) -> tuple[Record, bytes] | str:
    """A raw sample's record (its non-empty captions in ``languages``, as validation keeps them)
    and encoded image; or, when its metadata does not decode, why, naming the sample. Reads the
    ``.json`` only, not the image."""
    try:
        record, image = decode_record(sample, caption_language)
    except ValueError as error:
        return str(error)
    return requested(record, languages), image


def strict_triples(record: Record, source: str, targets: list[str]) -> list[tuple[int, str]]:
    """The record's triples, none when it is weakly aligned."""
    return [] if is_weak(record) else record_triples(record, source, targets)


@dataclass(frozen=True)
class TripleCensus:
    """What a shard split holds for CL2CM: triples per shard (in index order), samples, weakly
    aligned samples (no triples) and samples whose metadata does not decode (one dropped row
    each, where the stream meets them)."""

    triples: tuple[int, ...]
    samples: int
    weak: int
    unreadable: int


def triple_census(
    index: ShardIndex, languages: Sequence[str], source: str, targets: list[str]
) -> TripleCensus:
    """The split's ``TripleCensus`` (``shard_metadata``: no image is read), counted once per
    process for a given state of the shard files."""
    stats = [(name, (index.folder / name).stat()) for name in index.files]
    listing = tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)
    return _triple_census(index, listing, tuple(languages), source, tuple(targets))


@functools.cache
def _triple_census(
    index: ShardIndex, listing: tuple, languages: tuple, source: str, targets: tuple
) -> TripleCensus:
    per_shard, samples, weak, unreadable = [], 0, 0, 0
    for records in shard_metadata(index, languages):
        count = 0
        for record in records:
            samples += 1
            if isinstance(record, str):
                unreadable, count = unreadable + 1, count + 1
            else:
                weak += is_weak(record)
                count += len(strict_triples(record, source, list(targets)))
        per_shard.append(count)
    return TripleCensus(tuple(per_shard), samples, weak, unreadable)


def shard_metadata(index: ShardIndex, languages: Sequence[str]) -> Iterator[Iterator[Record | str]]:
    """Per shard, each sample's record without its image (or why its metadata does not decode).

    A split written without alignment marks (``shards.json`` ``alignment: false``) is read from
    its ``captions.jsonl``, one line per sample; otherwise the marks are only in the samples'
    ``.json`` members, read from the tars (every member header parsed, images skipped by
    seeking), about 15 times slower (docs/scale.md)."""
    if index.alignment or not (index.folder / CAPTIONS).is_file():
        for name in index.files:
            yield (
                found if isinstance(found, str) else found[0]
                for found in (
                    sample_record(sample, index.caption_language, languages)
                    for sample in metadata_samples(index.folder / name)
                )
            )
        return
    rows = index.caption_rows()
    for count in index.samples:
        yield (requested(Record("", None, row, {}), languages) for row in islice(rows, count))


class TripleStream(ShardStream):
    """CL2CM's triples streamed from a shard split: ``ShardStream`` whose units are triples, each
    sample expanded into its own (``strict_triples``) before its slot's shuffle buffer; the epoch
    is sized by the triples the shards hold (``triple_census``). Items are ``TripleDataset``'s.

    A sample whose metadata does not decode is one unit, dropped where it lands; one whose image
    does not decode drops each of its triples. A replay before a resumed batch expands the
    samples again (their ``.json``), decoding no image."""

    unit = "triple"

    def __init__(
        self,
        index: ShardIndex,
        *,
        source: str,
        targets: list[str],
        languages: Sequence[str],
        transform: Callable,
        collate: Callable[[list[dict]], dict],
        **stream,
    ):
        self.source, self.targets = source, list(targets)
        self.census = triple_census(index, languages, source, self.targets)
        super().__init__(
            index,
            languages=languages,
            transform=transform,
            collate=collate,
            label_index={},
            **stream,
        )

    def unit_counts(self) -> tuple[int, ...]:
        return self.census.triples

    def units(self, samples: Iterator[dict]) -> Iterator[tuple | str]:
        for sample in samples:
            found = sample_record(sample, self.index.caption_language, self.languages)
            if isinstance(found, str):
                yield found
                continue
            record, image = found
            where = f"{sample['__url__']}: sample {sample['__key__']}"
            for i, language in strict_triples(record, self.source, self.targets):
                yield record, image, where, i, language

    def item(self, unit: tuple | str, slot: int, position: int) -> dict | str:
        """A triple's item, or (when it is dropped) why, naming its sample."""
        if isinstance(unit, str):
            return unit
        record, image, where, i, language = unit
        try:
            pixels = self.transform(io.BytesIO(image))
        except Exception as error:  # noqa: BLE001 - an undecodable image is dropped and counted
            return f"{where}: {error}"
        return {
            "image": pixels,
            "source": record.captions[self.source][i],
            "target": record.captions[language][i],
            "language": language,
            "id": record.id,
        }


def triple_stream_loader(
    datamodule: CCRDataModule, source: str, targets: list[str]
) -> StreamLoader:
    """Batches of triples streamed from the train split's shards (``TripleStream``), with the
    datamodule's stream settings (``data.stream_slots``, ``data.shuffle_buffer``)."""
    cfg, index = datamodule.cfg, datamodule.shard_index("train")
    stream = TripleStream(
        index,
        source=source,
        targets=targets,
        languages=datamodule.languages,
        transform=datamodule.loader_transform(),
        collate=TripleCollate(datamodule.tokenizer, datamodule.info.max_length),
        batch_size=int(cfg.batch_size),
        seed=datamodule.seed,
        buffer=int(cfg.shuffle_buffer),
        slots=int(cfg.stream_slots),
        num_workers=int(cfg.num_workers),
    )
    census = stream.census
    rank_zero_info(
        f"cl2cm triples: {sum(census.triples)} ({source} -> {targets}) from {census.samples} "
        f"samples of {index.folder}; {census.weak} weakly aligned samples left out"
        + (
            f"; {census.unreadable} samples whose metadata does not decode (one dropped row each)"
            if census.unreadable
            else ""
        )
        + f"; {len(stream)} batches per epoch"
    )
    if not sum(census.triples):
        raise ValueError(
            f"no training triples: no sample of {index.folder} has captions in {source!r} and "
            f"one of {targets}"
        )
    return StreamLoader(stream, int(cfg.num_workers))
