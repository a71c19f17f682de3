"""CCRDataModule: training batches, evaluation views, parallel text, DataInfo, errors."""

from __future__ import annotations

import json
from pathlib import Path
from unicodedata import normalize

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from ccr.datamodules import synthetic
from ccr.datamodules.datamodule import CCRDataModule, EpochSampler

CONFIG = Path(__file__).resolve().parents[1] / "ccr/experiments/configs/data/synthetic.yaml"
LANGUAGES = ["en", "de", "fr", "cs", "ja", "zh"]


def synthetic_cfg(root: Path, **overrides):
    cfg = OmegaConf.load(CONFIG)
    cfg.root = str(root)
    cfg.batch_size = 8
    cfg.max_length = 40
    cfg.tokenizer.vocab_size = 600
    cfg.synthetic.num_train, cfg.synthetic.num_val, cfg.synthetic.num_test = 32, 6, 10
    cfg.synthetic.num_pretrain = 24
    cfg.synthetic.coverage.de = 0.5
    cfg.synthetic.weak_fraction = 0.5
    cfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture(scope="module")
def dm(tmp_path_factory) -> CCRDataModule:
    module = CCRDataModule(synthetic_cfg(tmp_path_factory.mktemp("synthetic")), seed=0)
    module.prepare_data()
    module.setup("fit")
    return module


def test_info_after_setup(dm, tmp_path):
    info = dm.info
    assert info.languages == LANGUAGES and info.max_length == 40 and info.image_size == 32
    specials = (info.cls_token_id, info.pad_token_id, info.eos_token_id, info.mask_token_id)
    assert specials == (0, 1, 2, 4)
    assert info.vocab_size == dm.tokenizer.vocab_size
    labels = {label for r in dm.records("train") for label in r.extras["objects"]}
    assert info.num_objects == len(labels) > 0
    with pytest.raises(RuntimeError, match="after setup"):
        _ = CCRDataModule(synthetic_cfg(tmp_path)).info


def test_training_batch_shapes_and_dtypes(dm):
    loader = dm.train_dataloader()
    # shuffled and drop_last: under DDP Lightning swaps in its DistributedSampler
    assert loader.drop_last and isinstance(loader.sampler, EpochSampler)
    batch = next(iter(loader))
    assert batch["images"].shape == (8, 3, 32, 32) and batch["images"].dtype == torch.float32
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (8, 6, 40)
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long
    assert batch["present"].shape == (8, 6) and batch["present"].dtype == torch.bool
    assert batch["languages"] == LANGUAGES and len(batch["ids"]) == 8
    assert batch["objects"].shape == (8, dm.info.num_objects)
    assert batch["objects"].dtype == torch.long
    assert batch["alignment_weak"].shape == (8,) and batch["alignment_weak"].dtype == torch.bool


def test_present_mask_follows_partial_coverage(dm):
    by_id = {r.id: r for r in dm.records("train")}
    assert any("de" not in r.captions for r in by_id.values())
    torch.manual_seed(0)
    rows = [(batch, row) for _ in range(3) for batch in dm.train_dataloader() for row in range(8)]
    seen_absent = False
    for batch, row in rows:
        record = by_id[batch["ids"][row]]
        for k, lang in enumerate(LANGUAGES):
            present = lang in record.captions
            assert bool(batch["present"][row, k]) == present
            ids, mask = batch["input_ids"][row, k], batch["attention_mask"][row, k]
            if not present:
                seen_absent = True
                assert (ids == dm.info.pad_token_id).all() and not mask.any()
                continue
            assert ids[0] == dm.info.cls_token_id and mask.sum() > 2
            # the tokenizer NFKC-normalises (fullwidth "，" becomes ","); long captions are cut,
            # possibly inside a character that the small test vocabulary spells in bytes
            text = dm.tokenizer.decode(ids[mask.bool()].tolist()).rstrip("\ufffd")
            captions = [normalize("NFKC", c) for c in record.captions[lang]]
            assert any(c.startswith(text) for c in captions), (text, captions)
    assert seen_absent


def test_object_labels_and_weak_flags_match_records(dm):
    by_id = {r.id: r for r in dm.records("train")}
    batch = next(iter(dm.train_dataloader()))
    for row, record_id in enumerate(batch["ids"]):
        record = by_id[record_id]
        assert int(batch["objects"][row].sum()) == len(record.extras["objects"])
        assert bool(batch["alignment_weak"][row]) == (record.extras["alignment"] == "weak")


def test_language_subset_and_unknown_language(dm):
    batch = next(iter(dm.train_dataloader(languages=["ja", "en"])))
    assert batch["languages"] == ["ja", "en"] and batch["input_ids"].shape[:2] == (8, 2)
    with pytest.raises(
        ValueError, match=r"languages \['xx'\] not configured; configured languages: \['en', 'de'"
    ):
        dm.train_dataloader(languages=["en", "xx"])


