"""The world's pretrained tiny mBART (RC3 starts from it as the paper starts from mBART-50): mBART's
text infilling, a build that learns to denoise held-out captions, its own cache folder built only
when asked for, and RC3 loading it through ``method.backbone.pretrained: world``."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import MBartModel

from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.synthetic import load_split
from ccr.experiments.config import compose
from ccr.experiments.pretrain import backbones
from ccr.experiments.pretrain.backbones import with_backbones, world_backbones
from ccr.experiments.pretrain.seq2seq import (
    Seq2SeqRecipe,
    build_seq2seq_model,
    denoising_loss,
    infill,
)
from ccr.experiments.pretrain.text import CaptionTable
from ccr.methods.rc3.module import RC3
from tests.test_backbones import LANGUAGES, tiny_cfg

TINY_MBART = {
    "d_model": 32,
    "heads": 2,
    "ffn_dim": 64,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "steps": 150,
    "batch_size": 32,
    "lr": 3e-3,
    "warmup_steps": 20,
}


def test_infill_replaces_spans_covering_the_mask_ratio_by_one_mask_each():
    recipe, rng = Seq2SeqRecipe(mask_ratio=0.35, span_mean=3.5), np.random.default_rng(0)
    ids = [0, *range(10, 30), 2]  # <s>, 20 content tokens, </s>
    for _ in range(50):
        noised = infill(ids, recipe, mask_id=4, rng=rng)
        assert noised[0] == 0 and noised[-1] == 2
        kept = [t for t in noised[1:-1] if t != 4]
        assert kept == [t for t in ids[1:-1] if t in kept]  # the rest, in order
        assert len(ids) - 2 - len(kept) == round(0.35 * 20)  # hidden tokens: the mask ratio
        assert all(
            a != 4 or b != 4 for a, b in zip(noised, noised[1:], strict=False)
        )  # one mask per span
    one = infill([0, 17, 2], recipe, mask_id=4, rng=rng)
    assert one == [0, 4, 2]  # at least one span, even in a one-word caption


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> CCRDataModule:
    cfg = tiny_cfg(tmp_path_factory.mktemp("world"))
    cfg.backbones.seq2seq = dict(TINY_MBART)
    module = CCRDataModule(cfg)
    module.prepare_data()
    module.setup("fit")
    return module


def held_out_loss(model: MBartModel, dm: CCRDataModule) -> float:
    val = load_split(Path(dm.image_root).parent, "val")
    table = CaptionTable(val, LANGUAGES, dm.tokenizer, 32)
    rng, noise = random.Random(1), np.random.default_rng(1)
    targets = [
        table.ids(rng.randrange(len(table.rows)), rng.randrange(len(LANGUAGES)), 0)
        for _ in range(128)
    ]
    sources = [infill(t, Seq2SeqRecipe(), dm.tokenizer.mask_token_id, noise) for t in targets]
    with torch.no_grad():
        return float(denoising_loss(model.eval(), sources, targets, dm.tokenizer.pad_token_id))


def test_the_world_mbart_learns_to_denoise_captions_it_never_saw(world):
    folder = Path(world_backbones(world.backbones)["seq2seq"]["pretrained"])
    pretrained = MBartModel.from_pretrained(folder)
    assert (
        pretrained.config.d_model == 32
        and pretrained.config.vocab_size == world.tokenizer.vocab_size
    )
    assert pretrained.config.dropout == 0.0
    torch.manual_seed(0)
    untrained = build_seq2seq_model(
        Seq2SeqRecipe(
            **{
                k: TINY_MBART[k]
                for k in ("d_model", "heads", "ffn_dim", "encoder_layers", "decoder_layers")
            }
        ),
        world.tokenizer,
    )
    trained_loss, chance_loss = held_out_loss(pretrained, world), held_out_loss(untrained, world)
    # measured: 2.67 against 5.70 at random init (ln of the 300-token vocabulary: 5.70)
    assert trained_loss < 0.6 * chance_loss, (trained_loss, chance_loss)


def test_it_is_built_only_when_asked_for_and_then_read_from_the_cache(world, monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("built")

    built = world_backbones(world.backbones)["seq2seq"]  # this test may run first on its worker
    monkeypatch.setattr(backbones, "pretrain_seq2seq", refuse)
    again = CCRDataModule(world.cfg)
    again.prepare_data()
    again.setup("fit")
    assert world_backbones(again.backbones)["seq2seq"] == built
    fresh_cfg = tiny_cfg(tmp_path)
    fresh_cfg.backbones.seq2seq = dict(TINY_MBART)
    fresh = CCRDataModule(fresh_cfg)
    fresh.prepare_data()
    fresh.setup("fit")
    monkeypatch.setattr(backbones, "pretrain_text", refuse)
    monkeypatch.setattr(backbones, "pretrain_image", refuse)
    with pytest.raises(AssertionError, match="built"):
        world_backbones(fresh.backbones)["seq2seq"]  # not built before this look
    assert not list(tmp_path.glob("backbones-*"))  # asking for the mBART builds no encoder


def test_a_seq2seq_recipe_leaves_the_encoders_cache_folder_alone():
    plain = backbones.BackboneRecipe.from_config({"text": {"steps": 7}})
    with_mbart = backbones.BackboneRecipe.from_config(
        {"text": {"steps": 7}, "seq2seq": {"steps": 3}}
    )
    assert plain.encoders() == with_mbart.encoders()
    with pytest.raises(KeyError, match=r"\['stepz'\] in data.backbones.seq2seq"):
        backbones.BackboneRecipe.from_config({"seq2seq": {"stepz": 1}})


def rc3(world, *overrides):
    """RC3 from its preset (which starts from the world mBART) at this world's mBART size."""
    cfg = compose(
        [
            "method=rc3",
            "method.backbone.d_model=32",
            "method.backbone.heads=2",
            "method.backbone.ffn_dim=64",
            "method.backbone.encoder_layers=1",
            "method.backbone.decoder_layers=1",
            "method.visual.strict_input=patch",
            "method.visual.regions=null",
            *overrides,
        ]
    )
    return RC3(cfg.method, cfg.optim, with_backbones(world), cfg.evaluation)


