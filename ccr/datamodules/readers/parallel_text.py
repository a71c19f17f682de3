"""Aligned parallel text (no images): the corpus mCLIP's Stage 1 trains on.

Two layouts, both UTF-8:

* a folder of line-aligned files, one per language, named ``<lang>.txt`` (or ``<anything>.<lang>``
  for the ``train.en`` / ``train.de`` convention): line i of every file is one translation;
* a TSV file whose header row names the languages, then one tab-separated translation per column.

``read_parallel_text(path)`` returns a :class:`ParallelText`; a misaligned input (files of
different lengths, a row with the wrong number of cells) is an error naming the file and line.
Blank cells are kept here and left out, counted, when pairs are drawn (:meth:`ParallelText.pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._files import read_lines


@dataclass
class ParallelText:
    """``columns[lang][i]``: the i-th sentence in ``lang``; every column has the same length."""

    source: str
    columns: dict[str, list[str]]

    @property
    def languages(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def pairs(self, src: str, tgt: str) -> tuple[list[tuple[str, str]], int]:
        """The (src, tgt) sentence pairs, and how many rows were left out for a blank side."""
        missing = [lang for lang in (src, tgt) if lang not in self.columns]
        if missing:
            raise ValueError(
                f"{self.source}: parallel text has no language {missing}; it has {self.languages}"
            )
        pairs = [
            (s.strip(), t.strip())
            for s, t in zip(self.columns[src], self.columns[tgt], strict=True)
        ]
        kept = [(s, t) for s, t in pairs if s and t]
        return kept, len(pairs) - len(kept)


def read_parallel_text(path: str | Path) -> ParallelText:
    """Read a folder of line-aligned files or a TSV file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        return _read_folder(path)
    if path.is_file():
        return _read_tsv(path)
    raise FileNotFoundError(f"{path}: parallel text not found (expected a folder or a .tsv file)")


def _language_of(file: Path) -> str:
    return file.stem if file.suffix == ".txt" else file.suffix.lstrip(".")


def _read_folder(folder: Path) -> ParallelText:
    files = sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"{folder}: no parallel text files (<lang>.txt) in this folder")
    columns: dict[str, list[str]] = {}
    origin: dict[str, Path] = {}
    for file in files:
        lang = _language_of(file)
        if not lang:
            raise ValueError(f"{file}: cannot tell the language from the file name")
        if lang in columns:
            raise ValueError(f"{file}: language '{lang}' also in {origin[lang]}")
        columns[lang], origin[lang] = read_lines(file), file
    longest = max(columns, key=lambda lang: len(columns[lang]))
    for lang, lines in columns.items():
        if len(lines) != len(columns[longest]):
            raise ValueError(
                f"{origin[lang]}:{len(lines) + 1}: file ends after {len(lines)} lines but "
                f"{origin[longest]} has {len(columns[longest])}; the files are not line-aligned"
            )
    return ParallelText(str(folder), columns)


def _read_tsv(file: Path) -> ParallelText:
    lines = read_lines(file)
    if not lines:
        raise ValueError(f"{file}:1: empty file; expected a header row of language codes")
    header = lines[0].split("\t")
    languages = [lang.strip() for lang in header]
    if not all(languages) or len(set(languages)) != len(languages):  # "en" and "en " are one
        raise ValueError(f"{file}:1: the header must name distinct languages, got {header}")
    columns: dict[str, list[str]] = {lang: [] for lang in languages}
    for line_no, line in enumerate(lines[1:], start=2):
        cells = line.split("\t")
        if len(cells) != len(header):
            raise ValueError(
                f"{file}:{line_no}: {len(cells)} cells but the header names {len(header)} "
                f"languages {header}; the row is misaligned"
            )
        for lang, cell in zip(columns, cells, strict=True):
            columns[lang].append(cell)
    return ParallelText(str(file), columns)