def test_eval_view_indexes_every_caption(dm):
    view = dm.eval_view("test")
    records = dm.records("test")
    assert view.image_ids == [r.id for r in records] and len(records) == 10
    assert view.languages == LANGUAGES
    assert len(view.caption_language) == view.caption_image.shape[0] == 10 * 6 * 5
    assert view.caption_image.dtype == torch.long
    for text, image, lang in zip(
        view.captions, view.caption_image.tolist(), view.caption_language, strict=True
    ):
        assert text in records[image].captions[lang]
    assert view.relevance.shape == (10, 10) and torch.allclose(
        view.relevance.diag(), torch.ones(10)
    )
    images = list(view.image_loader(4))
    assert torch.cat([b["index"] for b in images]).tolist() == list(range(10))
    assert images[0]["images"].shape == (4, 3, 32, 32)
    captions = list(view.caption_loader(64))
    assert torch.cat([b["index"] for b in captions]).tolist() == list(range(300))
    assert captions[0]["input_ids"].shape == captions[0]["attention_mask"].shape == (64, 40)
    first = captions[0]["input_ids"][0]
    assert dm.tokenizer.decode(first.tolist()) == view.captions[0]


def test_a_sliced_split_evaluates_its_first_records_only(dm, tmp_path):
    """``data.splits.test=test[:4]``: the eval view holds exactly the first 4 test images and their
    captions (the same texts, relevance block and tokenisation as the full split's)."""
    cfg = dm.cfg.copy()
    cfg.splits.test = "test[:4]"
    sliced = CCRDataModule(cfg, seed=0)
    sliced.prepare_data()
    sliced.setup("fit")
    full, view = dm.eval_view("test"), sliced.eval_view("test")
    assert view.image_ids == full.image_ids[:4]
    keep = full.caption_image < 4
    assert view.captions == [t for t, k in zip(full.captions, keep.tolist(), strict=True) if k]
    assert torch.equal(view.caption_image, full.caption_image[keep])
    assert torch.equal(view.relevance, full.relevance[:4, :4])
    assert len(sliced.records("train")) == len(dm.records("train"))
    assert torch.equal(
        sliced.tokenizer(["a red circle"], 12)["input_ids"],
        dm.tokenizer(["a red circle"], 12)["input_ids"],
    )


def _batches(loaders):
    return [batch for loader in loaders for batch in loader]


def test_an_image_budget_evaluates_exactly_what_sliced_val_and_test_splits_evaluate(dm):
    """``evaluation.max_images=4`` gives the val and test loaders and views that
    ``data.splits.{val,test}=<split>[:4]`` gives (so every score is the same), and leaves train whole."""
    budget = CCRDataModule(dm.cfg.copy(), seed=0, eval_max_images=4)
    cfg = dm.cfg.copy()
    cfg.splits.val, cfg.splits.test = "val[:4]", "test[:4]"
    sliced = CCRDataModule(cfg, seed=0)
    for module in (budget, sliced):
        module.prepare_data()
        module.setup("fit")
    for role in ("val", "test"):
        got, want = budget.eval_view(role), sliced.eval_view(role)
        assert got.image_ids == want.image_ids == dm.eval_view(role).image_ids[:4]
        assert (got.captions, got.caption_language) == (want.captions, want.caption_language)
        assert torch.equal(got.caption_image, want.caption_image) and torch.equal(
            got.relevance, want.relevance
        )
    for got, want in zip(
        _batches(budget.val_dataloader() + budget.test_dataloader()),
        _batches(sliced.val_dataloader() + sliced.test_dataloader()),
        strict=True,
    ):
        assert got.keys() == want.keys()
        for key, value in got.items():  # tensors, and the captions' language lists
            assert torch.equal(value, want[key]) if torch.is_tensor(value) else value == want[key]
    assert len(budget.records("train")) == len(dm.records("train")) == 32


def test_an_image_budget_larger_than_a_split_keeps_the_whole_split(dm):
    budget = CCRDataModule(dm.cfg.copy(), seed=0, eval_max_images=8)  # val has 6 images, test 10
    assert [r.id for r in budget.records("val")] == [r.id for r in dm.records("val")]
    assert [r.id for r in budget.records("test")] == [r.id for r in dm.records("test")][:8]


def test_the_run_datamodule_takes_the_image_budget_from_the_evaluation_section(monkeypatch):
    from ccr.experiments import train
    from ccr.experiments.config import compose

    made = []

    class Recorder:
        def __init__(self, cfg, seed=0, loader=None, **kwargs):
            made.append(kwargs)

        def prepare_data(self): ...
        def setup(self, stage): ...
        def check_split(self, role): ...

    monkeypatch.setattr(train, "CCRDataModule", Recorder)
    train.build_datamodule(compose(["method=rc3"]))
    train.build_datamodule(compose(["method=rc3", "evaluation.max_images=null"]))
    assert [m["eval_max_images"] for m in made] == [100, None]
    assert all(m["load_pretrained_io"] is train.load_pretrained_io for m in made)


