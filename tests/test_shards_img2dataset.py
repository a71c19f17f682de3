"""``data=shards`` on img2dataset's own output (``<key>.jpg`` + ``<key>.txt`` + ``<key>.json`` per
sample, ``<shard>_stats.json``, no ``shards.json``): sizes from the stats files or the tar headers,
the ``.txt`` captions in the one configured language, samples without caption or image dropped
and counted, and a one-line error for what cannot be inferred."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image
from test_shards import stream

from ccr.datamodules.shards import ShardIndex, StreamLoader, member_key, sampled_check
from ccr.experiments.config import compose
from ccr.experiments.train import build_datamodule


def jpeg(value):
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(buffer, format="JPEG")
    return buffer.getvalue()


def add(tar, name, payload):
    member = tarfile.TarInfo(name)
    member.size = len(payload)
    tar.addfile(member, io.BytesIO(payload))


def write_img2dataset(folder, shard_sizes, stats=True, no_caption=(), no_image=()):
    """Shards as img2dataset writes them: keys numbered across shards, metadata in .json (no
    ``captions`` field), the caption in .txt; ``no_caption``/``no_image``: keys missing that member."""
    folder.mkdir(parents=True, exist_ok=True)
    key = 0
    for number, size in enumerate(shard_sizes):
        name = f"{number:05d}"
        with tarfile.open(folder / f"{name}.tar", "w") as tar:
            for _ in range(size):
                k = f"{key:09d}"
                if key not in no_image:
                    add(tar, f"{k}.jpg", jpeg(key % 256))
                if key not in no_caption:
                    add(tar, f"{k}.txt", f"a photo number {key}".encode())
                meta = {"url": f"http://example.com/{key}.jpg", "key": k, "status": "success"}
                add(tar, f"{k}.json", json.dumps(meta).encode())
                key += 1
        if stats:
            (folder / f"{name}_stats.json").write_text(
                json.dumps({"count": size + 2, "successes": size, "failed_to_download": 2})
            )


def test_img2dataset_shards_stream_their_txt_captions_in_the_configured_language(tmp_path):
    write_img2dataset(tmp_path / "train", [6, 4, 6], no_caption={3}, no_image={8})
    index = ShardIndex.load(tmp_path / "train", ["en"])
    assert index.samples == (6, 4, 6) and index.languages == ("en",)
    assert not index.captions_parallel and not index.alignment and index.labels == ()
    sampled_check(index, ["en"])
    loader = StreamLoader(stream(index, batch_size=8, slots=1, buffer=1), 0)
    batches = list(loader)
    ids = [i for batch in batches for i in batch["ids"]]
    texts = [t for batch in batches for t in batch["texts"]]
    skipped = [s for batch in batches for s in batch["skipped_samples"]]
    assert len(ids) + len(skipped) == 16  # two batches of 8 raw samples
    assert sorted(ids) == sorted(f"{k:09d}" for k in range(16) if k not in (3, 8))
    assert all(
        en == f"a photo number {int(i)}" and de is None
        for i, (en, de) in zip(ids, texts, strict=True)
    )
    assert len(skipped) == 2
    assert any("000000003 has no caption" in s for s in skipped)
    assert any("000000008" in s and "no image member" in s for s in skipped)
    assert list(index.caption_rows()) == [
        {"en": [f"a photo number {k}"]} for k in range(16) if k != 3
    ]


def test_member_names_group_into_samples_as_webdataset_groups_them():
    assert member_key("000000001.jpg") == ("000000001", "jpg")
    assert member_key("./00000/000000001.tar.json") == ("./00000/000000001", "tar.json")


def test_without_stats_files_the_sample_counts_come_from_the_tar_headers(tmp_path):
    write_img2dataset(tmp_path / "train", [5, 3], stats=False)
    assert ShardIndex.load(tmp_path / "train", ["de"]).samples == (5, 3)


def test_what_img2dataset_output_cannot_say_is_a_one_line_error(tmp_path):
    write_img2dataset(tmp_path / "train", [4])
    with pytest.raises(
        ValueError,
        match=r"train: img2dataset shards .* set data.languages to that one language \(got \['en', 'de'\]\)",
    ):
        ShardIndex.load(tmp_path / "train", ["en", "de"])
    (tmp_path / "train" / "00000_stats.json").write_text('{"successes": "many"}')
    with pytest.raises(ValueError, match=r"00000_stats.json: field 'successes' must be a count"):
        ShardIndex.load(tmp_path / "train", ["en"])
    with pytest.raises(FileNotFoundError, match="no shard index and no .tar shards"):
        ShardIndex.load(tmp_path / "empty", ["en"])


def test_a_run_reads_img2dataset_output_with_data_shards(tmp_path):
    """The datamodule: tokenizer from the .txt captions, batches with tokenised English captions."""
    write_img2dataset(tmp_path / "train", [8, 8])
    cfg = compose(
        [
            "data=shards",
            f"data.root={tmp_path}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.languages=[en]",
            "data.splits.val=null",
            "data.batch_size=4",
            "data.num_workers=0",
            "data.stream_slots=2",
            "data.shuffle_buffer=2",
            "data.image_size=8",
            "data.tokenizer.vocab_size=60",
        ]
    )
    data = build_datamodule(cfg, roles=("train",))
    batches = list(data.train_dataloader())
    assert len(batches) == 4 and all(b["present"].all() for b in batches)
    first = batches[0]
    assert first["input_ids"].shape[:2] == (4, 1) and int(first["attention_mask"].sum()) > 4 * 3
    assert "alignment_weak" not in first and not any(b["skipped_samples"] for b in batches)
