"""CL2CM on streamed shards (``data=shards``): the triples (image, English caption i, caption i of a
target language) come out of the shard stream, one epoch giving the map-style triple index of the
same records (weakly aligned ones left out and counted), with the stream's guarantees: equal
batches on every rank, undecodable samples dropped and counted, exact resume."""

import json
import logging
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import kill_and_resume_on_shards, on_shards, single_and_two_nodes
from test_shards import LANGUAGES, corrupt, make_records, write_uneven

from ccr.datamodules import shards, triples
from ccr.datamodules.datasets import ImageTransform
from ccr.datamodules.triples import TripleStream, triple_census, triple_dataloader, triple_index
from ccr.experiments.config import compose
from ccr.experiments.shards import main as write_shards
from ccr.experiments.train import build_datamodule

REPO = Path(__file__).resolve().parents[1]
WORLD = [
    "data.synthetic.num_train=30",
    "data.synthetic.num_val=8",
    "data.synthetic.num_test=8",
    "data.synthetic.num_pretrain=30",
    "data.synthetic.weak_fraction=0.4",
    "data.languages=[en,de,ja]",
    "data.backbones=null",
]
# 30 records in shards of 7, 7, 7, 7 and 2 samples
STREAMED = [
    "method=cl2cm",
    "data=shards",
    "data.languages=[en,de,ja]",
    "data.batch_size=10",
    "data.eval_batch_size=16",
    "data.num_workers=0",
    "data.stream_slots=1",
    "data.shuffle_buffer=1",
    "data.image_size=32",
    "data.max_length=48",
    "data.tokenizer.vocab_size=400",
]


@pytest.fixture(scope="module")
def sharded_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cl2cm_sharded")
    write_shards(
        ["write", str(root / "shards"), "--shard-size", "7", f"data.root={root / 'world'}", *WORLD]
    )
    return root


@pytest.fixture(scope="module")
def map_style(sharded_world):
    cfg = compose(["method=cl2cm", f"data.root={sharded_world / 'world'}", *WORLD])
    return build_datamodule(cfg, roles=("train",))


def streamed_datamodule(root, *extra):
    cfg = compose(
        [
            *STREAMED,
            f"data.root={root / 'shards'}",
            f"data.cache_dir={root / 'cache'}",
            *extra,
        ]
    )
    return build_datamodule(cfg, roles=("train",))


def keep_texts(items):
    return {"triples": [(i["id"], i["source"], i["target"], i["language"]) for i in items]}


def test_one_streamed_epoch_gives_the_map_style_triples_of_the_same_records(
    sharded_world, map_style, caplog
):
    records = map_style.records("train")
    weak = [r for r in records if r.extras.get("alignment") == "weak"]
    strict = [r for r in records if r.extras.get("alignment") != "weak"]
    assert 0 < len(weak) < len(records)
    expected = Counter(
        (strict[r].id, strict[r].captions["en"][i], strict[r].captions[lang][i], lang)
        for r, i, lang in triple_index(strict, "en", ["de", "ja"])
    )
    assert sum(expected.values()) == len(strict) * 5 * 2  # a record may repeat a caption

    with caplog.at_level(logging.INFO):
        loader = triple_dataloader(streamed_datamodule(sharded_world))
    assert f"cl2cm triples: {sum(expected.values())} (en -> ['de', 'ja']) from " in caplog.text
    assert f"{len(weak)} weakly aligned samples left out" in caplog.text
    assert isinstance(loader, shards.StreamLoader)
    loader.dataset.collate = keep_texts  # the items themselves, before tokenisation
    streamed = [t for batch in loader for t in batch["triples"]]
    assert len(loader) == len(streamed) // 10
    assert Counter(streamed) == expected


def test_streamed_triple_batches_have_the_map_style_keys_and_shapes(sharded_world, map_style):
    streamed = next(iter(triple_dataloader(streamed_datamodule(sharded_world))))
    mapped = next(iter(triple_dataloader(map_style)))
    # plus the stream's own count of dropped samples, as every streamed batch carries
    assert streamed.keys() == mapped.keys() | {"skipped_samples"}
    assert streamed["images"].shape == (10, 3, 32, 32)
    for side in ("src", "tgt"):
        assert streamed[f"{side}_input_ids"].shape == streamed[f"{side}_attention_mask"].shape
        assert streamed[f"{side}_input_ids"].shape[0] == 10
    assert set(streamed["tgt_languages"]) <= {"de", "ja"} and streamed["skipped_samples"] == []


