"""The synthetic world's pretrained backbones: the text encoder prefers translations, both load
through the real loaders (``hf:<path>``, a timm state dict), the cache skips rebuilding, and
``world`` is an error on data that has no backbones."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModel, XLMRobertaConfig, XLMRobertaModel

from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.synthetic import load_split
from ccr.experiments.config import compose
from ccr.experiments.pretrain import backbones
from ccr.experiments.pretrain import text as pretrain_text
from ccr.experiments.pretrain.backbones import with_backbones, world_backbones
from ccr.experiments.pretrain.seq2seq import Seq2SeqRecipe
from ccr.methods.layers.encoders import ImageEncoder, TextEncoder

CONFIG = Path(__file__).resolve().parents[1] / "ccr/experiments/configs/data/synthetic.yaml"
LANGUAGES = ["en", "de", "ja"]
# The threshold an encoder with a real cross-lingual link should clear (chance is 0.5; the same
# architecture at random init measured 0.51-0.59 over three seeds on this world).
PREFERENCE_THRESHOLD = 0.65


def tiny_cfg(root: Path, **overrides):
    cfg = OmegaConf.load(CONFIG)
    cfg.root, cfg.languages, cfg.batch_size, cfg.max_length = str(root), LANGUAGES, 8, 32
    cfg.tokenizer.vocab_size = 300
    cfg.synthetic.update(
        num_train=24,
        num_val=80,
        num_test=8,
        num_pretrain=400,
        num_shapes=4,
        num_colours=4,
        max_objects=2,
    )
    cfg.backbones.text.update(
        hidden_size=32,
        layers=1,
        heads=2,
        intermediate_size=64,
        steps=250,
        batch_size=32,
        lr=3e-3,
        warmup_steps=20,
    )
    cfg.backbones.image.update(embed_dim=32, depth=1, num_heads=2, steps=30, batch_size=32)
    cfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture(scope="module")
def dm(tmp_path_factory) -> CCRDataModule:
    module = CCRDataModule(tiny_cfg(tmp_path_factory.mktemp("world")))
    module.prepare_data()
    module.setup("fit")
    return module


def text_folder(dm) -> Path:
    return Path(world_backbones(dm.backbones)["text"]["name"].removeprefix("hf:"))


def test_text_encoder_puts_a_caption_nearer_its_translation(dm):
    val = load_split(Path(dm.image_root).parent, "val")
    model = AutoModel.from_pretrained(text_folder(dm)).eval()
    pretrained = backbones.translation_preference(model, dm.tokenizer, val, LANGUAGES, 32)
    torch.manual_seed(0)
    untrained = XLMRobertaModel(XLMRobertaConfig.from_pretrained(text_folder(dm))).eval()
    chance = backbones.translation_preference(untrained, dm.tokenizer, val, LANGUAGES, 32)
    assert pretrained >= PREFERENCE_THRESHOLD > chance


def test_text_backbone_pretrains_at_the_recipes_dropout_and_saves_xlmrs(dm):
    """Dropout-free pretraining is a build-time choice; whoever fine-tunes the saved model gets
    XLM-R's dropout from its config."""
    recipe = backbones.BackboneRecipe.from_config(OmegaConf.to_container(dm.cfg.backbones)).text
    model = pretrain_text.build_text_model(recipe, dm.tokenizer, 32)
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert recipe.dropout == 0.0 and rates == {0.0}
    saved = XLMRobertaConfig.from_pretrained(text_folder(dm))
    assert saved.hidden_dropout_prob == saved.attention_probs_dropout_prob == 0.1
    loaded = TextEncoder(f"hf:{text_folder(dm)}").backbone.model
    assert {m.p for m in loaded.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}


def test_text_backbone_loads_through_hf_path_and_world_name(dm):
    folder = text_folder(dm)
    by_path = TextEncoder(f"hf:{folder}")
    by_world = TextEncoder.from_config({"name": "world"}, with_backbones(dm))
    saved = AutoModel.from_pretrained(folder).state_dict()
    for encoder in (by_path, by_world):
        own = encoder.backbone.model.state_dict()
        assert all(torch.equal(own[k], saved[k]) for k in own)
    ids = dm.tokenizer(["A red circle.", "Ein roter Kreis."], 32)
    out = by_world(ids["input_ids"], ids["attention_mask"])
    assert out.states.shape == (2, 32, 32) and torch.isfinite(out.pooled).all()
    assert (folder / "tokenizer.json").exists()  # a complete HF folder: the tokenizer loads too
    from transformers import AutoTokenizer

    hf_ids = AutoTokenizer.from_pretrained(folder)("A red circle.")["input_ids"]
    assert hf_ids == ids["input_ids"][0][: len(hf_ids)].tolist()