def test_rc3_starts_from_the_world_mbart(world):
    saved = MBartModel.from_pretrained(
        world_backbones(world.backbones)["seq2seq"]["pretrained"]
    ).state_dict()
    module = rc3(world)
    net = module.net.model.state_dict()
    for name in (
        "encoder.layers.0.self_attn.k_proj.weight",
        "decoder.layers.0.fc1.weight",
        "encoder.layernorm_embedding.weight",
    ):
        assert torch.equal(net[name], saved[name]), name
    rows = world.tokenizer.vocab_size
    assert torch.equal(net["shared.weight"][:rows], saved["shared.weight"])  # tags appended after
    assert net["shared.weight"].shape[0] == rows + len(LANGUAGES) + 3


def test_rc3_names_a_mismatched_architecture_and_data_without_the_world_mbart(world):
    with pytest.raises(ValueError, match=r"d_model=64 \(world mBART: 32\).*fixes the architecture"):
        rc3(world, "method.backbone.d_model=64")
    info = dataclasses.replace(with_backbones(world), backbones={})
    cfg = compose(
        [
            "method=rc3",
            "method.backbone.pretrained=world",
            "method.visual.strict_input=patch",
            "method.visual.regions=null",
        ]
    )
    with pytest.raises(ValueError, match="pretrained=world.*does not provide"):
        RC3(cfg.method, cfg.optim, info, cfg.evaluation)


def test_the_first_stage_reads_frozen_encoders_and_only_its_probe_heads_train(world):
    """rc3.yaml's first stage: probe heads over the world's frozen ViT and XLM-R. Their weights
    never get a gradient, stay in eval mode, and the probe's scores follow the encoders' output."""
    module = rc3(world)
    frozen = module.first_encoders
    assert frozen is not None and not any(p.requires_grad for p in frozen.parameters())
    module.train()
    assert not frozen.training and not frozen.text.training
    images = torch.randn(4, 3, world.info.image_size, world.info.image_size)
    tokens = world.tokenizer(
        ["a red circle", "a blue square", "ein roter Kreis", "a red circle"], 16
    )
    embedded = module.encode_texts(tokens["input_ids"], tokens["attention_mask"])
    assert torch.allclose(embedded[0], embedded[3])  # a caption's own features, whatever the batch
    direct = module.probe_text(frozen.text_features(tokens["input_ids"], tokens["attention_mask"]))
    assert torch.allclose(embedded, direct, atol=1e-6)
    assert torch.allclose(
        module.encode_images(images), module.probe_image(frozen.image(images).mean(1)), atol=1e-6
    )


def test_a_first_stage_on_data_without_world_encoders_names_the_config_key(world):
    info = dataclasses.replace(with_backbones(world), backbones={})
    cfg = compose(
        [
            "method=rc3",
            "method.backbone.pretrained=null",
            "method.visual.strict_input=patch",
            "method.visual.regions=null",
        ]
    )
    with pytest.raises(
        ValueError, match="method.first_stage: image encoder 'world'.*set method.first_stage"
    ):
        RC3(cfg.method, cfg.optim, info, cfg.evaluation)
    with pytest.raises(ValueError, match="name both image_encoder and text_encoder"):
        rc3(world, "method.first_stage.text_encoder=null")
