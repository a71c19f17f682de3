"""``EvaluatedSet``: one scored split as the report needs it (images, captions, embeddings).

An external model's run folder stores it as ``embeddings.pt`` (written by
``ccr.experiments.external``); a trained run's is re-encoded from its checkpoint. The caption order is
the evaluation view's (``ccr.datamodules.eval_split.caption_table``), so caption ``i`` here is caption
``i`` of ``CCRDataModule.eval_view``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from ccr.datamodules.eval_split import caption_table
from ccr.datamodules.records import Record

EMBEDDINGS = "embeddings.pt"


@dataclass
class EvaluatedSet:
    """Every image and caption of one split, their embeddings, and what MRV is computed over."""

    image_ids: list[str]
    image_paths: list[str]
    captions: list[str]
    caption_image: Tensor  # [T] long, index into image_ids
    caption_language: list[str]  # [T]
    languages: list[str]  # evaluated languages, in configured order
    mrv_languages: list[str] | None  # data.mrv_languages (None: every evaluated language)
    image_emb: Tensor | None = None  # [N, D] float32, L2-normalised
    text_emb: Tensor | None = None  # [T, D]

    @classmethod
    def from_records(
        cls,
        records: list[Record],
        languages: list[str],
        image_root: Path,
        mrv_languages: list[str] | None,
    ) -> EvaluatedSet:
        """The split's captions in the evaluation view's order (no embeddings yet)."""
        table = caption_table(records, languages)
        return cls(
            image_ids=[r.id for r in records],
            image_paths=[_image_path(r, image_root) for r in records],
            captions=table.captions,
            caption_image=table.caption_image,
            caption_language=table.caption_language,
            languages=table.languages,
            mrv_languages=mrv_languages,
        )

    def save(self, path: Path) -> None:
        """Write through a temporary file and a rename (never a truncated file)."""
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(asdict(self), staging)
        staging.replace(path)

    @classmethod
    def load(cls, path: Path) -> EvaluatedSet:
        """Read a saved set (weights-only: no pickled code runs); a foreign file is an error."""
        try:
            fields = torch.load(path, map_location="cpu", weights_only=True)
            evaluated = cls(**fields)
        except Exception as err:  # torch raises several types for foreign files
            raise ValueError(
                f"{path}: not an evaluated set ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:160]})"
            ) from None
        if evaluated.image_emb is None or evaluated.text_emb is None:
            raise ValueError(f"{path}: holds no embeddings")
        return evaluated

    def embeddings(self) -> tuple[Tensor, Tensor]:
        """``(image_emb, text_emb)``; an error for a set not encoded yet."""
        if self.image_emb is None or self.text_emb is None:
            raise ValueError("this evaluated set holds no embeddings (it was not encoded)")
        return self.image_emb, self.text_emb

    def same_items(self, other: EvaluatedSet) -> str | None:
        """Why two sets cannot be compared instance by instance (None when they can)."""
        if self.image_ids != other.image_ids:
            return "their images differ"
        if self.captions != other.captions or self.caption_language != other.caption_language:
            return "their captions differ"
        if not torch.equal(self.caption_image, other.caption_image):
            return "their captions belong to different images"
        return None


def _image_path(record: Record, image_root: Path) -> str:
    """Where the record's image lies; a record without one cannot be evaluated."""
    if record.image is None:
        raise ValueError(f"record {record.id!r} has no image; every evaluated record needs one")
    return str(image_root / record.image)