@pytest.mark.parametrize(
    "spec, error",
    [("test[:0]", "N >= 1"), ("test[1:]", "optionally with"), ("test[:11]", "has only 10 records")],
)
def test_a_bad_split_slice_is_a_one_line_error_naming_the_key(dm, spec, error):
    cfg = dm.cfg.copy()
    cfg.splits.test = spec
    sliced = CCRDataModule(cfg, seed=0)
    with pytest.raises(ValueError, match=error) as raised:
        sliced.records("test")
    assert "data.splits.test=" in str(raised.value) and "\n" not in str(raised.value)


def test_val_and_test_loaders_are_image_then_caption_loaders(dm):
    image_loader, caption_loader = dm.val_dataloader()
    assert len(image_loader.dataset) == 6 and len(caption_loader.dataset) == 6 * 6 * 5
    assert len(dm.test_dataloader()[0].dataset) == 10


def test_parallel_view_pairs_translations_one_pair_per_batch(dm):
    """Stage 1's parallel text is the world's own corpus (pretrain scenes), never the retrieval
    captions: every pair is line i of two languages' corpus files."""
    loader = dm.parallel_dataloader()
    dataset = loader.dataset.dataset  # SeededItems wraps the ParallelBatches
    pairs = {(src, tgt) for src, tgt, _ in dataset.batches}
    assert pairs == {p for lang in LANGUAGES[1:] for p in (("en", lang), (lang, "en"))}
    corpus = synthetic.parallel_text_dir(Path(dm.image_root).parent / synthetic.PRETRAIN)
    lines = {
        lang: (corpus / f"{lang}.txt").read_text(encoding="utf-8").splitlines()
        for lang in LANGUAGES
    }
    translations = {(src, tgt): set(zip(lines[src], lines[tgt], strict=True)) for src, tgt in pairs}
    for src, tgt, texts in dataset.batches:
        assert 0 < len(texts) <= 8 and set(texts) <= translations[src, tgt]
    assert sum(len(t) for s, g, t in dataset.batches if (s, g) == ("en", "fr")) == 8 * (
        len(lines["en"]) // 8
    )
    batch = next(iter(loader))
    assert batch["src_input_ids"].shape[1] == batch["tgt_attention_mask"].shape[1] == 40
    assert batch["src_language"] != batch["tgt_language"] and "en" in (
        batch["src_language"],
        batch["tgt_language"],
    )


def test_requested_language_absent_lists_present_ones(tmp_path):
    cfg = synthetic_cfg(tmp_path, languages="[en,xx]")
    module = CCRDataModule(cfg)
    with pytest.raises(
        ValueError,
        match=r"\['xx'\] are not in the data; languages present: \['cs', 'de', 'en', 'fr', 'ja', 'zh'\]",
    ):
        module.setup("fit")


def write_cc3m(root: Path, lines: dict[str, list[dict]]) -> None:
    for split, objs in lines.items():
        (root / split).mkdir(parents=True)
        (root / split / "part-00000.jsonl").write_text(
            "\n".join(json.dumps(o, ensure_ascii=False) for o in objs)
        )
        for o in objs:
            (root / "images").mkdir(exist_ok=True)
            Image.new("RGB", (20, 12), (200, 10, 10)).save(root / o["image"])


def reader_cfg(root: Path, on_missing_image: str):
    cfg = synthetic_cfg(root)
    del cfg["synthetic"]
    cfg.name, cfg.splits = "cc3m_jsonl", {"train": "train", "val": "val", "test": None}
    cfg.languages, cfg.batch_size, cfg.on_missing_image = ["en", "ja"], 2, on_missing_image
    cfg.cache_dir = str(root / "cache")
    return cfg


def test_a_reader_dataset_through_the_same_path(tmp_path):
    train = [
        {
            "image": f"images/{i}.png",
            "caption": {"en": f"a red thing number {i}", "ja": f"赤いもの{i}"},
        }
        for i in range(4)
    ] + [{"image": "images/4.png", "caption": {"en": "only english"}}]
    write_cc3m(tmp_path, {"train": train, "val": train[:2]})
    (tmp_path / "images/3.png").unlink()
    with pytest.raises(
        ValueError, match=r"cc3m_jsonl/train: record 'images/3': image .*3.png is missing"
    ):
        CCRDataModule(reader_cfg(tmp_path, "error")).setup("fit")
    module = CCRDataModule(reader_cfg(tmp_path, "skip"))
    module.prepare_data()
    module.setup("fit")
    assert module.info.num_objects == 0 and len(module.records("train")) == 4
    batches = list(module.train_dataloader())
    assert len(batches) == 2 and "objects" not in batches[0] and "alignment_weak" not in batches[0]
    present = {i: p.tolist() for b in batches for i, p in zip(b["ids"], b["present"], strict=True)}
    assert present["images/4"] == [True, False] and present["images/0"] == [True, True]
    assert batches[0]["images"].shape == (2, 3, 32, 32)
    assert len(module.train_dataloader(languages=["ja"]).dataset) == 3  # images/4 has no ja
    assert module.eval_view("val").relevance is None
    with pytest.raises(ValueError, match="has no test split"):
        module.eval_view("test")