def test_a_shuffled_multi_slot_stream_gives_only_triples_of_strictly_aligned_records(
    sharded_world, map_style
):
    records = map_style.records("train")
    strict = [r for r in records if r.extras.get("alignment") != "weak"]
    known = {
        (strict[r].id, strict[r].captions["en"][i], strict[r].captions[lang][i], lang)
        for r, i, lang in triple_index(strict, "en", ["de", "ja"])
    }
    loader = triple_dataloader(
        streamed_datamodule(sharded_world, "data.stream_slots=2", "data.shuffle_buffer=16"),
        "en",
        ["ja"],
    )
    loader.dataset.collate = keep_texts
    streamed = [t for batch in loader for t in batch["triples"]]
    assert len(streamed) == len(loader) * 10 == (len(strict) * 5 // 10) * 10
    assert set(streamed) <= known and {t[3] for t in streamed} == {"ja"}


def triple_stream(index, world=None, rank=None, workers=0, batch_size=4, buffer=5, slots=2):
    return TripleStream(
        index,
        source="en",
        targets=["de"],
        languages=["en", "de"],
        transform=ImageTransform(4, (0, 0, 0), (1, 1, 1)),
        collate=keep_texts,
        batch_size=batch_size,
        seed=0,
        buffer=buffer,
        slots=slots,
        num_workers=workers,
        world=world,
        rank=rank,
    )


def test_triple_stream_epochs_are_sized_by_the_triples_the_shards_hold(tmp_path):
    # make_records: two English and two German captions per record, none in German for record 3k
    index = write_uneven(tmp_path, [3, 17, 5, 11, 2, 9])  # 47 records, 31 with German: 62 triples
    stream = triple_stream(index, batch_size=4, slots=2)
    assert sum(stream.unit_counts()) == 62 and len(stream) == 62 // 4


def test_a_split_without_alignment_marks_is_sized_from_its_caption_list_without_reading_a_tar(
    tmp_path, monkeypatch
):
    index = shards.write_split(
        make_records(tmp_path, 20),
        tmp_path / "images",
        tmp_path / "train",
        shard_size=6,
        languages=LANGUAGES,
        captions_parallel=True,
    )
    assert not index.alignment
    # records 3k have no German: shards of records 0-5, 6-11, 12-17, 18-19
    expected = triples.TripleCensus((8, 8, 8, 2), samples=20, weak=0, unreadable=0)
    assert triple_census(replace(index, alignment=True), LANGUAGES, "en", ["de"]) == expected

    def no_tar(path):
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(triples, "metadata_samples", no_tar)
    assert triple_census(index, LANGUAGES, "en", ["de"]) == expected


def test_a_slot_whose_shards_make_no_triple_is_an_error_that_says_so(tmp_path):
    index = write_uneven(tmp_path, [1, 5, 5])  # record 0 has no German caption
    stream = triple_stream(index, batch_size=3, slots=3)
    with pytest.raises(ValueError, match=r"the shards dealt to slot \d hold no triple"):
        list(shards.StreamLoader(stream, 0))


def test_an_undecodable_image_drops_its_triples_and_names_the_sample(tmp_path):
    index = write_uneven(tmp_path, [8])  # records 1, 2, 4, 5, 7 have German: 10 triples
    corrupt(index, 0, "000000002.png", b"not an image")
    loader = shards.StreamLoader(triple_stream(index, batch_size=10, buffer=1, slots=1), 0)
    (batch,) = list(loader)
    assert sorted({t[0] for t in batch["triples"]}) == ["1", "4", "5", "7"]
    assert len(batch["skipped_samples"]) == 2  # its two triples
    assert all("000000002" in s for s in batch["skipped_samples"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_triple_stream_continues_at_the_same_triple(tmp_path, workers):
    index = write_uneven(tmp_path, [7, 9, 8, 10])
    loader = shards.StreamLoader(triple_stream(index, workers=workers), workers)
    epochs = [list(loader), list(loader)]
    fresh = shards.StreamLoader(triple_stream(index, workers=workers), workers)
    assert list(fresh) == epochs[0] and epochs[0] != epochs[1]
    for done in (1, 2, 3):
        resumed = shards.StreamLoader(triple_stream(index, workers=workers), workers)
        resumed.resume(1, done)
        assert list(resumed) == epochs[1][done:]


def stream_batches(rank, init_file, folder, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        index = shards.ShardIndex.load(folder)
        loader = shards.StreamLoader(triple_stream(index, slots=4, buffer=3), 0)
        epochs = [[batch["triples"] for batch in loader] for _ in range(2)]
        count = torch.tensor([len(e) for e in epochs])
        counts = [torch.zeros_like(count) for _ in range(2)]
        dist.all_gather(counts, count)
        (Path(out_dir) / f"rank{rank}.json").write_text(
            json.dumps({"epochs": epochs, "counts": [c.tolist() for c in counts]})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_stream_the_same_number_of_triple_batches_from_unequal_shards(
    tmp_path,
):
    # 62 triples, but unevenly spread: a slot's shards may hold 4 triples or 34
    index = write_uneven(tmp_path, [3, 17, 5, 11, 2, 9])
    processes = mp.start_processes(
        stream_batches,
        args=(str(tmp_path / "init"), str(index.folder), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + 120
    while not processes.join(timeout=5):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail("the two processes did not finish in 120 s")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["counts"] == ranks[1]["counts"] == [[62 // 8, 62 // 8]] * 2
    for rank in ranks:
        assert all(len(batch) == 4 for epoch in rank["epochs"] for batch in epoch)
    first = [{tuple(t) for batch in rank["epochs"][0] for t in batch} for rank in ranks]
    assert not {t[0] for t in first[0]} & {t[0] for t in first[1]}  # different shards per rank


# ---- the CLI: a few steps, and a killed run resumed ---------------------------------------------

# 22 strictly aligned records of the world: 110 (en, de) triples in batches of 16 from 2 slots and
# 2 loader workers: 6 batches per epoch, 3 per worker.
RUN = [
    *STREAMED,
    "method.target_languages=[de]",
    "data.batch_size=16",
    "data.num_workers=2",
    "data.stream_slots=2",
    "data.shuffle_buffer=8",
    "method.image_encoder.name=tiny",
    "method.text_encoder.name=tiny",
    "trainer.max_steps=12",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.check_val_every_n_epoch=1",
    "trainer.log_every_n_steps=1",
    "trainer.progress_refresh_rate=0",
    "trainer.cpu_threads=1",
]


def run(script_args, root, run_id, *extra):
    return on_shards(RUN, script_args, root, run_id, *extra)


@pytest.fixture(scope="module")
def broken_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cl2cm_broken")
    write_shards(
        ["write", str(root / "shards"), "--shard-size", "7", f"data.root={root / 'world'}", *WORLD]
    )
    index = shards.ShardIndex.load(root / "shards" / "train")
    strict = next(  # not a shard's first sample: the check before training decodes those
        sample["__key__"]
        for sample in list(shards.metadata_samples(index.folder / index.files[1]))[1:]
        if json.loads(sample["json"])["extras"]["alignment"] == "strict"
    )
    corrupt(index, 1, f"{strict}.png", b"not a png")  # its 5 triples are dropped and counted
    return root


@pytest.fixture(scope="module")
def uninterrupted(broken_world):
    done = run(["-m", "ccr.experiments.train"], broken_world, "whole")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cl2cm triples: 110 (en -> ['de'])" in done.stdout + done.stderr
    assert "8 weakly aligned samples left out; 6 batches per epoch" in done.stdout + done.stderr
    folder = broken_world / "runs" / "shards" / "cl2cm" / "whole"
    logged = [
        row.split(",")
        for row in (folder / "csv" / "checkpoints" / "metrics.csv").read_text().splitlines()
    ]
    column = logged[0].index("train/skipped_samples")
    counts = [float(row[column]) for row in logged[1:] if row[column]]
    assert len(counts) == 2 and counts[-1] >= 5  # each pass over the broken image drops 5 rows
    return json.loads((folder / "metrics.json").read_text())


@pytest.mark.slow
def test_cl2cm_trains_from_shards_and_a_killed_run_resumes_with_the_same_scores(
    broken_world, uninterrupted
):
    assert uninterrupted["train_steps"] == 12
    # Killed at batch 11 (epoch 1): resumes from step 9, 3 batches into the epoch, so the first
    # resumed batch comes from the other worker than in a fresh epoch.
    result = kill_and_resume_on_shards(RUN, broken_world, "cl2cm", 11)
    assert result["resumed_from_step"] == 9 and result["train_steps"] == 12
    assert result["metrics"] == uninterrupted["metrics"]


@pytest.mark.slow
def test_cl2cm_on_two_local_nodes_scores_like_one_process_with_the_global_batch(sharded_world):
    """``trainer=multinode`` launched as torchrun does on two nodes (both on localhost, one CPU
    process each, gloo), batches of 8 triples per node, against one process with batches of 16:
    the stream gives both the same global batches, and every CL2CM loss is computed over the
    gathered batch, so the scores agree."""
    argv = [
        *RUN,
        f"data.root={sharded_world / 'shards'}",
        f"data.cache_dir={sharded_world / 'cache'}",
        f"run_dir={sharded_world / 'runs'}",
        "trainer.max_steps=6",
        "data.num_workers=0",
    ]
    runs = sharded_world / "runs" / "shards" / "cl2cm"
    one, two = single_and_two_nodes(argv, 8, runs, sharded_world)
    assert two["train_steps"] == 6
    assert two["metrics"].keys() == one["metrics"].keys()
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, abs=1e-5), key
