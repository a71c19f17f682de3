"""Validation at setup: unique ids, empty captions, requested languages, unusable images."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from PIL import Image

from ccr.datamodules.readers import read_dataset
from ccr.datamodules.records import Record
from ccr.datamodules.validation import validate

FIXTURES = Path(__file__).parent / "fixtures"
REAL_XFLICKRCO = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "data"
    / "real"
    / "iglue"
    / "datasets"
    / "xFlickrCO"
)


def make_records() -> list[Record]:
    return [
        Record("a", "a.png", {"en": ["a cat"], "de": ["eine Katze", "  "]}),
        Record("b", "b.png", {"en": ["a dog", ""], "fr": ["un chien"]}),
        Record("c", "c.png", {"fr": ["un oiseau"]}),
        Record("d", "d.png", {"en": [" "], "de": [""]}),
    ]


def write_png(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (200, 10, 10)).save(path)


def test_clean_records_pass_unchanged():
    records = [
        Record("a", "a.png", {"en": ["a cat"], "de": ["eine Katze"]}),
        Record("b", "b.png", {"en": ["a dog"]}),
    ]
    kept, report = validate(records, languages=["en", "de"], source="toy")
    assert kept == records
    assert (report.records_in, report.records_out) == (2, 2)
    assert report.captions_out == {"en": 2, "de": 1}
    assert report.records_missing_language == {"de": 1}
    assert report.empty_captions == {} and report.records_without_captions == 0


def test_empty_captions_dropped_and_counted_per_language():
    kept, report = validate(make_records(), languages=["en", "de"], source="toy")
    assert report.empty_captions == {"en": 2, "de": 2}
    assert {r.id: r.captions for r in kept} == {
        "a": {"en": ["a cat"], "de": ["eine Katze"]},
        "b": {"en": ["a dog"]},
    }


def test_records_without_requested_caption_dropped_and_counted():
    kept, report = validate(make_records(), languages=["en", "de"], source="toy")
    assert [r.id for r in kept] == ["a", "b"]
    assert report.records_without_captions == 2  # c has only fr, d only empty captions
    assert report.records_out == 2 and report.records_in == 4


def test_unrequested_languages_left_out_and_counted():
    _, report = validate(make_records(), languages=["en", "de"], source="toy")
    assert report.unrequested_captions == {"fr": 2}


def test_input_records_are_not_modified():
    records = make_records()
    before = copy.deepcopy(records)
    validate(records, languages=["en"], source="toy")
    assert records == before


def test_duplicate_ids_are_an_error():
    records = make_records() + [Record("b", "b2.png", {"en": ["another dog"]})]
    with pytest.raises(
        ValueError, match=r"^toy: 1 record ids occur more than once, e\.g\. \['b'\]$"
    ):
        validate(records, languages=["en"], source="toy")


def test_absent_language_lists_languages_present():
    # "ja" is absent; "es" has only an empty caption, so it is not present either
    records = make_records() + [Record("e", "e.png", {"es": [""]})]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "toy: requested languages ['ja'] are not in the data; "
            "languages present: ['de', 'en', 'fr']"
        ),
    ):
        validate(records, languages=["en", "ja"], source="toy")


def test_non_text_caption_names_record_and_field():
    records = [Record("a", "a.png", {"en": ["a cat", None]})]
    with pytest.raises(
        ValueError, match=re.escape("toy: record 'a': captions['en'][1] is NoneType, not text")
    ):
        validate(records, languages=["en"], source="toy")


def test_no_requested_language_is_refused():
    with pytest.raises(ValueError, match="^toy: no languages requested$"):
        validate(make_records(), languages=[], source="toy")


def test_unknown_missing_image_policy_is_refused():
    with pytest.raises(ValueError, match="on_missing_image must be 'error' or 'skip'"):
        validate(make_records(), languages=["en"], source="toy", on_missing_image="ignore")


def test_images_present_pass(tmp_path):
    for name in ("a.png", "b.png"):
        write_png(tmp_path / name)
    kept, report = validate(make_records(), languages=["en"], source="toy", image_root=tmp_path)
    assert [r.id for r in kept] == ["a", "b"] and report.skipped_images == []


def test_missing_image_is_one_line_naming_file_and_record(tmp_path):
    write_png(tmp_path / "a.png")
    with pytest.raises(ValueError) as err:
        validate(make_records(), languages=["en"], source="toy", image_root=tmp_path)
    assert str(err.value) == f"toy: record 'b': image {tmp_path / 'b.png'} is missing"


def test_unreadable_image_is_one_line_naming_file_and_record(tmp_path):
    write_png(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"not an image at all")
    with pytest.raises(ValueError) as err:
        validate(make_records(), languages=["en"], source="toy", image_root=tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"toy: record 'b': image {tmp_path / 'b.png'} cannot be read (")


def test_truncated_png_is_unreadable(tmp_path):
    write_png(tmp_path / "a.png")
    full = (tmp_path / "a.png").read_bytes()
    (tmp_path / "b.png").write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError, match=r"record 'b': image .*b\.png cannot be read"):
        validate(make_records(), languages=["en"], source="toy", image_root=tmp_path)


def test_missing_images_skipped_and_counted_when_configured(tmp_path):
    write_png(tmp_path / "b.png")
    kept, report = validate(
        make_records(), languages=["en"], source="toy", image_root=tmp_path, on_missing_image="skip"
    )
    assert [r.id for r in kept] == ["b"]
    assert report.skipped_images == ["a"]
    assert report.records_out == 1 and report.captions_out == {"en": 1}


def test_record_without_image_is_named_when_images_are_checked(tmp_path):
    records = [Record("a", None, {"en": ["a cat"]})]
    with pytest.raises(ValueError, match=r"^toy: record 'a': has no image$"):
        validate(records, languages=["en"], source="toy", image_root=tmp_path)


def test_summary_is_one_line_with_the_counts():
    _, report = validate(make_records(), languages=["en", "de"], source="toy")
    summary = report.summary()
    assert "\n" not in summary
    assert summary.startswith("toy: kept 2/4 records")
    assert "dropped empty captions de 2, en 2" in summary
    assert "dropped 2 records with no caption in ['en', 'de']" in summary
    assert "left out captions of other languages fr 2" in summary


def test_fixture_images_checked_against_placeholder_pngs(tmp_path):
    records = read_dataset("xflickrco", FIXTURES / "iglue" / "datasets" / "xFlickrCO", "test")
    for record in records:
        write_png(tmp_path / record.image)
    kept, report = validate(
        records, languages=["en", "de"], source="xflickrco/test", image_root=tmp_path
    )
    assert len(kept) == 4 and report.empty_captions == {"de": 1}
    (tmp_path / "val2014" / "COCO_val2014_000000391895.jpg").unlink()
    with pytest.raises(
        ValueError,
        match=r"record 'COCO_val2014_000000391895': image \S*val2014/COCO_\S+\.jpg is missing",
    ):
        validate(records, languages=["en", "de"], source="xflickrco/test", image_root=tmp_path)


def test_real_xflickrco_test_counts_the_two_empty_captions():
    records = read_dataset("xflickrco", REAL_XFLICKRCO, "test")
    kept, report = validate(
        records, languages=["de", "en", "es", "id", "ja", "ru", "tr", "zh"], source="xflickrco/test"
    )
    assert report.empty_captions == {"de": 1, "id": 1}
    assert report.records_out == 2000 and report.records_without_captions == 0
    assert report.captions_out == {
        "de": 1999,
        "en": 2000,
        "es": 2000,
        "id": 1999,
        "ja": 2000,
        "ru": 2000,
        "tr": 2000,
        "zh": 2000,
    }
    assert report.records_missing_language == {"de": 1, "id": 1}


def test_real_xflickrco_absent_language_lists_the_eight():
    records = read_dataset("xflickrco", REAL_XFLICKRCO, "test")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "['fr'] are not in the data; "
            "languages present: ['de', 'en', 'es', 'id', 'ja', 'ru', 'tr', 'zh']"
        ),
    ):
        validate(records, languages=["en", "fr"], source="xflickrco/test")


def _truncated_jpeg(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.effect_noise((64, 64), 60).convert("RGB").save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def test_a_truncated_image_is_named_with_its_record(tmp_path):
    write_png(tmp_path / "a.png")
    _truncated_jpeg(tmp_path / "b.jpg")
    records = [Record("a", "a.png", {"en": ["x"]}), Record("b", "b.jpg", {"en": ["y"]})]
    with pytest.raises(
        ValueError, match=r"toy: record 'b': image .*b\.jpg cannot be read .*truncated"
    ):
        validate(records, languages=["en"], source="toy", image_root=tmp_path)


def test_a_truncated_image_is_skipped_and_counted(tmp_path):
    write_png(tmp_path / "a.png")
    _truncated_jpeg(tmp_path / "b.jpg")
    records = [Record("a", "a.png", {"en": ["x"]}), Record("b", "b.jpg", {"en": ["y"]})]
    kept, report = validate(
        records, languages=["en"], source="toy", image_root=tmp_path, on_missing_image="skip"
    )
    assert [r.id for r in kept] == ["a"] and report.skipped_images == ["b"]
    assert "skipped 1 records with missing/unreadable images" in report.summary()
