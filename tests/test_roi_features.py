"""Precomputed detector ROI features (``data.roi_features``, RC3 spec §2.8 first choice): the two
stores, their one-line errors, padding to ``data.roi_regions``, batches aligned with their images,
and RC3 training and scoring on the shipped features instead of the grid stand-in."""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.records import Record
from ccr.datamodules.roi_features import ImageRois, RoiStore, lookup_keys
from ccr.experiments.config import compose

DIM = 8


def regions(seed: int, count: int, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, dim)).astype(np.float32)


def write_lmdb(path: Path, items: dict[str, dict]) -> None:
    """A store in VOLTA's h5_to_lmdb.py layout: id -> pickled dict, plus the ``keys`` list."""
    lmdb = pytest.importorskip(
        "lmdb", reason="the lmdb package is not installed (pip install -e '.[roi]')"
    )
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for key, item in items.items():
            txn.put(key.encode(), pickle.dumps({**item, "img_id": key}))
        txn.put(b"keys", pickle.dumps([key.encode() for key in items]))
    env.close()


def write_npy(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for key, array in arrays.items():
        np.save(folder / f"{key}.npy", array)


def test_lmdb_store_returns_the_stored_regions_by_id(tmp_path):
    stored = {"1000092795": regions(0, 3), "COCO_val2014_000000391895.jpg": regions(1, 2)}
    legacy = regions(2, 4)  # older VOLTA stores: a base64 float32 buffer beside num_boxes
    write_lmdb(
        tmp_path / "f.lmdb",
        {
            **{
                key: {
                    "features": value,
                    "boxes": np.zeros((len(value), 4), np.float32),
                    "img_h": 10,
                    "img_w": 20,
                }
                for key, value in stored.items()
            },
            "legacy": {"features": base64.b64encode(legacy.tobytes()), "num_boxes": 4},
        },
    )
    store = RoiStore(tmp_path / "f.lmdb", allow_pickle=True)
    assert store.dim == DIM and str(tmp_path / "f.lmdb") in store.describe()
    for key, value in {**stored, "legacy": legacy}.items():
        np.testing.assert_array_equal(store.features(key), value)
    assert sorted(store.backend.keys()) == sorted([*stored, "legacy"])  # "keys" is no image


def test_lmdb_rows_load_in_worker_processes_and_a_second_reader(tmp_path):
    """LMDB forbids an environment across fork and opening a path twice in one process: loader
    workers reopen the store, and a second store on the same path (a re-evaluation) shares it."""
    stored = {str(i): regions(i, 1 + i % 3) for i in range(6)}
    write_lmdb(tmp_path / "f.lmdb", {key: {"features": value} for key, value in stored.items()})
    keys = sorted(stored)
    rois = ImageRois(RoiStore(tmp_path / "f.lmdb", allow_pickle=True), keys, regions=3)
    loader = torch.utils.data.DataLoader(rois, batch_size=2, num_workers=2)
    rows = torch.cat([batch["roi_features"] for batch in loader])
    again = ImageRois(RoiStore(tmp_path / "f.lmdb", allow_pickle=True), keys, regions=3)
    for row, key in enumerate(keys):
        torch.testing.assert_close(rows[row], padded(stored[key], 3))
        torch.testing.assert_close(again[row]["roi_features"], rows[row])


def test_npy_folder_store_reads_npy_and_npz_files(tmp_path):
    write_npy(tmp_path / "rois", {"a": regions(0, 3)})
    np.savez(tmp_path / "rois" / "b.npz", features=regions(1, 5), boxes=np.zeros((5, 4)))
    store = RoiStore(tmp_path / "rois")
    np.testing.assert_array_equal(store.features("a"), regions(0, 3))
    np.testing.assert_array_equal(store.features("b"), regions(1, 5))
    assert store.features("b").dtype == np.float32


def test_records_are_found_by_id_file_name_or_stem(tmp_path):
    write_npy(tmp_path / "rois", {"r1": regions(0, 2), "2.jpg": regions(1, 2), "3": regions(2, 2)})
    records = [
        Record("r1", "images/1.jpg", {}),
        Record("x2", "images/2.jpg", {}),
        Record("x3", "images/3.jpg", {}),
    ]
    assert lookup_keys(records[1]) == ["x2", "2.jpg", "2"]
    kept, keys, skipped = RoiStore(tmp_path / "rois").match(records, "toy/test", "error")
    assert kept == records and keys == {"r1": "r1", "x2": "2.jpg", "x3": "3"} and skipped == []


def test_a_width_mismatch_is_one_line_naming_store_image_and_field(tmp_path):
    write_npy(tmp_path / "rois", {"a": regions(0, 3), "b": regions(1, 3, dim=DIM - 2)})
    store = RoiStore(tmp_path / "rois")
    odd = "b" if store.probe == "a" else "a"
    with pytest.raises(ValueError) as error:
        store.features(odd)
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "rois") in message
    assert f"image '{odd}'" in message and "field 'features'" in message and "wide" in message


