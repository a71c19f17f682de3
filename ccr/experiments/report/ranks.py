"""Per-instance ranks across languages, from the metrics' own rank engine.

For every image and language: the expected 1-based rank of the image's best caption when the image
is the query (i2t, TR) and of the image when its first caption of that language is the query (t2i,
IR), under the suite's tie convention (``ccr.metrics.ties``). These are exactly the ranks
``metrics.retrieval_report`` puts into MRV (plus 1): an image's spread in one direction is the
population std of its ranks over the MRV languages, and ``all/MRV_std/<direction>`` is the mean
spread over the images that have every MRV language.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ccr.experiments.report.evaluated import EvaluatedSet
from ccr.metrics.ranks import paired_ranks
from ccr.metrics.ties import HIGHER, expected_rank

DIRECTIONS = ("i2t", "t2i")


@dataclass
class InstanceRanks:
    """Ranks [N images, L languages] per direction (NaN: the image has no caption there)."""

    languages: list[str]
    mrv_languages: list[str]
    i2t: Tensor  # float64: expected 1-based rank of the image's best caption
    t2i: Tensor  # float64: expected 1-based rank of the image for its first caption
    first_caption: Tensor  # long: that first caption's index in the set, -1 where none

    def spread(self, direction: str) -> Tensor:
        """Population std of each image's ranks over the MRV languages [N]; NaN when one is missing."""
        columns = [self.languages.index(lang) for lang in self.mrv_languages]
        return getattr(self, direction)[:, columns].std(1, unbiased=False)

    def combined_spread(self) -> Tensor:
        """Mean of the two directions' spreads [N] (its mean over images is ``all/MRV``)."""
        return (self.spread("i2t") + self.spread("t2i")) / 2


def instance_ranks(evaluated: EvaluatedSet, chunk_size: int = 1024) -> InstanceRanks:
    """Both directions' per-image ranks in every language, one ``paired_ranks`` pass each."""
    num_images = len(evaluated.image_ids)
    shape = (num_images, len(evaluated.languages))
    i2t = torch.full(shape, math.nan, dtype=torch.float64)
    t2i = torch.full(shape, math.nan, dtype=torch.float64)
    first_caption = torch.full(shape, -1, dtype=torch.long)
    language_of = evaluated.caption_language
    image_emb, text_emb = evaluated.embeddings()
    for column, lang in enumerate(evaluated.languages):
        captions = torch.tensor(
            [i for i, c in enumerate(language_of) if c == lang], dtype=torch.long
        )
        owners = evaluated.caption_image[captions]
        paired = paired_ranks(image_emb, text_emb[captions], owners, chunk_size=chunk_size)
        queries = paired.i2t_rank[:, HIGHER] >= 0
        i2t[queries, column] = expected_rank(paired.i2t_rank[queries]) + 1
        caption_rank = expected_rank(paired.t2i_rank) + 1
        for position in reversed(range(len(captions))):  # the first caption of an image wins
            image = int(owners[position])
            t2i[image, column] = caption_rank[position]
            first_caption[image, column] = captions[position]
    mrv = evaluated.mrv_languages or evaluated.languages
    missing = [lang for lang in mrv if lang not in evaluated.languages]
    if missing:
        raise ValueError(
            f"MRV languages {missing} have no caption in the evaluated set "
            f"(languages: {evaluated.languages})"
        )
    return InstanceRanks(list(evaluated.languages), list(mrv), i2t, t2i, first_caption)


def most_inconsistent(ranks: InstanceRanks, count: int) -> list[int]:
    """The ``count`` images with the largest combined spread, largest first (ties: lower index
    first); images missing an MRV language are left out."""
    spread = ranks.combined_spread()
    order = sorted(
        (i for i in range(len(spread)) if not math.isnan(spread[i])),
        key=lambda i: (-float(spread[i]), i),
    )
    return order[:count]


def rank_gap(a: InstanceRanks, b: InstanceRanks) -> Tensor:
    """Per image, the largest |rank in a - rank in b| over languages and directions [N] (NaN
    cells ignored; an image with no rank at all gets NaN)."""
    gaps = torch.cat([(a.i2t - b.i2t).abs(), (a.t2i - b.t2i).abs()], 1)
    return (
        torch.where(gaps.isnan(), -math.inf, gaps)
        .amax(1)
        .masked_fill(gaps.isnan().all(1), math.nan)
    )


def most_different(a: InstanceRanks, b: InstanceRanks, count: int) -> list[int]:
    """The ``count`` images whose ranks differ most between two runs, largest gap first."""
    gap = rank_gap(a, b)
    order = sorted(
        (i for i in range(len(gap)) if not math.isnan(gap[i])), key=lambda i: (-float(gap[i]), i)
    )
    return order[:count]


def write_ranks_csv(path: Path, runs: list[tuple[str, EvaluatedSet, InstanceRanks]]) -> int:
    """One row per (run, image, direction): the rank in each language and the spread over the
    MRV languages (empty where undefined). Returns the number of rows."""
    languages = list(dict.fromkeys(lang for _, _, r in runs for lang in r.languages))
    rows = 0
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "run",
                "image_index",
                "image_id",
                "direction",
                *[f"rank_{lang}" for lang in languages],
                "spread",
            ]
        )
        for name, evaluated, ranks in runs:
            for direction in DIRECTIONS:
                table, spread = getattr(ranks, direction), ranks.spread(direction)
                for image, image_id in enumerate(evaluated.image_ids):
                    cells = [
                        _number(table[image, ranks.languages.index(lang)])
                        if lang in ranks.languages
                        else ""
                        for lang in languages
                    ]
                    writer.writerow(
                        [name, image, image_id, direction, *cells, _number(spread[image])]
                    )
                    rows += 1
    return rows


def _number(value: Tensor) -> str:
    """A float as CSV text: exact repr, empty for NaN."""
    number = float(value)
    return "" if math.isnan(number) else repr(number)
