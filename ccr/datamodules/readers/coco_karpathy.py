"""COCO with Karpathy's split (``dataset_coco.json``), joined with Japanese STAIR Captions and
Chinese COCO-CN captions when their files are present beside it.

Layout under the dataset root::

    dataset_coco.json
    stair_captions_v1.2_train.json, stair_captions_v1.2_val.json      (optional, ja)
    coco-cn-version1805v1.1/imageid.human-written-caption.txt          (optional, zh)
    train2014/, val2014/                                               (images)

Record ids are image stems (``COCO_val2014_000000391895``); the image is ``<filepath>/<filename>``.
Split ``train`` is Karpathy's train plus restval (113,287 images), as CCR papers use it.
"""

from __future__ import annotations

from pathlib import Path

from ccr.datamodules.readers._files import get_field, image_stem, read_json, read_lines
from ccr.datamodules.records import Record

SPLITS = ("train", "val", "test")
KARPATHY_SPLITS = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}
STAIR_FILES = ("stair_captions_v1.2_train.json", "stair_captions_v1.2_val.json")
COCO_CN_FILE = "coco-cn-version1805v1.1/imageid.human-written-caption.txt"


def read_stair(path: Path) -> dict[int, list[str]]:
    """COCO image id -> Japanese captions from one STAIR Captions file (COCO captions format)."""
    data = read_json(path)
    captions: dict[int, list[str]] = {}
    for i, annotation in enumerate(get_field(data, "annotations", str(path), list)):
        where = f"{path}: annotations[{i}]"
        image_id = get_field(annotation, "image_id", where, int)
        captions.setdefault(image_id, []).append(
            get_field(annotation, "caption", where, str).strip()
        )
    return captions


def read_coco_cn(path: Path) -> dict[int, list[str]]:
    """COCO image id -> Chinese captions from lines ``COCO_val2014_000000217153#0<TAB>sentence``."""
    captions: dict[int, list[str]] = {}
    for line_no, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        key, tab, sentence = line.partition("\t")
        image_name, hash_sign, _ = key.partition("#")
        number = image_name.rsplit("_", 1)[-1]
        if not tab or not hash_sign or not number.isdigit():
            raise ValueError(
                f"{path}:{line_no}: expected '<COCO image id>#<k><TAB><sentence>', "
                f"got {line[:60]!r}"
            )
        captions.setdefault(int(number), []).append(sentence.strip())
    return captions


def _extra_languages(root: Path) -> dict[str, dict[int, list[str]]]:
    """Captions by language and COCO id from the optional STAIR (ja) and COCO-CN (zh) files."""
    extra: dict[str, dict[int, list[str]]] = {}
    for name in STAIR_FILES:
        if (root / name).is_file():
            for image_id, texts in read_stair(root / name).items():
                extra.setdefault("ja", {}).setdefault(image_id, []).extend(texts)
    if (root / COCO_CN_FILE).is_file():
        extra["zh"] = read_coco_cn(root / COCO_CN_FILE)
    return extra


def read(root: Path, split: str) -> list[Record]:
    """One record per image of the split with English captions, plus ja/zh where available."""
    path = root / "dataset_coco.json"
    data = read_json(path)
    extra = _extra_languages(root)
    records = []
    for i, image in enumerate(get_field(data, "images", str(path), list)):
        where = f"{path}: images[{i}]"
        if get_field(image, "split", where, str) not in KARPATHY_SPLITS[split]:
            continue
        filename = get_field(image, "filename", where, str)
        cocoid = get_field(image, "cocoid", where, int)
        sentences = get_field(image, "sentences", where, list)
        captions = {
            "en": [get_field(s, "raw", f"{where}.sentences", str).strip() for s in sentences]
        }
        for lang, by_id in extra.items():
            if cocoid in by_id:
                captions[lang] = list(by_id[cocoid])
        image_path = f"{get_field(image, 'filepath', where, str)}/{filename}"
        records.append(Record(image_stem(filename), image_path, captions))
    return records