def test_a_flat_lmdb_record_is_a_clear_error(tmp_path):
    write_lmdb(tmp_path / "f.lmdb", {"a": {"features": regions(0, 3)[0]}})
    with pytest.raises(ValueError, match=r"f\.lmdb: image 'a': field 'features' has shape \(8,\)"):
        RoiStore(tmp_path / "f.lmdb", allow_pickle=True)


def test_missing_features_fail_naming_the_record_or_are_skipped_and_counted(tmp_path):
    write_npy(tmp_path / "rois", {"a": regions(0, 3)})
    store = RoiStore(tmp_path / "rois")
    records = [Record("a", "a.png", {}), Record("b", "b.png", {})]
    with pytest.raises(
        ValueError,
        match=r"^toy/test: record 'b' has no ROI features in .*rois "
        r"\(looked up \['b', 'b.png'\]\)",
    ):
        store.match(records, "toy/test", "error")
    kept, _, skipped = store.match(records, "toy/test", "skip")
    assert [r.id for r in kept] == ["a"] and skipped == ["b"]
    with pytest.raises(LookupError, match=r"rois: no ROI features for image 'b'$"):
        store.features("b")


def test_rows_are_padded_and_masked_or_cut_to_the_region_count(tmp_path):
    write_npy(tmp_path / "rois", {"few": regions(0, 2), "many": regions(1, 6)})
    rois = ImageRois(RoiStore(tmp_path / "rois"), ["few", "many"], regions=4)
    few = rois[0]
    assert few["roi_features"].shape == (4, DIM) and few["roi_mask"].tolist() == [
        True,
        True,
        False,
        False,
    ]
    torch.testing.assert_close(few["roi_features"][:2], torch.from_numpy(regions(0, 2)))
    assert not few["roi_features"][2:].any()
    with pytest.warns(
        UserWarning, match="image 'many' has 6 regions, more than data.roi_regions=4"
    ):
        many = rois[1]
    assert many["roi_mask"].all()
    torch.testing.assert_close(many["roi_features"], torch.from_numpy(regions(1, 6)[:4]))


# ---- through the datamodule ------------------------------------------------------------------

CAPTIONS = {"en": "a {} square", "de": "ein {} Quadrat"}
COLOURS = ["red", "green", "blue", "white", "black", "grey", "pink", "brown"]


def write_dataset(root: Path, train: int = 8, test: int = 4) -> dict[str, np.ndarray]:
    """A tiny cc3m_jsonl folder (32 px images), a parallel corpus and a .npy ROI folder keyed by
    image stem with 2-4 regions per image; returns the stored regions by record id."""
    (root / "images").mkdir(parents=True)
    stored = {}
    for split, first, count in (("train", 0, train), ("val", train, test)):
        lines = []
        for i in range(first, first + count):
            colour = COLOURS[i % len(COLOURS)]
            Image.new("RGB", (32, 32), (30 * i % 255, 90, 160)).save(root / f"images/{i}.png")
            lines.append(
                json.dumps(
                    {
                        "image": f"images/{i}.png",
                        "caption": {
                            lang: text.format(f"{colour} {i}") for lang, text in CAPTIONS.items()
                        },
                    }
                )
            )
            stored[f"images/{i}"] = regions(i, 2 + i % 3)
        (root / split).mkdir()
        (root / split / "part-00000.jsonl").write_text("\n".join(lines))
    write_npy(
        root / "rois", {record_id.split("/")[1]: value for record_id, value in stored.items()}
    )
    (root / "parallel").mkdir()
    for lang, text in CAPTIONS.items():
        (root / "parallel" / f"{lang}.txt").write_text(
            "\n".join(text.format(colour) for colour in COLOURS) + "\n"
        )
    return stored


