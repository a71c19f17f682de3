"""Dataset readers: the registry, the real released files in ../shared, and the tiny fixtures."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from ccr.datamodules.readers import names, read_dataset, splits
from ccr.datamodules.readers.parallel_text import read_parallel_text
from ccr.datamodules.records import Record, read_records, write_records

FIXTURES = Path(__file__).parent / "fixtures"
REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real"
IGLUE_REAL = REAL / "iglue" / "datasets"
IGLUE_FIXTURES = FIXTURES / "iglue" / "datasets"
XFLICKRCO_LANGUAGES = {"de", "en", "es", "id", "ja", "ru", "tr", "zh"}


def caption_count(records: list[Record], lang: str) -> int:
    return sum(len(r.captions.get(lang, [])) for r in records)


def assert_well_formed(records: list[Record]) -> None:
    """Invariants every reader promises: str ids, unique, relative image paths, text captions."""
    assert len({r.id for r in records}) == len(records)
    for r in records:
        assert isinstance(r.id, str) and r.id
        assert isinstance(r.image, str) and not Path(r.image).is_absolute()
        assert r.captions and all(
            isinstance(t, str) for texts in r.captions.values() for t in texts
        )


# --- registry -----------------------------------------------------------------------------------


def test_names_lists_every_dataset():
    assert names() == sorted(
        [
            "multi30k",
            "multi30k_task2",
            "xflickrco",
            "flickr30k_iglue",
            "wit",
            "coco_karpathy",
            "xtd10",
            "cc3m_jsonl",
        ]
    )


def test_unknown_dataset_lists_known_ones():
    with pytest.raises(KeyError, match="unknown dataset 'flickr8k'.*multi30k_task2"):
        read_dataset("flickr8k", FIXTURES, "test")


def test_unknown_split_lists_valid_ones():
    with pytest.raises(ValueError, match=r"no split 'test'.*'test_2016_flickr'"):
        read_dataset("multi30k", FIXTURES / "multi30k", "test")
    assert "train_100x5" in splits("xflickrco")


def test_missing_root_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_dataset("xtd10", tmp_path / "nowhere", "test")


def test_missing_file_is_named():
    with pytest.raises(FileNotFoundError, match="val.txt"):
        read_dataset("multi30k", FIXTURES / "multi30k", "val")


# --- real files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split, size", [("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)]
)
def test_multi30k_task1_real_sizes(split, size):
    records = read_dataset("multi30k", REAL / "multi30k", split)
    assert len(records) == size
    assert_well_formed(records)
    for lang in ("en", "de", "fr", "cs"):
        assert caption_count(records, lang) == size
    assert all(len(texts) == 1 for r in records for texts in r.captions.values())


def test_multi30k_real_first_train_line():
    first = read_dataset("multi30k", REAL / "multi30k", "train")[0]
    assert first.id == "1000092795" and first.image == "images/1000092795.jpg"
    assert first.captions["en"] == ["Two young, White males are outside near many bushes."]


def test_multi30k_task2_real_five_captions_same_images_as_task1():
    records = read_dataset("multi30k_task2", REAL / "multi30k", "test_2016")
    assert len(records) == 1000
    assert all(len(r.captions["en"]) == 5 and len(r.captions["de"]) == 5 for r in records)
    task1 = read_dataset("multi30k", REAL / "multi30k", "test_2016_flickr")
    assert [r.id for r in records] == [r.id for r in task1]


def test_xflickrco_real_test():
    records = read_dataset("xflickrco", IGLUE_REAL / "xFlickrCO", "test")
    assert len(records) == 2000
    assert_well_formed(records)
    assert all(set(r.captions) == XFLICKRCO_LANGUAGES for r in records)
    assert all(len(texts) == 1 for r in records for texts in r.captions.values())
    assert all(r.image.startswith("flickr30k-images/") for r in records[:1000])
    assert all(r.image.startswith("val2014/COCO_val2014_") for r in records[1000:])
    empty = {
        (lang, r.id) for r in records for lang, texts in r.captions.items() if not texts[0].strip()
    }
    assert empty == {("de", "COCO_val2014_000000122239"), ("id", "6312211170")}


def test_xflickrco_real_few_shot_train():
    records = read_dataset("xflickrco", IGLUE_REAL / "xFlickrCO", "train_100")
    assert len(records) == 100  # de and ja few-shot files list the same 100 images
    assert all(set(r.captions) == {"de", "ja"} for r in records)


def test_xflickrco_real_flickr_half_is_multi30k_test():
    xflickrco = read_dataset("xflickrco", IGLUE_REAL / "xFlickrCO", "test")
    multi30k = read_dataset("multi30k", REAL / "multi30k", "test_2016_flickr")
    assert [r.id for r in xflickrco[:1000]] == [r.id for r in multi30k]


@pytest.mark.parametrize(
    "split, multi30k_split, size", [("valid", "val", 1014), ("test", "test_2016_flickr", 1000)]
)
def test_flickr30k_iglue_real(split, multi30k_split, size):
    records = read_dataset("flickr30k_iglue", IGLUE_REAL / "flickr30k", split)
    assert len(records) == size
    assert_well_formed(records)
    assert all(list(r.captions) == ["en"] and len(r.captions["en"]) == 5 for r in records)
    assert [r.id for r in records] == [
        r.id for r in read_dataset("multi30k", REAL / "multi30k", multi30k_split)
    ]


@pytest.mark.parametrize(
    "lang, lines, images",
    [("en", 1000, 685), ("ja", 1000, 842), ("id", 901, 854), ("tr", 721, 681)],
)
def test_wit_real_per_language(lang, lines, images):
    records = read_dataset("wit", IGLUE_REAL / "wit", f"test_{lang}")
    assert len(records) == images
    assert caption_count(records, lang) == lines
    assert_well_formed(records)


def test_wit_real_merged_test_keeps_every_caption():
    records = read_dataset("wit", IGLUE_REAL / "wit", "test")
    assert_well_formed(records)
    assert {lang: caption_count(records, lang) for lang in ("en", "ja", "id", "tr")} == {
        "en": 1000,
        "ja": 1000,
        "id": 901,
        "tr": 721,
    }
    per_language = {
        r.id
        for lang in ("en", "ja", "id", "tr")
        for r in read_dataset("wit", IGLUE_REAL / "wit", f"test_{lang}")
    }
    assert {r.id for r in records} == per_language
    assert any(len(r.captions) > 1 for r in records)


def test_xtd10_real():
    records = read_dataset("xtd10", REAL / "xtd10", "test")
    assert len(records) == 1000
    assert_well_formed(records)
    assert all(
        set(r.captions) == {"en", "es", "it", "ko", "pl", "ru", "tr", "zh", "de", "fr", "ja"}
        for r in records
    )
    assert records[0].image == "train2014/COCO_train2014_000000061844.jpg"
    assert records[0].captions["ja"] == ["黒いユニフォームのランナーがホームに帰ってきた"]


# --- fixtures -----------------------------------------------------------------------------------

FIXTURE_CASES = [
    ("multi30k", FIXTURES / "multi30k", "train", 3, {"en", "de", "fr", "cs"}),
    ("multi30k", FIXTURES / "multi30k", "test_2017_mscoco", 2, {"en", "de", "fr"}),
    ("multi30k_task2", FIXTURES / "multi30k", "test_2016", 2, {"en", "de"}),
    ("xflickrco", IGLUE_FIXTURES / "xFlickrCO", "test", 4, XFLICKRCO_LANGUAGES),
    ("xflickrco", IGLUE_FIXTURES / "xFlickrCO", "train_100", 3, {"de", "ja"}),
    ("flickr30k_iglue", IGLUE_FIXTURES / "flickr30k", "valid", 2, {"en"}),
    ("wit", IGLUE_FIXTURES / "wit", "test", 8, {"en", "id"}),
    ("coco_karpathy", FIXTURES / "coco_karpathy", "train", 2, {"en", "ja"}),
    ("coco_karpathy", FIXTURES / "coco_karpathy", "test", 1, {"en", "ja", "zh"}),
    ("xtd10", FIXTURES / "xtd10", "test", 3, {"en", "es", "zh", "de", "ja"}),
    ("cc3m_jsonl", FIXTURES / "cc3m_jsonl", "train", 3, {"en", "de", "fr", "cs", "zh", "ja"}),
]


@pytest.mark.parametrize("name, root, split, size, languages", FIXTURE_CASES)
def test_fixture_sizes_languages_and_jsonl_round_trip(tmp_path, name, root, split, size, languages):
    records = read_dataset(name, root, split)
    assert len(records) == size
    assert_well_formed(records)
    assert {lang for r in records for lang in r.captions} == languages
    write_records(tmp_path / "records.jsonl", records)
    assert read_records(tmp_path / "records.jsonl") == records


def test_multi30k_fixture_alignment_and_mscoco_suffix():
    train = read_dataset("multi30k", FIXTURES / "multi30k", "train")
    assert train[2].captions == {
        "cs": ["Muž jede na modrém kole."],
        "de": ["Ein Mann fährt ein blaues Fahrrad."],
        "en": ["A man rides a blue bicycle."],
        "fr": ["Un homme fait du vélo bleu."],
    }
    mscoco = read_dataset("multi30k", FIXTURES / "multi30k", "test_2017_mscoco")
    assert [r.id for r in mscoco] == [
        "COCO_train2014_000000000009#1001",
        "COCO_train2014_000000000009#1002",
    ]
    assert {r.image for r in mscoco} == {"images/COCO_train2014_000000000009.jpg"}


def test_multi30k_task2_fixture_keeps_description_order():
    first = read_dataset("multi30k_task2", FIXTURES / "multi30k", "test_2016")[0]
    assert first.captions["en"] == [
        "A red ball on green grass.",
        "A ball in a park.",
        "The ball is red.",
        "A round toy on a lawn.",
        "Grass with a red ball.",
    ]


def test_multi30k_short_caption_file_is_named(tmp_path):
    shutil.copytree(FIXTURES / "multi30k", tmp_path / "multi30k")
    with gzip.open(tmp_path / "multi30k/data/task1/raw/train.fr.gz", "wt", encoding="utf-8") as f:
        f.write("Une seule ligne.\n")
    with pytest.raises(ValueError, match=r"train\.fr\.gz: 1 lines but .*train\.txt lists 3 images"):
        read_dataset("multi30k", tmp_path / "multi30k", "train")


def test_xflickrco_fixture_keeps_empty_captions_for_validation():
    records = {r.id: r for r in read_dataset("xflickrco", IGLUE_FIXTURES / "xFlickrCO", "test")}
    assert records["COCO_val2014_000000122239"].captions["de"] == [""]
    assert records["6312211170"].captions["id"] == [""]
    assert records["COCO_val2014_000000391895"].image == "val2014/COCO_val2014_000000391895.jpg"
    assert records["1007129816"].image == "flickr30k-images/1007129816.jpg"


def copy_xflickrco(tmp_path: Path) -> Path:
    root = tmp_path / "xFlickrCO"
    shutil.copytree(IGLUE_FIXTURES / "xFlickrCO", root)
    return root


def test_xflickrco_misaligned_test_file_is_named(tmp_path):
    root = copy_xflickrco(tmp_path)
    path = root / "annotations/ru/test.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    path.write_text("\n".join([lines[1], lines[0]] + lines[2:]) + "\n", encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"ru/test\.jsonl:1: image 6312211170 but \S*de/test\.jsonl has 1007129816"
    ):
        read_dataset("xflickrco", root, "test")


def test_xflickrco_repeated_image_is_named(tmp_path):
    root = copy_xflickrco(tmp_path)
    path = root / "annotations/de/train_100.jsonl"
    first = path.read_text(encoding="utf-8").splitlines()[0]
    path.write_text(path.read_text(encoding="utf-8") + first + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train_100\.jsonl:4: image .* already listed on line 1"):
        read_dataset("xflickrco", root, "train_100")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"sentences": ["x"], "id": "1"', r"en/test\.jsonl:2: not valid JSON"),
        ('{"sentences": ["x"], "id": "1"}', r"en/test\.jsonl:2: no field 'img_path'"),
        (
            '{"sentences": "x", "id": "1", "img_path": "1.jpg"}',
            r"en/test\.jsonl:2: field 'sentences' must be list",
        ),
    ],
)
def test_iglue_bad_line_names_file_line_and_field(tmp_path, line, message):
    root = copy_xflickrco(tmp_path)
    path = root / "annotations/en/test.jsonl"
    path.write_text(
        path.read_text(encoding="utf-8").splitlines()[0] + "\n" + line + "\n", encoding="utf-8"
    )
    with pytest.raises(ValueError, match=message):
        read_dataset("xflickrco", root, "test")


def test_wit_fixture_groups_captions_by_image():
    records = {r.id: r for r in read_dataset("wit", IGLUE_FIXTURES / "wit", "test")}
    assert len(records["wit-test_4"].captions["en"]) == 2
    assert set(records["wit-test_67"].captions) == {"en", "id"}
    assert records["wit-test_0"].image == "images/wit-test_0.jpg"
    assert records["wit-test_0"].extras["image_url"].endswith("311_South_Wacker_Drive_060528.jpg")
    only_id = read_dataset("wit", IGLUE_FIXTURES / "wit", "test_id")
    assert [r.id for r in only_id] == ["wit-test_20", "wit-test_61", "wit-test_67", "wit-test_7639"]
    assert only_id[3].captions == {"id": [""]}  # the real file's blank caption, left to validation


def wit_line(wit_ix: str, url: str, caption: str) -> str:
    return json.dumps(
        {
            "image_idx": 1,
            "image_url": url,
            "meta_url": "m",
            "caption_reference_description": caption,
            "language": "en",
            "page_url": "p",
            "wit_ix": wit_ix,
        }
    )


def test_wit_decodes_html_entities(tmp_path):
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations/test_en.jsonl").write_text(
        wit_line("w1", "http://x/a.PNG", "Saint Peter&#39;s &amp; more") + "\n"
    )
    (record,) = read_dataset("wit", tmp_path, "test_en")
    assert record.captions == {"en": ["Saint Peter's & more"]}
    assert record.image == "images/w1.png"


def test_wit_conflicting_image_url_is_named(tmp_path):
    (tmp_path / "annotations").mkdir()
    lines = [wit_line("w1", "http://x/a.jpg", "one"), wit_line("w1", "http://x/b.jpg", "two")]
    (tmp_path / "annotations/test_en.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match=r"test_en\.jsonl:2: wit_ix w1 has image_url http://x/b\.jpg"
    ):
        read_dataset("wit", tmp_path, "test_en")


def test_coco_karpathy_fixture_joins_stair_and_coco_cn():
    train = {r.id: r for r in read_dataset("coco_karpathy", FIXTURES / "coco_karpathy", "train")}
    assert set(train) == {
        "COCO_train2014_000000057870",
        "COCO_val2014_000000522418",
    }  # train + restval
    assert train["COCO_train2014_000000057870"].captions["ja"] == [
        "木のテーブルの上に料理が並んでいる",
        "テーブルに皿が置かれている",
    ]
    (test,) = read_dataset("coco_karpathy", FIXTURES / "coco_karpathy", "test")
    assert test.image == "val2014/COCO_val2014_000000391895.jpg"
    assert test.captions == {
        "en": ["A man riding a moped on a dirt road.", "A person on a motorbike."],
        "ja": ["男性が原付に乗っている"],
        "zh": ["一个男人骑着摩托车在土路上。"],
    }
    (val,) = read_dataset("coco_karpathy", FIXTURES / "coco_karpathy", "val")
    assert val.captions["zh"] == ["一个拿着雨伞的孩子", "男孩撑着一把伞"]


def test_coco_karpathy_without_optional_files_is_english(tmp_path):
    shutil.copy(FIXTURES / "coco_karpathy/dataset_coco.json", tmp_path)
    records = read_dataset("coco_karpathy", tmp_path, "test")
    assert [list(r.captions) for r in records] == [["en"]]


def test_coco_cn_bad_line_is_named(tmp_path):
    shutil.copytree(FIXTURES / "coco_karpathy", tmp_path / "coco")
    path = tmp_path / "coco/coco-cn-version1805v1.1/imageid.human-written-caption.txt"
    path.write_text("COCO_val2014_000000391895 no tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"human-written-caption\.txt:1: expected"):
        read_dataset("coco_karpathy", tmp_path / "coco", "test")


def test_xtd10_fixture_maps_jp_to_ja_and_reads_file_without_final_newline():
    records = read_dataset("xtd10", FIXTURES / "xtd10", "test")
    assert records[2].captions["ja"] == ["シマウマが草原で草を食べている"]
    assert records[2].captions["zh"] == ["一匹斑马在草地上吃草"]
    assert records[0].id == "COCO_train2014_000000000025"


def test_xtd10_length_mismatch_is_named(tmp_path):
    shutil.copytree(FIXTURES / "xtd10", tmp_path / "xtd10")
    (tmp_path / "xtd10/XTD10/test_1kcaptions_es.txt").write_text("solo una\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"test_1kcaptions_es\.txt: 1 lines but .*lists 3 images"):
        read_dataset("xtd10", tmp_path / "xtd10", "test")


def test_cc3m_fixture_caption_lists_and_ids():
    records = read_dataset("cc3m_jsonl", FIXTURES / "cc3m_jsonl", "train")
    assert [r.id for r in records] == ["images/000000001", "images/000000002", "cc3m-3"]
    assert records[1].captions == {
        "en": ["a red car", "a car parked on a street"],
        "de": ["ein rotes Auto", "ein geparktes Auto"],
    }
    assert records[2].image == "images/000000003.jpg"


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"binary": "aGk=", "caption": {"en": "x"}}, r"part-0\.jsonl:1: no image path"),
        (
            {"image": "a.jpg", "caption": "x"},
            r"part-0\.jsonl:1: field 'caption' must be dict or list",
        ),
        (
            {"image": "a.jpg", "caption": [{"en": 3}]},
            r"part-0\.jsonl:1: field 'caption' must map language",
        ),
    ],
)
def test_cc3m_bad_line_is_named(tmp_path, obj, message):
    (tmp_path / "train").mkdir()
    (tmp_path / "train/part-0.jsonl").write_text(json.dumps(obj) + "\n")
    with pytest.raises(ValueError, match=message):
        read_dataset("cc3m_jsonl", tmp_path, "train")


def test_cc3m_split_without_shards_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"val: no shard files"):
        read_dataset("cc3m_jsonl", tmp_path, "val")


def test_a_parallel_text_header_naming_a_language_twice_up_to_spaces_is_an_error(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("en\ten \nhello\thallo\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs\.tsv:1: the header must name distinct languages"):
        read_parallel_text(path)


# --- text encodings -----------------------------------------------------------------------------

LATIN1_CAPTION = "Un café.\n".encode("latin-1")  # 0xe9: not UTF-8


def test_multi30k_caption_file_not_utf8_is_named_with_its_line(tmp_path):
    shutil.copytree(FIXTURES / "multi30k", tmp_path / "multi30k")
    path = tmp_path / "multi30k/data/task1/raw/train.fr.gz"
    with gzip.open(path, "rb") as f:
        lines = f.read().split(b"\n")
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join([lines[0], LATIN1_CAPTION.rstrip(b"\n"), *lines[2:]]))
    with pytest.raises(ValueError, match=r"train\.fr\.gz:2: not UTF-8 text \(byte 0xe9"):
        read_dataset("multi30k", tmp_path / "multi30k", "train")


def test_xflickrco_jsonl_not_utf8_is_named_with_its_line(tmp_path):
    root = copy_xflickrco(tmp_path)
    path = root / "annotations/de/test.jsonl"
    raw = path.read_bytes()
    line = raw[: raw.index("ü".encode())].count(b"\n") + 1
    path.write_bytes(raw.replace("ü".encode(), "ü".encode("latin-1"), 1))
    with pytest.raises(ValueError, match=rf"de/test\.jsonl:{line}: not UTF-8 text \(byte 0xfc"):
        read_dataset("xflickrco", root, "test")


def test_parallel_tsv_not_utf8_is_named_with_its_line(tmp_path):
    from ccr.datamodules.readers.parallel_text import read_parallel_text

    path = tmp_path / "pairs.tsv"
    path.write_bytes(b"en\tfr\nA dog.\tUn chien.\nA coffee.\t" + LATIN1_CAPTION)
    with pytest.raises(ValueError, match=r"pairs\.tsv:3: not UTF-8 text \(byte 0xe9"):
        read_parallel_text(path)
