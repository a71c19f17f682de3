"""IGLUE caption files: xFlickr&CO (8 languages) and IGLUE's English Flickr30K annotations.

Each JSONL line is one image: ``{"sentences": [str, ...], "id": str|int, "img_path": str}``.
Record ids are image file stems (``1007129816``, ``COCO_val2014_000000391895``): IGLUE's own ids
are strings for Flickr30K and ints for COCO and could collide once made strings. Images live in
``flickr30k-images/`` or ``val2014/`` under the dataset root, chosen by the ``COCO`` prefix as in
CCLM/CCRK.
"""

from __future__ import annotations

from pathlib import Path

from ccr.datamodules.readers._files import get_field, image_stem, read_jsonl
from ccr.datamodules.records import Record

XFLICKRCO_LANGUAGES = ("de", "en", "es", "id", "ja", "ru", "tr", "zh")
XFLICKRCO_SPLITS = ("test",) + tuple(
    f"train_{n}" for n in (1, 5, 10, 25, 50, 100, 200, 500, 1000, 1500, "100x5", "200x5")
)
FLICKR30K_SPLITS = ("train", "valid", "test")


def image_path(img_path: str) -> str:
    """Image path relative to the dataset root: COCO val2014 or Flickr30K folder."""
    folder = "val2014" if "COCO" in img_path else "flickr30k-images"
    return f"{folder}/{img_path}"


def read_caption_file(path: Path, language: str) -> list[Record]:
    """One record per line with the line's sentences in ``language``; a repeated image fails."""
    records: list[Record] = []
    seen: dict[str, int] = {}
    for line_no, obj in read_jsonl(path):
        where = f"{path}:{line_no}"
        img_path = get_field(obj, "img_path", where, str)
        get_field(obj, "id", where, (str, int))
        sentences = get_field(obj, "sentences", where, list)
        if not all(isinstance(s, str) for s in sentences):
            raise ValueError(f"{where}: field 'sentences' must be a list of strings")
        record_id = image_stem(img_path)
        if record_id in seen:
            raise ValueError(f"{where}: image {img_path} already listed on line {seen[record_id]}")
        seen[record_id] = line_no
        records.append(
            Record(record_id, image_path(img_path), {language: [s.strip() for s in sentences]})
        )
    return records


def _check_aligned(reference: tuple[Path, list[Record]], other: tuple[Path, list[Record]]) -> None:
    """xFlickr&CO test files list the same images in the same order in every language."""
    (ref_path, ref), (path, records) = reference, other
    if len(records) != len(ref):
        raise ValueError(
            f"{path}: {len(records)} images but {ref_path} has {len(ref)}; test files must align"
        )
    for line_no, (a, b) in enumerate(zip(ref, records, strict=True), start=1):
        if a.id != b.id:
            raise ValueError(
                f"{path}:{line_no}: image {b.id} but {ref_path} has {a.id}; test files must align"
            )


def read_xflickrco(root: Path, split: str) -> list[Record]:
    """Merge ``annotations/<lang>/<split>.jsonl`` of every language that has the file.

    The test files must align line by line; few-shot train files cover different images per
    language, so a merged record carries only the languages whose file lists its image.
    """
    annotations = root / "annotations"
    files = [(lang, annotations / lang / f"{split}.jsonl") for lang in XFLICKRCO_LANGUAGES]
    files = [(lang, path) for lang, path in files if path.is_file()]
    if not files:
        raise FileNotFoundError(
            f"{annotations}: no file <lang>/{split}.jsonl for any of {list(XFLICKRCO_LANGUAGES)}"
        )
    merged: dict[str, Record] = {}
    first: tuple[Path, list[Record]] | None = None
    for lang, path in files:
        records = read_caption_file(path, lang)
        if split == "test":
            first = first or (path, records)
            _check_aligned(first, (path, records))
        for record in records:
            merged.setdefault(record.id, Record(record.id, record.image, {})).captions.update(
                record.captions
            )
    return list(merged.values())


def read_flickr30k(root: Path, split: str) -> list[Record]:
    """English Flickr30K with 5 captions per image from ``annotations/<split>_ann.jsonl``."""
    return read_caption_file(root / "annotations" / f"{split}_ann.jsonl", "en")