def data_overrides(root: Path) -> list[str]:
    return [
        "data=cc3m",
        f"data.root={root}",
        f"data.cache_dir={root / 'cache'}",
        "data.splits.test=val",
        "data.languages=[en,de]",
        "data.batch_size=4",
        "data.eval_batch_size=4",
        "data.num_workers=0",
        "data.image_size=32",
        "data.max_length=16",
        "data.tokenizer.vocab_size=300",
        f"data.roi_features={root / 'rois'}",
        "data.roi_regions=4",
        f"data.parallel_text={root / 'parallel'}",
    ]


def padded(value: np.ndarray, count: int = 4) -> torch.Tensor:
    out = torch.zeros(count, value.shape[1])
    out[: len(value)] = torch.from_numpy(value)
    return out


@pytest.fixture
def dataset(tmp_path):
    return tmp_path, write_dataset(tmp_path)


def test_batches_carry_each_images_own_features(dataset):
    root, stored = dataset
    data = CCRDataModule(compose(data_overrides(root)).data)
    data.prepare_data()
    data.setup("fit")
    assert (data.info.roi_dim, data.info.roi_store.startswith(str(root / "rois"))) == (DIM, True)
    batches = list(data.train_dataloader())
    assert len(batches) == 2
    for batch in batches:
        assert batch["roi_features"].shape == (4, 4, DIM) and batch["roi_mask"].dtype == torch.bool
        for row, record_id in enumerate(batch["ids"]):
            torch.testing.assert_close(batch["roi_features"][row], padded(stored[record_id]))
            assert int(batch["roi_mask"][row].sum()) == len(stored[record_id])
    view = data.eval_view("test")
    for batch in view.image_loader(3):
        for row, index in enumerate(batch["index"].tolist()):
            torch.testing.assert_close(
                batch["roi_features"][row], padded(stored[view.image_ids[index]])
            )
            assert int(batch["roi_mask"][row].sum()) == len(stored[view.image_ids[index]])


def test_a_record_without_features_stops_setup_or_is_skipped(dataset):
    root, _ = dataset
    (root / "rois" / "3.npy").unlink()
    with pytest.raises(
        ValueError, match=r"cc3m_jsonl/train: record 'images/3' has no ROI features"
    ):
        CCRDataModule(compose(data_overrides(root)).data).setup("fit")
    data = CCRDataModule(compose([*data_overrides(root), "data.on_missing_roi=skip"]).data)
    data.setup("fit")
    assert "images/3" not in {r.id for r in data.records("train")}
    assert len(data.records("train")) == 7


def test_data_without_the_key_ships_no_features(dataset):
    root, _ = dataset
    data = CCRDataModule(compose([*data_overrides(root), "data.roi_features=null"]).data)
    data.setup("fit")
    assert data.info.roi_dim is None
    assert "roi_features" not in next(iter(data.train_dataloader()))
    assert "roi_features" not in next(iter(data.eval_view("test").image_loader(4)))


@pytest.mark.parametrize(
    "bad, reason",
    [
        (np.full((2, DIM), np.nan, np.float32), r"holds NaN or infinite values"),
        (np.zeros((2, DIM), np.int64), r"holds int64, not floats"),
        (np.zeros((2, DIM, 1), np.float32), r"has shape \(2, 8, 1\)"),
        (np.zeros((2, DIM + 1), np.float32), r"is 9 wide, but the store's features are 8 wide"),
    ],
)
def test_bad_features_of_any_record_stop_setup_naming_the_image(dataset, bad, reason):
    """A test image's broken features are found when the data is set up, before any training."""
    root, _ = dataset
    np.save(root / "rois" / "10.npy", bad)  # images/10 is in the test split (val)
    data = CCRDataModule(compose(data_overrides(root)).data)
    data.setup("fit")
    with pytest.raises(ValueError, match=rf"rois: image '10': field 'features' {reason}"):
        data.records("test")


def test_a_pickled_lmdb_needs_the_opt_in_because_unpickling_runs_code(tmp_path):
    write_lmdb(tmp_path / "f.lmdb", {"a": {"features": regions(0, 3)}})
    with pytest.raises(
        ValueError,
        match=r"f\.lmdb: image 'a': the value is a Python pickle .*"
        r"set data\.roi_allow_pickle=true",
    ):
        RoiStore(tmp_path / "f.lmdb")
    np.testing.assert_array_equal(
        RoiStore(tmp_path / "f.lmdb", allow_pickle=True).features("a"), regions(0, 3)
    )


