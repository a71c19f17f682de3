"""CC3M-style multilingual pre-training shards (the CCLM/CCRK JSONL form).

Layout: ``<root>/<split>/`` holds shard files (``part-00000.data`` or ``*.jsonl``), read in name
order. Each line is ``{"image_path" | "image": str, "caption": {lang: text} | [{lang: text}, ...],
"id": optional}``; a list of caption dicts gives several captions per language. The image path is
relative to the dataset root. The record id is ``id`` when given, otherwise the image path without
its extension (unique across folders).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ccr.datamodules.readers._files import get_field, read_jsonl
from ccr.datamodules.records import Record

SPLITS = ("train", "val")
SHARD_PATTERNS = ("*.data", "*.jsonl")
IMAGE_KEYS = ("image_path", "image")


def _captions(value: dict | list, where: str) -> dict[str, list[str]]:
    """Language -> captions from one caption dict or a list of them."""
    captions: dict[str, list[str]] = {}
    for entry in value if isinstance(value, list) else [value]:
        if not isinstance(entry, dict) or not all(isinstance(t, str) for t in entry.values()):
            raise ValueError(
                f"{where}: field 'caption' must map language -> text (or be a list of such maps)"
            )
        for lang, text in entry.items():
            captions.setdefault(lang, []).append(text.strip())
    return captions


def _image(obj: dict, where: str) -> str:
    for key in IMAGE_KEYS:
        if key in obj:
            return get_field(obj, key, where, str)
    raise ValueError(f"{where}: no image path (expected one of the fields {list(IMAGE_KEYS)})")


def read(root: Path, split: str) -> list[Record]:
    """Every line of every shard of the split, one record each."""
    folder = root / split
    shards = sorted({path for pattern in SHARD_PATTERNS for path in folder.glob(pattern)})
    if not shards:
        raise FileNotFoundError(f"{folder}: no shard files matching {list(SHARD_PATTERNS)}")
    records = []
    for shard in shards:
        for line_no, obj in read_jsonl(shard):
            where = f"{shard}:{line_no}"
            image = _image(obj, where)
            captions = _captions(get_field(obj, "caption", where, (dict, list)), where)
            record_id = str(obj["id"]) if "id" in obj else str(PurePosixPath(image).with_suffix(""))
            records.append(Record(record_id, image, captions))
    return records
