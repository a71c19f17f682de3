"""IGLUE WIT retrieval: ``annotations/{test_<lang>,val_en}.jsonl``, one caption per line.

Captions are grouped into one record per image, keyed by ``wit_ix`` (1:1 with ``image_url`` and
shared across languages). IGLUE ships no pixels: the image is expected at
``images/<wit_ix><extension of image_url>`` under the dataset root, and ``extras["image_url"]``
keeps the address to fetch it from. HTML entities in captions are decoded.

Split ``test_<lang>`` reads one language's file (IGLUE's protocol: each language has its own image
pool); ``test`` merges every test file present into one multilingual pool.
"""

from __future__ import annotations

import html
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from ccr.datamodules.readers._files import get_field, read_jsonl
from ccr.datamodules.records import Record

LANGUAGES = ("ar", "bg", "da", "el", "en", "et", "id", "ja", "ko", "tr", "vi")
SPLITS = ("test",) + tuple(f"test_{lang}" for lang in LANGUAGES) + ("val_en",)


def _add_file(path: Path, language: str, records: dict[str, Record]) -> None:
    """Add every caption of one file to the record of its image."""
    for line_no, obj in read_jsonl(path):
        where = f"{path}:{line_no}"
        key = get_field(obj, "wit_ix", where, str)
        url = get_field(obj, "image_url", where, str)
        caption = html.unescape(get_field(obj, "caption_reference_description", where, str)).strip()
        record = records.get(key)
        if record is None:
            suffix = PurePosixPath(urlparse(url).path).suffix.lower()
            record = records[key] = Record(key, f"images/{key}{suffix}", {}, {"image_url": url})
        elif record.extras["image_url"] != url:
            raise ValueError(
                f"{where}: wit_ix {key} has image_url {url}, earlier {record.extras['image_url']}"
            )
        record.captions.setdefault(language, []).append(caption)


def read(root: Path, split: str) -> list[Record]:
    """Records of one split, in order of first appearance."""
    annotations = root / "annotations"
    if split == "test":
        files = [(lang, annotations / f"test_{lang}.jsonl") for lang in LANGUAGES]
        files = [(lang, path) for lang, path in files if path.is_file()]
        if not files:
            raise FileNotFoundError(
                f"{annotations}: no file test_<lang>.jsonl for any of {list(LANGUAGES)}"
            )
    else:
        files = [(split.rsplit("_", 1)[1], annotations / f"{split}.jsonl")]
    records: dict[str, Record] = {}
    for lang, path in files:
        _add_file(path, lang, records)
    return list(records.values())
