"""Readers of the public CCR dataset layouts, by name: each turns files on disk into Records.

``read_dataset(name, root, split)`` is the one entry point; nothing after it knows the source
format. ``docs/datasets.md`` gives every dataset's folder layout and image paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ccr.datamodules.readers import cc3m_jsonl, coco_karpathy, iglue_captions, multi30k, wit, xtd10
from ccr.datamodules.records import Record


@dataclass(frozen=True)
class DatasetReader:
    """How to read one dataset: its valid split names, the function reading one split, and
    whether caption i of every language is a translation of caption i of the others
    (``captions_parallel``: training then draws one caption index for all languages)."""

    splits: tuple[str, ...]
    read: Callable[[Path, str], list[Record]]
    captions_parallel: bool


READERS: dict[str, DatasetReader] = {
    "multi30k": DatasetReader(multi30k.TASK1_SPLITS, multi30k.read_task1, True),
    "multi30k_task2": DatasetReader(multi30k.TASK2_SPLITS, multi30k.read_task2, False),
    "xflickrco": DatasetReader(
        iglue_captions.XFLICKRCO_SPLITS, iglue_captions.read_xflickrco, True
    ),
    "flickr30k_iglue": DatasetReader(
        iglue_captions.FLICKR30K_SPLITS, iglue_captions.read_flickr30k, False
    ),
    "wit": DatasetReader(wit.SPLITS, wit.read, False),
    "coco_karpathy": DatasetReader(coco_karpathy.SPLITS, coco_karpathy.read, False),
    "xtd10": DatasetReader(xtd10.SPLITS, xtd10.read, True),
    "cc3m_jsonl": DatasetReader(cc3m_jsonl.SPLITS, cc3m_jsonl.read, True),
}


def names() -> list[str]:
    """Names accepted by ``read_dataset``."""
    return sorted(READERS)


def splits(name: str) -> list[str]:
    """Valid split names of one dataset."""
    return list(_reader(name).splits)


def captions_parallel(name: str) -> bool:
    """Whether dataset ``name``'s captions are translations of one another by index."""
    return _reader(name).captions_parallel


def _reader(name: str) -> DatasetReader:
    if name not in READERS:
        raise KeyError(f"unknown dataset '{name}'; known datasets: {names()}")
    return READERS[name]


def read_dataset(name: str, root: str | Path, split: str) -> list[Record]:
    """Records of one split of dataset ``name`` stored under ``root``."""
    reader = _reader(name)
    if split not in reader.splits:
        raise ValueError(
            f"dataset '{name}' has no split '{split}'; valid splits: {list(reader.splits)}"
        )
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: dataset root of '{name}' is not a folder")
    return reader.read(root, split)
