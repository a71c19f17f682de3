"""Multi30K (github multi30k/dataset): task 1 translations and task 2 independent captions.

Layout under the dataset root: ``data/task1/{image_splits,raw}/`` and ``data/task2/...`` as in the
repository, plus the images in ``images/``. Line i of every text file describes line i of the
split's image list. Record ids are the image file stems (``1000092795``); MSCOCO lines of
test_2017_mscoco (``COCO_train2014_000000117071.jpg#367178``) keep the ``#`` suffix in the id, since
the image alone need not be unique there, and drop it from the image name.
"""

from __future__ import annotations

import re
from pathlib import Path

from ccr.datamodules.readers._files import check_same_length, image_stem, read_lines, require_file
from ccr.datamodules.records import Record

TASK1_SPLITS = (
    "train",
    "val",
    "test_2016_flickr",
    "test_2017_flickr",
    "test_2017_mscoco",
    "test_2018_flickr",
)
TASK2_SPLITS = ("train", "val", "test_2016")
IMAGE_FOLDER = "images"


def _image_list(path: Path) -> list[tuple[str, str]]:
    """``(record id, image file name)`` for every line of an image list."""
    entries = []
    for line_no, line in enumerate(read_lines(path), start=1):
        name = line.strip()
        if not name:
            raise ValueError(f"{path}:{line_no}: empty image name")
        file_name, _, suffix = name.partition("#")
        record_id = f"{image_stem(file_name)}#{suffix}" if suffix else image_stem(file_name)
        entries.append((record_id, file_name))
    return entries


def _records(images: list[tuple[str, str]], captions: dict[str, list[list[str]]]) -> list[Record]:
    """Zip the image list with per-language caption columns (``captions[lang][k][i]``)."""
    return [
        Record(
            id=record_id,
            image=f"{IMAGE_FOLDER}/{file_name}",
            captions={
                lang: [column[i].strip() for column in columns]
                for lang, columns in captions.items()
            },
        )
        for i, (record_id, file_name) in enumerate(images)
    ]


def read_task1(root: Path, split: str) -> list[Record]:
    """One record per image, one caption per language that has ``raw/<split>.<lang>.gz``."""
    task = root / "data" / "task1"
    image_list = require_file(task / "image_splits" / f"{split}.txt")
    images = _image_list(image_list)
    files = sorted((task / "raw").glob(f"{split}.*.gz"))
    if not files:
        raise FileNotFoundError(f"{task / 'raw'}: no caption files {split}.<lang>.gz")
    captions = {}
    for path in files:
        lines = read_lines(path)
        check_same_length(path, lines, image_list, len(images))
        captions[path.name.split(".")[-2]] = [lines]
    return _records(images, captions)


_TASK2_FILE = re.compile(r"^(?P<split>.+)\.(?P<k>[1-5])\.(?P<lang>[a-z]+)\.gz$")


def read_task2(root: Path, split: str) -> list[Record]:
    """One record per image with the (up to 5) independent descriptions of each language."""
    task = root / "data" / "task2"
    image_list = require_file(task / "image_splits" / f"{split}_images.txt")
    images = _image_list(image_list)
    captions: dict[str, list[list[str]]] = {}
    for path in sorted((task / "raw").glob(f"{split}.*.gz")):
        match = _TASK2_FILE.match(path.name)
        if match is None or match["split"] != split:
            continue
        lines = read_lines(path)
        check_same_length(path, lines, image_list, len(images))
        captions.setdefault(match["lang"], []).append(lines)
    if not captions:
        raise FileNotFoundError(f"{task / 'raw'}: no caption files {split}.<1-5>.<lang>.gz")
    return _records(images, captions)
