"""File helpers shared by the readers: text lines (plain or gzip), JSON Lines, required fields.

Every error names the file (and the line when there is one), so that a broken download is found
without a debugger.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def require_file(path: Path) -> Path:
    """Return ``path`` if it is a file; otherwise fail naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    return path


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (gzip when the name ends in ``.gz``), without line endings.

    Splits on ``\\n`` only (captions may hold other Unicode line separators), and a missing final
    newline is harmless (some XTD10 files lack one).
    """
    lines = decode_utf8(path, read_bytes(path)).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_bytes(path: Path) -> bytes:
    """The bytes of a file, unpacked when the name ends in ``.gz``; a damaged archive is named."""
    require_file(path)
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable gzip file ({err})") from None


def decode_utf8(path: Path, raw: bytes) -> str:
    """``raw`` as UTF-8 text; an undecodable byte fails naming the file, line and byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
            f"{column}); re-encode the file as UTF-8"
        ) from None


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for every non-blank line; bad JSON fails naming the line."""
    for line_no, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        yield line_no, obj


def read_json(path: Path) -> Any:
    """Parse one JSON document; a syntax error fails naming the file and position."""
    try:
        return json.loads(decode_utf8(path, read_bytes(path)))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None


def get_field(obj: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    """``obj[key]`` checked for type; ``where`` (e.g. ``file:line``) goes into the error."""
    if key not in obj:
        raise ValueError(f"{where}: no field '{key}'")
    value = obj[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{where}: field '{key}' must be {names}, got {type(value).__name__}")
    return value


def check_same_length(path: Path, lines: list[str], reference: Path, expected: int) -> None:
    """Aligned text files must have one line per image of the reference list."""
    if len(lines) != expected:
        raise ValueError(
            f"{path}: {len(lines)} lines but {reference} lists {expected} images; "
            "line i of every file must describe image i"
        )


def image_stem(name: str) -> str:
    """Image file name without folder and extension, the record id for file-named images."""
    return Path(name).stem