def test_image_backbone_loads_as_a_timm_state_dict(dm):
    spec = world_backbones(dm.backbones)["image"]
    assert spec["name"] == "timm:vit_tiny_patch16_224" and spec["pretrained"].endswith(".pth")
    encoder = ImageEncoder.from_config({"name": "world"}, with_backbones(dm))
    saved = torch.load(spec["pretrained"], weights_only=True)
    own = encoder.backbone.model.state_dict()
    assert own.keys() == {k for k in saved if not k.startswith("head.")}
    assert all(torch.equal(own[k], saved[k]) for k in own)
    tokens = encoder(torch.zeros(2, 3, 32, 32))
    assert tokens.shape == (2, 1 + 16, 32)


def test_cache_hit_skips_the_build_and_a_new_recipe_rebuilds(dm, monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("the backbones were rebuilt")

    monkeypatch.setattr(backbones, "pretrain_text", refuse)
    monkeypatch.setattr(backbones, "pretrain_image", refuse)
    again = CCRDataModule(dm.cfg)
    again.prepare_data()
    again.setup("fit")
    assert dict(world_backbones(again.backbones)) == dict(world_backbones(dm.backbones))
    changed = CCRDataModule(OmegaConf.merge(dm.cfg, {"backbones": {"text": {"steps": 7}}}))
    changed.setup("fit")
    with pytest.raises(AssertionError, match="rebuilt"):
        dict(world_backbones(changed.backbones))


def test_cache_hit_after_the_tokenizer_has_been_used(dm, monkeypatch):
    """Tokenising sets padding and truncation on the tokenizer; the cache key must not see that
    (a run that tokenised captions before resolving ``world`` once rebuilt everything)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the backbones were rebuilt")

    again = CCRDataModule(dm.cfg)
    again.prepare_data()
    again.setup("fit")
    again.tokenizer(["a red circle", "ein roter Kreis"], 16)
    again.tokenizer(["a red circle"], 24)
    monkeypatch.setattr(backbones, "pretrain_text", refuse)
    monkeypatch.setattr(backbones, "pretrain_image", refuse)
    assert dict(world_backbones(again.backbones)) == dict(world_backbones(dm.backbones))


def test_world_name_is_an_error_on_data_without_backbones():
    info = SimpleNamespace(vocab_size=40, pad_token_id=0, max_length=8, image_size=32, backbones={})
    with pytest.raises(ValueError, match="text encoder 'world'.*name a real model.*hf:"):
        TextEncoder.from_config({"name": "world"}, info)
    with pytest.raises(ValueError, match="image encoder 'world'.*name a real model.*timm:"):
        ImageEncoder.from_config({"name": "world"}, info)


def test_a_run_that_never_names_world_never_builds_them(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the backbones were built")

    monkeypatch.setattr(backbones, "build_backbones", refuse)
    module = CCRDataModule(tiny_cfg(tmp_path))
    module.prepare_data()
    module.setup("fit")
    copy.deepcopy(asdict(with_backbones(module)))  # as a checkpoint's hyper-parameters take it
    assert not list(tmp_path.glob("backbones-*"))
    with pytest.raises(AssertionError, match="were built"):
        dict(world_backbones(module.backbones))


def test_no_backbones_when_switched_off(tmp_path):
    module = CCRDataModule(tiny_cfg(tmp_path, backbones="null"))
    module.setup("fit")
    assert module.backbones is None and with_backbones(module).backbones == {}
    assert not list(tmp_path.glob("backbones-*"))


def test_unknown_recipe_key_is_named():
    with pytest.raises(KeyError, match=r"\['stepz'\] in data.backbones.text"):
        backbones.BackboneRecipe.from_config({"text": {"stepz": 1}})


def global_draws() -> tuple:
    import random

    import numpy

    return torch.rand(3).tolist(), random.random(), numpy.random.rand()


def test_building_the_backbones_leaves_the_global_random_state_alone(dm, tmp_path):
    """A run builds the backbones lazily, after it has seeded everything: were the build to move
    the global generators, the first run on a machine (which builds) would train differently from
    every later run with the same seed (which hits the cache), and no score would reproduce."""
    import lightning as L

    fresh = CCRDataModule(
        OmegaConf.merge(
            dm.cfg,
            {"root": str(tmp_path), "backbones": {"text": {"steps": 3}, "image": {"steps": 2}}},
        )
    )
    fresh.prepare_data()
    fresh.setup("fit")
    L.seed_everything(7, verbose=False)
    expected = global_draws()
    L.seed_everything(7, verbose=False)
    dict(world_backbones(fresh.backbones))  # builds them now
    assert global_draws() == expected


@pytest.mark.parametrize("corruption", [{"mt_noise": 0.5}, {"weak_fraction": 0.5}])
def test_caption_corruptions_leave_the_tokenizer_and_backbones_alone(dm, monkeypatch, corruption):
    """Translation noise and weak alignment are the CL2CM and RC3 experiments' variables: a world
    with them must differ from the clean one in its training captions only, not in a vocabulary
    learnt from the corrupted captions or in backbones pretrained with that vocabulary."""

    def refuse(*args, **kwargs):
        raise AssertionError("the backbones were rebuilt")

    expected = dict(world_backbones(dm.backbones))  # built (or found) for the clean world
    noisy = CCRDataModule(OmegaConf.merge(dm.cfg, {"synthetic": corruption}))
    noisy.prepare_data()
    noisy.setup("fit")
    clean_train, noisy_train = dm.records("train"), noisy.records("train")
    assert [r.id for r in noisy_train] == [r.id for r in clean_train]
    assert any(a.captions != b.captions for a, b in zip(clean_train, noisy_train, strict=True))
    assert backbones.tokenizer_digest(noisy.tokenizer) == backbones.tokenizer_digest(dm.tokenizer)
    monkeypatch.setattr(backbones, "pretrain_text", refuse)
    monkeypatch.setattr(backbones, "pretrain_image", refuse)
    assert dict(world_backbones(noisy.backbones)) == expected


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    text = load_file(folder / backbones.TEXT_DIR / "model.safetensors")
    image = torch.load(folder / backbones.IMAGE_FILE, map_location="cpu", weights_only=True)
    return {
        **{f"text.{k}": v for k, v in text.items()},
        **{f"image.{k}": v for k, v in image.items()},
    }


@dataclass(frozen=True)
class TinySeq2Seq(Seq2SeqRecipe):
    d_model: int = 32
    heads: int = 2
    ffn_dim: int = 64
    encoder_layers: int = 1
    steps: int = 10
    batch_size: int = 16
    warmup_steps: int = 1


def test_make_pretrain_and_a_runs_lazy_build_make_the_same_backbones(tmp_path, monkeypatch):
    """``make pretrain`` runs with torch's default threads (2 on a 2-core machine), a run builds
    lazily after its preset's ``cpu_threads`` (1): both must cache bit-identical weights."""
    sizes = [
        "data.languages=[en,de]",
        "data.tokenizer.vocab_size=300",
        "data.synthetic.num_train=24",
        "data.synthetic.num_val=16",
        "data.synthetic.num_test=8",
        "data.synthetic.num_pretrain=96",
        "data.backbones.text.hidden_size=32",
        "data.backbones.text.layers=1",
        "data.backbones.text.heads=2",
        "data.backbones.text.intermediate_size=64",
        "data.backbones.text.steps=20",
        "data.backbones.text.batch_size=16",
        "data.backbones.image.embed_dim=32",
        "data.backbones.image.depth=1",
        "data.backbones.image.num_heads=2",
        "data.backbones.image.steps=10",
        "data.backbones.image.batch_size=16",
    ]
    # make pretrain builds the world mBART too, whose recipe the command line cannot shrink
    monkeypatch.setattr(backbones, "Seq2SeqRecipe", TinySeq2Seq)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        backbones.main([f"data.root={tmp_path / 'pretrain'}", *sizes])
        torch.set_num_threads(1)
        run = CCRDataModule(compose([f"data.root={tmp_path / 'run'}", *sizes]).data)
        run.prepare_data()
        run.setup("fit")
        built_for_a_method = with_backbones(run).backbones  # what a run's harness gives
        lazy = Path(built_for_a_method["image"]["pretrained"]).parents[1]
        lazy_seq2seq = Path(built_for_a_method["seq2seq"]["pretrained"])
        assert torch.get_num_threads() == 1  # the build restores the caller's count
    finally:
        torch.set_num_threads(before)
    (built,) = (tmp_path / "pretrain").glob("backbones-*")
    (built_seq2seq,) = (tmp_path / "pretrain").glob(f"seq2seq-*/{backbones.SEQ2SEQ_DIR}")
    assert built.name == lazy.name
    first, second = _weights(built), _weights(lazy)
    for name, tensors in (("pretrain", first), ("lazy", second)):
        folder = built_seq2seq if name == "pretrain" else lazy_seq2seq
        tensors.update(
            {f"seq2seq.{k}": v for k, v in load_file(folder / "model.safetensors").items()}
        )
    assert first.keys() == second.keys()
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, f"{len(different)} of {len(first)} tensors differ, e.g. {different[:3]}"
