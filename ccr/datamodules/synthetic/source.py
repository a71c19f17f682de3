"""The synthetic world as a data source: the records of its splits (generated once, cached), the
folder their images live in, its parallel corpus and the categories of its object labels; and the
handle to its pretrained backbones (:class:`WorldBackbones`): what they learn from and what their
cache is keyed by. Nothing here trains; ``ccr.experiments.pretrain`` builds the backbones from the
handle (``make pretrain``, or a run that names ``world`` and finds them missing)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..datasets import ImageTransform
from ..records import Record
from ..tokenization import Tokenizer
from .scene import label_categories
from .world import (
    PRETRAIN,
    WorldKnobs,
    build_pretrain,
    build_world,
    load_split,
    parallel_text_dir,
    world_dir,
)


@dataclass(frozen=True)
class WorldBackbones:
    """What the world's pretrained backbones are built from: its clean twin (``WorldKnobs.clean``:
    the pretrain split does not depend on the corruptions), the data tokenizer, the data settings
    the encoders depend on, and the recipe ``data.backbones`` (a plain mapping, read by the
    builder). Their cache lives under ``root``."""

    root: Path
    knobs: WorldKnobs
    tokenizer: Tokenizer
    languages: list[str]
    max_length: int
    image_size: int
    image_mean: list[float]
    image_std: list[float]
    recipe: Mapping[str, Any]

    @property
    def world(self) -> Path:
        """The clean world's folder (generated when missing)."""
        return build_world(self.root, self.knobs)

    def encoder_settings(self) -> dict[str, Any]:
        """The data settings the text and image encoders depend on (part of their cache key)."""
        return {
            "languages": self.languages,
            "image_size": self.image_size,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "max_length": self.max_length,
        }

    def seq2seq_settings(self) -> dict[str, Any]:
        """The data settings the world mBART depends on (part of its cache key)."""
        return {"languages": self.languages, "max_length": self.max_length}

    def pretrain_split(self) -> Path:
        """The folder of the ``pretrain`` split the backbones learn from (generated when missing)."""
        return build_pretrain(self.world, self.knobs)

    def pretrain_records(self) -> list[Record]:
        return load_split(self.pretrain_split(), PRETRAIN)

    def check_records(self) -> list[Record]:
        """Held-out records (the clean world's val split) that measure what the backbones learnt."""
        return load_split(self.world, "val")

    def image_transform(self) -> ImageTransform:
        return ImageTransform(self.image_size, self.image_mean, self.image_std)


class WorldSource:
    """The world of the ``synthetic`` block of a data config (``root``: where worlds are cached)."""

    def __init__(self, root: str | Path, knobs: WorldKnobs):
        self.root, self.knobs = Path(root), knobs

    def prepare(self) -> Path:
        """Generate the world unless it is cached; returns its folder."""
        return build_world(self.root, self.knobs)

    @functools.cached_property
    def image_root(self) -> Path:
        # root and knobs fix the folder; naming it hashes the knobs, so once per source
        return world_dir(self.root, self.knobs) / "images"

    def split(self, name: str, clean: bool = False) -> tuple[list[Record], Path]:
        """The raw records of split ``name`` and their image folder; ``clean``: of the world's
        clean twin (what the offline tokenizer learns, so the corruptions change no vocabulary)."""
        world = build_world(self.root, self.knobs.clean() if clean else self.knobs)
        return load_split(world, name), world / "images"

    @property
    def is_clean(self) -> bool:
        return self.knobs.clean() == self.knobs

    def parallel_text(self) -> Path:
        """The world's parallel corpus (the pretrain split's captions, line-aligned)."""
        return parallel_text_dir(build_pretrain(self.prepare(), self.knobs))

    @staticmethod
    def label_categories(records: list[Record], labels: list[str]) -> list[str]:
        """Each object label's category (the shape of a colour-shape label), from the scenes."""
        categories: dict[str, str] = {}
        for record in records:
            categories.update(label_categories(record.extras["scene"]))
        return [categories[label] for label in labels]
