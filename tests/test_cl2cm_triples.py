"""CL2CM's training data (spec cl2cm.md §4): one triple per (English caption, target language),
the target being the translation with the same caption index, weakly aligned records left out;
and the CLI run on a tiny world, which must beat chance retrieval by a stated margin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from worlds import SMALL_PRETRAINED_BACKBONES

from ccr.datamodules.triples import triple_dataloader, triple_index
from ccr.experiments.config import compose
from ccr.experiments.train import build_datamodule

REPO = Path(__file__).resolve().parents[1]
WORLD = [
    "data.synthetic.num_train=24",
    "data.synthetic.num_val=4",
    "data.synthetic.num_test=4",
    "data.batch_size=8",
    "data.tokenizer.vocab_size=300",
    "data.num_workers=0",
    "data.languages=[en,de,ja]",
    "data.synthetic.mt_noise=0.5",
]


@pytest.fixture(scope="module")
def datamodule(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    return build_datamodule(compose(["method=cl2cm", f"data.root={root}", *WORLD]))


def test_every_english_caption_is_one_triple_per_target_language(datamodule):
    records = datamodule.records("train")
    index = triple_index(records, "en", ["de", "ja"])
    assert len(index) == len(records) * 5 * 2
    assert len(set(index)) == len(index)
    loader = triple_dataloader(datamodule)
    dataset = loader.dataset.dataset  # the triples, under the loader's seeded items
    for item in range(0, len(dataset), 7):
        r, i, language = dataset.index[item]
        triple = dataset[item]
        assert triple["source"] == records[r].captions["en"][i]
        assert triple["target"] == records[r].captions[language][i]  # its translation
    batch = next(iter(loader))
    assert batch["images"].shape == (8, 3, 32, 32)
    for side in ("src", "tgt"):
        assert batch[f"{side}_input_ids"].shape == batch[f"{side}_attention_mask"].shape
        assert batch[f"{side}_input_ids"].shape[0] == 8
    assert set(batch["tgt_languages"]) <= {"de", "ja"}


def test_target_languages_are_chosen_and_checked(datamodule):
    only_ja = triple_dataloader(datamodule, "en", ["ja"]).dataset.dataset
    assert {language for _, _, language in only_ja.index} == {"ja"}
    with pytest.raises(ValueError, match="method.target_languages"):
        triple_dataloader(datamodule, "en", ["fr"])
    with pytest.raises(ValueError, match="method.target_languages"):
        triple_dataloader(datamodule, "en", ["en"])
    with pytest.raises(ValueError, match="source language 'cs'"):
        triple_dataloader(datamodule, "cs", None)


def test_weakly_aligned_records_make_no_triples(tmp_path):
    cfg = compose(
        ["method=cl2cm", f"data.root={tmp_path}", *WORLD, "data.synthetic.weak_fraction=0.6"]
    )
    data = build_datamodule(cfg)
    weak = {r.id for r in data.records("train") if r.extras.get("alignment") == "weak"}
    assert weak
    dataset = triple_dataloader(data).dataset.dataset
    assert not weak & {dataset.records[r].id for r, _, _ in dataset.index}
    assert len(dataset) == (len(data.records("train")) - len(weak)) * 5 * 2


TRAIN = [
    "method=cl2cm",
    *SMALL_PRETRAINED_BACKBONES,
    "data.synthetic.num_pretrain=200",
    "trainer.max_steps=150",
    "trainer.progress_refresh_rate=0",
    "trainer.check_val_every_n_epoch=1000",
    "optim.warmup_steps=10",
    "data.synthetic.num_train=200",
    "data.synthetic.num_val=16",
    "data.synthetic.num_test=32",
    "data.batch_size=16",
    "data.eval_batch_size=64",
    "data.tokenizer.vocab_size=300",
    "data.languages=[en,de]",
    "data.synthetic.num_shapes=4",
    "data.synthetic.num_colours=4",
    "data.synthetic.max_objects=1",
    "data.num_workers=0",
]
CHANCE_MARGIN = 12.0  # points of mean t2i recall above chance (measured: about +21 at 150 steps)


@pytest.mark.slow
def test_cli_training_beats_chance_on_a_tiny_world(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [*TRAIN, f"data.root={tmp_path / 'world'}", f"run_dir={tmp_path / 'runs'}"]
    subprocess.run(
        [sys.executable, "-m", "ccr.experiments.train", *argv],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    (path,) = (tmp_path / "runs" / "synthetic" / "cl2cm").glob("*/metrics.json")
    report = json.loads(path.read_text())["metrics"]
    images = 32
    chance = sum(100.0 * min(k, images) / images for k in (1, 5, 10)) / 3  # t2i: one relevant image
    recall = sum(report[f"de/t2i/R@{k}"] for k in (1, 5, 10)) / 3
    assert recall >= chance + CHANCE_MARGIN, (recall, chance)
    assert torch.isfinite(torch.tensor(list(report.values()))).all()