def test_an_lmdb_of_npy_values_reads_without_unpickling(tmp_path):
    lmdb = pytest.importorskip(
        "lmdb", reason="the lmdb package is not installed (pip install -e '.[roi]')"
    )
    env = lmdb.open(str(tmp_path / "f.lmdb"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for key, value in {"a": regions(0, 3), "b": regions(1, 2)}.items():
            buffer = io.BytesIO()
            np.save(buffer, value, allow_pickle=False)
            txn.put(key.encode(), buffer.getvalue())
    env.close()
    store = RoiStore(tmp_path / "f.lmdb")  # no opt-in needed
    np.testing.assert_array_equal(store.features("b"), regions(1, 2))


# ---- RC3 on shipped features -------------------------------------------------------------------

RC3_TINY = [
    "method=rc3",
    "method.backbone.pretrained=null",
    "method.backbone.d_model=32",
    "method.backbone.heads=2",
    "method.backbone.ffn_dim=64",
    "method.first_stage.dim=16",
    f"method.visual.roi_dim={DIM}",
    "method.visual.strict_input=roi",
    "method.pretrain.max_steps=1",
    "method.finetune.max_steps=1",
    "method.first_stage.image_encoder=null",
    "method.first_stage.text_encoder=null",
    "trainer.progress_refresh_rate=0",
    "trainer.log_every_n_steps=1",
    "trainer.cpu_threads=1",
]  # two pytest workers share the cores


def test_rc3_trains_and_scores_on_the_shipped_features(dataset, monkeypatch):
    """One training step and the test evaluation read the store: the grid backbone is never built
    nor called, the ITM re-ranking sees each image's own projected regions, and other stored
    values give other scores."""
    from ccr.experiments.evaluate import evaluate
    from ccr.experiments.train import train
    from ccr.methods.rc3 import module as rc3
    from ccr.methods.rc3.regions import GridRegions

    root, stored = dataset

    def no_grid(*args):
        raise AssertionError("the grid backbone ran although the data ships ROI features")

    monkeypatch.setattr(GridRegions, "forward", no_grid)
    monkeypatch.setattr(GridRegions, "from_config", classmethod(no_grid))
    strict = []
    original_strict = rc3.RC3.strict_visual

    def spy_strict(self, triplets):
        strict.append((triplets.roi, triplets.roi_mask))
        return original_strict(self, triplets)

    monkeypatch.setattr(rc3.RC3, "strict_visual", spy_strict)
    run = train(compose([*RC3_TINY, *data_overrides(root), f"run_dir={root / 'runs'}"]))
    assert strict and strict[0][0] is not None and not strict[0][1].all()  # padded regions, masked

    scored = []
    original_scorer, original_match = rc3.RC3.cross_encoder, rc3.RC3.match_logits

    def spy_scorer(self, image_cache, text_cache):
        view = self.trainer.datamodule.eval_view("test")
        expected = torch.stack([padded(stored[i]) for i in view.image_ids])
        with torch.no_grad():
            torch.testing.assert_close(image_cache["tokens"], self.net.visual.rois(expected))
        assert image_cache["mask"].sum(1).tolist() == [len(stored[i]) for i in view.image_ids]
        return original_scorer(self, image_cache, text_cache)

    def spy_match(self, visual, input_ids, attention_mask):
        logits = original_match(self, visual, input_ids, attention_mask)
        scored.append(logits)
        return logits

    monkeypatch.setattr(rc3.RC3, "cross_encoder", spy_scorer)
    monkeypatch.setattr(rc3.RC3, "match_logits", spy_match)
    checkpoint = Path(json.loads((run / "metrics.json").read_text())["checkpoint"])
    evaluate(checkpoint)
    first = torch.cat(scored)
    scored.clear()
    for record_id, value in stored.items():
        stored[record_id] = value * -3.0 + 1.0
        np.save(root / "rois" / f"{record_id.split('/')[1]}.npy", stored[record_id])
    evaluate(checkpoint)
    assert first.shape == torch.cat(scored).shape and not torch.allclose(first, torch.cat(scored))


def test_rc3_refuses_features_of_another_width(dataset):
    from ccr.methods.rc3.module import RC3

    root, _ = dataset
    data = CCRDataModule(compose(data_overrides(root)).data)
    data.setup("fit")
    cfg = compose([*RC3_TINY, "method.visual.roi_dim=16"])
    with pytest.raises(
        ValueError,
        match=r"rc3: method.visual.roi_dim=16, but data.roi_features "
        r".*rois \(image '\d+', field 'features'\) is 8 wide",
    ):
        RC3(cfg.method, cfg.optim, data.info, cfg.evaluation)
