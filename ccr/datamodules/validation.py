"""Validation of records at setup, before any batch is built.

Checks that ids are unique, that every requested language occurs in the data, drops empty
captions and records left with no caption in a requested language, and (given an image root)
that every image exists and decodes completely. Everything dropped is counted in the report; nothing
is lost silently. Captions in languages that were not requested are left out and counted too.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from PIL import Image

from ccr.datamodules.records import Record

MissingImagePolicy = Literal["error", "skip"]


@dataclass
class ValidationReport:
    """What validation kept and dropped, per language where it applies."""

    source: str
    languages: list[str]
    records_in: int = 0
    records_out: int = 0
    captions_out: dict[str, int] = field(default_factory=dict)
    empty_captions: dict[str, int] = field(default_factory=dict)
    unrequested_captions: dict[str, int] = field(default_factory=dict)
    records_without_captions: int = 0
    records_missing_language: dict[str, int] = field(default_factory=dict)
    skipped_images: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the log."""
        parts = [
            f"{self.source}: kept {self.records_out}/{self.records_in} records",
            "captions " + _counts(self.captions_out),
            "dropped empty captions " + _counts(self.empty_captions),
            f"dropped {self.records_without_captions} records with no caption in {self.languages}",
            f"skipped {len(self.skipped_images)} records with missing/unreadable images",
            "records lacking a language " + _counts(self.records_missing_language),
            "left out captions of other languages " + _counts(self.unrequested_captions),
        ]
        return "; ".join(parts)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{lang} {n}" for lang, n in sorted(counts.items())) if counts else "none"


def _check_unique_ids(records: list[Record], source: str) -> None:
    duplicates = [record_id for record_id, n in Counter(r.id for r in records).items() if n > 1]
    if duplicates:
        raise ValueError(
            f"{source}: {len(duplicates)} record ids occur more than once, e.g. {duplicates[:3]}"
        )


def _check_caption_types(records: list[Record], source: str) -> None:
    for record in records:
        for lang, texts in record.captions.items():
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(
                        f"{source}: record '{record.id}': captions['{lang}'][{i}] is "
                        f"{type(text).__name__}, not text"
                    )


def _check_languages(records: list[Record], languages: list[str], source: str) -> None:
    present = {
        lang for r in records for lang, texts in r.captions.items() if any(t.strip() for t in texts)
    }
    absent = [lang for lang in languages if lang not in present]
    if absent:
        raise ValueError(
            f"{source}: requested languages {absent} are not in the data; "
            f"languages present: {sorted(present)}"
        )


def image_problem(path: Path) -> str | None:
    """Why an image file cannot be used (missing, unreadable or not fully decodable), or None.

    The whole image is decoded, as the loader will: a truncated JPEG passes a header check but
    fails here, naming its file, instead of killing a loader worker mid-training."""
    if not path.is_file():
        return "is missing"
    try:
        with Image.open(path) as image:
            image.draft("RGB", (64, 64))  # JPEG: decode every block at reduced scale (faster)
            image.load()
    except Exception as err:  # PIL raises many types for a corrupt file; all mean "unreadable"
        return f"cannot be read ({type(err).__name__}: {' '.join(str(err).split())})"
    return None


def _record_image_problem(record: Record, image_root: Path) -> str | None:
    """What is wrong with a record's image, phrased for the one-line error, or None."""
    if record.image is None:
        return "has no image"
    path = Path(image_root) / record.image
    problem = image_problem(path)
    return None if problem is None else f"image {path} {problem}"


def _image_problems(records: list[Record], image_root: Path | None) -> dict[str, str]:
    """``{record id: problem}`` for every record whose image is unusable, decoding in threads
    (image decoders release the GIL)."""
    if image_root is None:
        return {}
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = pool.map(lambda r: _record_image_problem(r, image_root), records, chunksize=64)
        return {
            r.id: problem for r, problem in zip(records, found, strict=True) if problem is not None
        }


def _add(counts: dict[str, int], key: str, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n


def _keep_requested(record: Record, languages: list[str], report: ValidationReport) -> Record:
    """The record restricted to non-empty captions in the requested languages, counting the rest."""
    captions = {}
    for lang, texts in record.captions.items():
        if lang not in languages:
            _add(report.unrequested_captions, lang, len(texts))
            continue
        kept = [t for t in texts if t.strip()]
        _add(report.empty_captions, lang, len(texts) - len(kept))
        if kept:
            captions[lang] = kept
    return Record(record.id, record.image, captions, dict(record.extras))


def validate(
    records: Iterable[Record],
    *,
    languages: list[str],
    source: str,
    image_root: Path | None = None,
    on_missing_image: MissingImagePolicy = "error",
) -> tuple[list[Record], ValidationReport]:
    """Checked copies of ``records`` for ``languages``, and the report of what was dropped.

    ``source`` names the data in messages (e.g. ``xflickrco/test``). With ``image_root``, every
    kept record's image (``image_root / record.image``) must exist and open; ``on_missing_image``
    says whether a bad one is an error or a skipped, counted record.
    """
    if on_missing_image not in ("error", "skip"):
        raise ValueError(f"on_missing_image must be 'error' or 'skip', got {on_missing_image!r}")
    if not languages:
        raise ValueError(f"{source}: no languages requested")
    records = list(records)
    _check_unique_ids(records, source)
    _check_caption_types(records, source)
    _check_languages(records, languages, source)
    report = ValidationReport(source, list(languages), records_in=len(records))
    requested = [_keep_requested(record, languages, report) for record in records]
    problems = _image_problems([r for r in requested if r.captions], image_root)
    kept: list[Record] = []
    for record in requested:
        if not record.captions:
            report.records_without_captions += 1
            continue
        problem = problems.get(record.id)
        if problem is not None:
            if on_missing_image == "error":
                raise ValueError(f"{source}: record '{record.id}': {problem}")
            report.skipped_images.append(record.id)
            continue
        kept.append(record)
        for lang in languages:
            _add(report.captions_out, lang, len(record.captions.get(lang, [])))
            _add(report.records_missing_language, lang, int(lang not in record.captions))
    report.records_out = len(kept)
    return kept, report
