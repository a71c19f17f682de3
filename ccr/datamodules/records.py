"""The one record type every dataset reader produces, and its JSONL form.

A record is one image with its captions in any number of languages. Readers turn each public
format into records; everything downstream (validation, datasets, the evaluation view) sees only
records, so adding a dataset never touches method code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Record:
    """One image and its captions: ``captions`` maps a language code to one or more texts."""

    id: str
    image: str | None
    captions: dict[str, list[str]]
    extras: dict[str, Any] = field(default_factory=dict)

    def languages(self) -> list[str]:
        return [lang for lang, texts in self.captions.items() if texts]


def write_records(path: str | Path, records: Iterable[Record]) -> None:
    """Write records as JSONL, one record a line, UTF-8 without escaping non-ASCII text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(asdict(record), ensure_ascii=False, allow_nan=False) + "\n")


def read_records(path: str | Path) -> list[Record]:
    """Read JSONL records; a malformed line fails naming the file, line and field."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            for key in ("id", "captions"):
                if key not in raw:
                    raise ValueError(f"{path}:{line_no}: record has no field '{key}'")
            if not isinstance(raw["captions"], dict):
                raise ValueError(
                    f"{path}:{line_no}: field 'captions' must map language -> list of texts"
                )
            captions = {
                lang: [texts] if isinstance(texts, str) else list(texts)
                for lang, texts in raw["captions"].items()
            }
            records.append(
                Record(str(raw["id"]), raw.get("image"), captions, raw.get("extras") or {})
            )
    return records
