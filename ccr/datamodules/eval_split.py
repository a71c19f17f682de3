"""What an evaluated split is, computed once for every reader of it: the order of its captions and,
for the synthetic world, the graded relevance between its images.

The evaluation view (``CCRDataModule.eval_view``), the report's ``EvaluatedSet`` and the external
scorer all take caption ``i`` and the relevance matrix from here, so caption ``i`` is the same
caption, with the same ground truth, wherever it is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .records import Record
from .synthetic import Scene, relevance_matrix

SCENE = "scene"  # the record extra that holds a synthetic scene


@dataclass(frozen=True)
class CaptionTable:
    """Every caption of a split: language by language (configured order), then record order,
    then the record's caption order."""

    languages: list[str]  # the configured languages the split has captions in
    captions: list[str]  # [T]
    caption_image: torch.Tensor  # [T] long, index of the caption's record
    caption_language: list[str]  # [T]


def caption_table(records: Sequence[Record], languages: Sequence[str]) -> CaptionTable:
    """The captions of ``records`` in ``languages`` (a language without any caption is left out)."""
    present = [lang for lang in languages if any(lang in r.captions for r in records)]
    captions, caption_image, caption_language = [], [], []
    for lang in present:
        for index, record in enumerate(records):
            for text in record.captions.get(lang, []):
                captions.append(text)
                caption_image.append(index)
                caption_language.append(lang)
    return CaptionTable(
        present, captions, torch.tensor(caption_image, dtype=torch.long), caption_language
    )


def graded_relevance(records: Sequence[Record]) -> torch.Tensor | None:
    """``[N, N]`` graded relevance between the records' images when every record carries its
    synthetic scene (uni-modal NDCG's ground truth); None otherwise (real datasets)."""
    if not records or not all(SCENE in r.extras for r in records):
        return None
    return relevance_matrix([Scene.from_json(r.extras[SCENE]) for r in records])
