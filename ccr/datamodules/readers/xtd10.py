"""XTD10 (adobe-research/Cross-lingual-Test-Dataset-XTD10): 1000 COCO train2014 images, one
caption per image in each of en es it ko pl ru tr zh (``XTD10/``), de fr (``MIC/``) and ja
(``STAIR/``, whose files say ``jp``). Line i of every file describes line i of
``XTD10/test_image_names.txt``.

Record ids are image stems; images are expected in ``train2014/`` under the dataset root.
"""

from __future__ import annotations

from pathlib import Path

from ccr.datamodules.readers._files import check_same_length, image_stem, read_lines
from ccr.datamodules.records import Record

SPLITS = ("test",)
CAPTION_FILES = {
    **{
        lang: f"XTD10/test_1kcaptions_{lang}.txt"
        for lang in ("en", "es", "it", "ko", "pl", "ru", "tr", "zh")
    },
    "de": "MIC/test_1kcaptions_de.txt",
    "fr": "MIC/test_1kcaptions_fr.txt",
    "ja": "STAIR/test_1kcaptions_jp.txt",
}


def read(root: Path, split: str) -> list[Record]:
    """One record per image with the caption of every language whose file is present."""
    image_list = root / "XTD10" / "test_image_names.txt"
    names = [name.strip() for name in read_lines(image_list)]
    captions: dict[str, list[str]] = {}
    for lang, relative in CAPTION_FILES.items():
        path = root / relative
        if path.is_file():
            lines = read_lines(path)
            check_same_length(path, lines, image_list, len(names))
            captions[lang] = lines
    if not captions:
        raise FileNotFoundError(
            f"{root}: none of the XTD10 caption files {sorted(CAPTION_FILES.values())}"
        )
    return [
        Record(
            image_stem(name),
            f"train2014/{name}",
            {lang: [lines[i].strip()] for lang, lines in captions.items()},
        )
        for i, name in enumerate(names)
    ]
