"""``data=shards``: webdataset shards written from records stream equal batches to every rank and
worker whatever the shard sizes, drop and count bad samples, resume at the same sample, and are
checked before training on a sample only."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from ccr.datamodules import shards
from ccr.datamodules.datasets import ImageTransform
from ccr.datamodules.records import Record
from ccr.datamodules.shards import (
    ShardIndex,
    ShardStream,
    StreamLoader,
    decode_record,
    extract,
    raw_samples,
    sampled_check,
    write_split,
)

LANGUAGES = ["en", "de"]


def make_records(tmp_path, count, start=0):
    """``count`` records with a tiny PNG each (pixel value = the record number) and two
    translations per language; record 3k lacks German."""
    folder = tmp_path / "images"
    folder.mkdir(exist_ok=True)
    records = []
    for i in range(start, start + count):
        Image.fromarray(np.full((4, 4, 3), i % 256, dtype=np.uint8)).save(folder / f"{i}.png")
        captions = {"en": [f"en {i} a", f"en {i} b"]}
        if i % 3:
            captions["de"] = [f"de {i} a", f"de {i} b"]
        records.append(Record(str(i), f"{i}.png", captions, {"objects": [f"o{i % 2}"]}))
    return records


def write_uneven(tmp_path, sizes):
    """Shards of the given sizes (one ``write_split`` per shard, merged into one index)."""
    folder, shards, start = tmp_path / "train", [], 0
    for number, size in enumerate(sizes):
        part = write_split(
            make_records(tmp_path, size, start),
            tmp_path / "images",
            tmp_path / f"part{number}",
            shard_size=size,
            languages=LANGUAGES,
            captions_parallel=True,
        )
        folder.mkdir(exist_ok=True)
        name = f"shard-{number:06d}.tar"
        (part.folder / part.files[0]).rename(folder / name)
        shards.append({"file": name, "samples": size})
        start += size
    (folder / "shards.json").write_text(
        json.dumps({"shards": shards, "languages": LANGUAGES, "captions_parallel": True})
    )
    return ShardIndex.load(folder)


def collate(items):
    return {
        "ids": [item["id"] for item in items],
        "texts": [item["texts"] for item in items],
        "images": torch.stack([item["image"] for item in items]),
    }


def stream(index, world=1, rank=0, workers=0, batch_size=4, buffer=5, seed=0, slots=2):
    return ShardStream(
        index,
        languages=LANGUAGES,
        transform=ImageTransform(4, (0, 0, 0), (1, 1, 1)),
        collate=collate,
        label_index={},
        batch_size=batch_size,
        seed=seed,
        buffer=buffer,
        slots=slots,
        num_workers=workers,
        world=world,
        rank=rank,
    )


def epoch_batches(loader, epochs=1):
    return [[batch for batch in loader] for _ in range(epochs)]


def test_written_shards_give_back_every_record_with_its_captions_and_image(tmp_path):
    records = make_records(tmp_path, 7)
    index = write_split(
        records,
        tmp_path / "images",
        tmp_path / "out",
        shard_size=3,
        languages=LANGUAGES,
        captions_parallel=True,
    )
    assert index.samples == (3, 3, 1) and index.labels == ("o0", "o1")
    decoded = [decode_record(s) for s in raw_samples([index.folder / f for f in index.files])]
    assert [(r.id, r.captions, r.extras) for r, _ in decoded] == [
        (r.id, r.captions, r.extras) for r in records
    ]
    assert list(index.caption_rows()) == [r.captions for r in records]
    extracted = extract(index, tmp_path / "extracted" / "val")
    for record, original in zip(extracted, records, strict=True):
        assert (tmp_path / "extracted" / record.image).read_bytes() == (
            tmp_path / "images" / original.image
        ).read_bytes()


@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_streams_the_same_number_of_batches_whatever_the_shard_sizes(tmp_path, workers):
    index = write_uneven(tmp_path, [3, 17, 5, 11, 2, 9])  # 47 samples
    loaders = [
        StreamLoader(stream(index, world=2, rank=rank, workers=workers, slots=4), workers)
        for rank in range(2)
    ]
    for epochs in (epoch_batches(loader, 2) for loader in loaders):
        assert [len(batches) for batches in epochs] == [47 // 8, 47 // 8]
        assert all(len(batch["ids"]) == 4 for batches in epochs for batch in batches)
    ids = [
        [i for batch in epochs[0] for i in batch["ids"]]
        for epochs in (epoch_batches(loader) for loader in loaders)
    ]
    assert not set(ids[0]) & set(ids[1])  # ranks read different shards in an epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_together_stream_the_batches_of_one_process_with_their_global_batch(
    tmp_path, workers
):
    index = write_uneven(tmp_path, [3, 17, 5, 11, 2, 9])
    single = epoch_batches(StreamLoader(stream(index, batch_size=8, slots=4), 0), 2)
    ranks = [
        epoch_batches(
            StreamLoader(stream(index, world=2, rank=r, workers=workers, slots=4), workers), 2
        )
        for r in range(2)
    ]
    for epoch in range(2):
        assert len(single[epoch]) == len(ranks[0][epoch]) == 47 // 8
        for j, whole in enumerate(single[epoch]):
            parts = [ranks[r][epoch][j] for r in range(2)]
            assert whole["ids"] == parts[0]["ids"] + parts[1]["ids"]
            assert whole["texts"] == parts[0]["texts"] + parts[1]["texts"]
            assert torch.equal(whole["images"], torch.cat([p["images"] for p in parts]))


def test_epochs_deal_shards_differently_and_the_same_seed_repeats_them(tmp_path):
    index = write_uneven(tmp_path, [6, 6, 6, 6])
    first, second = (
        [[b["ids"] for b in e] for e in epoch_batches(StreamLoader(stream(index), 0), 2)]
        for _ in range(2)
    )
    assert first == second and first[0] != first[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_stream_continues_at_the_same_sample_with_the_same_draws(tmp_path, workers):
    index = write_uneven(tmp_path, [7, 9, 8, 10])
    whole = epoch_batches(StreamLoader(stream(index, world=2, rank=1, workers=workers), workers), 2)
    for done in (1, 2, 3):
        loader = StreamLoader(stream(index, world=2, rank=1, workers=workers), workers)
        loader.resume(1, done)
        resumed = epoch_batches(loader, 2)
        assert len(resumed[0]) == len(whole[1]) - done
        for got, expected in zip(resumed[0] + resumed[1], whole[1][done:] + [], strict=False):
            assert got["ids"] == expected["ids"] and got["texts"] == expected["texts"]
            assert torch.equal(got["images"], expected["images"])
        assert [b["ids"] for b in resumed[1]] != []  # the next epoch follows


def test_parallel_captions_keep_one_index_across_languages(tmp_path):
    index = write_uneven(tmp_path, [20])
    texts = [t for batch in StreamLoader(stream(index, slots=1), 0) for t in batch["texts"]]
    pairs = [(en.split()[-1], de.split()[-1]) for en, de in texts if de is not None]
    assert pairs and all(a == b for a, b in pairs) and {a for a, _ in pairs} == {"a", "b"}


def corrupt(index, number, key_suffix, payload):
    """Replace one member of a shard (``<key>.<suffix>``) by ``payload``."""
    path = index.folder / index.files[number]
    members = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            members.append((member, payload if member.name.endswith(key_suffix) else data))
    assert any(member.name.endswith(key_suffix) for member, _ in members), (
        f"no {key_suffix} in {path}"
    )
    with tarfile.open(path, "w") as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_undecodable_samples_are_dropped_from_their_batch_and_named(tmp_path):
    index = write_uneven(tmp_path, [8])
    corrupt(index, 0, "000000002.png", b"not an image")
    corrupt(index, 0, "000000005.json", b"{broken")
    batches = list(StreamLoader(stream(index, batch_size=8, buffer=1, slots=1), 0))
    assert len(batches) == 1 and len(batches[0]["ids"]) == 6
    assert sorted(batches[0]["ids"]) == ["0", "1", "3", "4", "6", "7"]
    skipped = batches[0]["skipped_samples"]
    assert len(skipped) == 2 and any("000000005" in s and "JSON" in s for s in skipped)


def test_the_check_before_training_reads_a_sample_not_every_shard(tmp_path):
    index = write_uneven(tmp_path, [4, 4, 4, 4, 4, 4, 4, 4, 4, 4])
    corrupt(index, 1, "000000000.png", b"broken image")  # shard 1 is not among the sampled ones
    sampled_check(index, LANGUAGES)
    corrupt(index, 0, "000000000.png", b"broken image")
    with pytest.raises(
        ValueError, match=r"shard-000000.tar: sample 000000000: image does not decode"
    ):
        sampled_check(index, LANGUAGES)
    with pytest.raises(ValueError, match=r"languages \['fr'\] are not in the shards"):
        sampled_check(index, ["en", "fr"])


def test_fewer_shards_than_slots_or_slots_not_shared_by_the_processes_is_an_error(tmp_path):
    index = write_uneven(tmp_path, [4, 4, 4])
    with pytest.raises(ValueError, match="stream_slots=4: only 3 shards"):
        stream(index, world=2, slots=4)
    with pytest.raises(ValueError, match="stream_slots=3 is not a multiple of the 2 processes"):
        stream(index, world=2, slots=3)


def test_the_skipped_samples_line_gives_an_example_only_from_a_rank_that_has_one(monkeypatch):
    """Rank 0 skipped nothing while rank 1 skipped 3: rank 0's line gives the counts and no
    example (it has none; rank 1 prints its own), not 'e.g. None'."""
    import types

    messages, logged = [], []
    monkeypatch.setattr(shards, "rank_zero_info", messages.append)
    trainer = types.SimpleNamespace(
        strategy=types.SimpleNamespace(all_gather=lambda t: torch.tensor([0, 3])), global_rank=0
    )
    module = types.SimpleNamespace(device="cpu", log=lambda *a, **k: logged.append(a))
    shards.SkippedSamples().on_train_epoch_end(trainer, module)
    assert logged == [("train/skipped_samples", 3.0)]
    assert messages == ["streamed training data: 3 samples skipped so far (per rank [0, 3])"]