def test_a_sampler_resumed_in_a_later_epoch_continues_that_epochs_order():
    """Lightning restarts a mid-epoch run without calling ``set_epoch``: the resumed sampler must
    still yield the rest of the epoch it stopped in, not epoch 0's order."""
    data = list(range(24))
    whole = EpochSampler(data, seed=3)
    whole.set_epoch(2)
    expected = list(whole)[8:]
    resumed = EpochSampler(data, seed=3)
    resumed.resume(2, 8)
    assert list(resumed) == expected
    assert all(epoch == 2 for epoch, _ in expected)


class _Draws(torch.utils.data.Dataset):
    """Each item: four numbers from torch's global RNG (what a caption or crop choice reads)."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(4)


def test_seeded_items_draw_from_the_item_seed_and_leave_accelerator_rngs_alone(monkeypatch):
    from ccr.datamodules.datamodule import SeededItems

    reseeded = []
    for module in (torch.cuda, torch.xpu, torch.mtia):  # what torch.manual_seed also reseeds
        if hasattr(module, "manual_seed_all"):
            monkeypatch.setattr(
                module, "manual_seed_all", lambda seed, m=module: reseeded.append(m)
            )
    items = SeededItems(_Draws(), seed=3)
    before = torch.get_rng_state()
    drawn = items[(2, 4)]
    expected = torch.rand(
        4, generator=torch.Generator().manual_seed((3 * 1_000_003 + 2) * 1_000_033 + 4)
    )
    assert torch.equal(
        drawn, expected
    )  # the (seed, epoch, index) stream: resumes and old runs agree
    assert torch.equal(torch.get_rng_state(), before)  # the caller's CPU RNG is restored
    assert reseeded == []  # a GPU run's dropout RNG is not reseeded by every item loaded


def test_the_world_names_what_its_backbones_learn_from_and_trains_none(dm):
    """The datamodule only reads data: for the world it gives a handle to the pretrained backbones
    (the clean twin's pretrain split, the tokenizer, the data settings, ``data.backbones``), and
    ``ccr.experiments.pretrain`` builds them; setting up trains nothing and fills no backbones."""
    handle = dm.backbones
    assert dm.info.backbones == {}
    assert handle.knobs == dm.world.knobs.clean() != dm.world.knobs  # weak_fraction=0.5 here
    assert handle.world.name != Path(dm.image_root).parent.name
    assert handle.tokenizer is dm.tokenizer and handle.languages == LANGUAGES
    assert handle.recipe == OmegaConf.to_container(dm.cfg.backbones, resolve=True)
    assert handle.pretrain_split() == handle.world / synthetic.PRETRAIN
    assert len(handle.pretrain_records()) == dm.cfg.synthetic.num_pretrain
    built = [p.name for p in Path(dm.cfg.root).iterdir() if p.name.startswith(("backb", "seq2"))]
    assert built == []


def test_a_pretrained_models_preprocessing_comes_from_the_loader_the_harness_passes(tmp_path):
    cfg = synthetic_cfg(tmp_path)
    cfg.pretrained_io = {"library": "nope", "model": "x"}
    with pytest.raises(
        ValueError, match=r"data.pretrained_io is set.*no loader.*load_pretrained_io"
    ):
        CCRDataModule(cfg).loader_transform()
    asked = []
    module = CCRDataModule(cfg, load_pretrained_io=lambda spec: asked.append(spec) or "the io")
    assert module.pretrained == "the io" and asked == [{"library": "nope", "model": "x"}]


def test_loaders_read_the_image_root_once_not_per_record(dm, monkeypatch):
    """The loaders name the image folder once, not once per record (per record it cost 4 s per
    loader on the 10,000-image default world when each read described the world anew)."""
    reads = []
    image_root = CCRDataModule.image_root.fget
    monkeypatch.setattr(
        CCRDataModule, "image_root", property(lambda self: reads.append(1) or image_root(self))
    )
    dm.train_dataloader()
    dm._views.pop("val", None)
    dm.eval_view("val")
    assert len(reads) < 10 < len(dm.records("train"))
