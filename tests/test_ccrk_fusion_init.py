"""The default ccrk preset starts its fusion encoder as the reference code does: each fusion layer's
self-attention and FFN are copies of the text model's upper layers (the world's pretrained XLM-R),
the cross-attention is new, and the new parts train at 2x the learning rate."""

from dataclasses import dataclass, field

import pytest
import torch
from omegaconf import OmegaConf
from test_ccrk_module import CONFIG, EVALUATION, OPTIM, Info, training_batch
from transformers import AutoConfig, AutoModel
from worlds import random_backbones

from ccr.methods.ccrk.module import CCRk, seed_layer_indices
from ccr.methods.layers.optim import param_groups

WORLD_TEXT = {
    "model_type": "xlm-roberta",
    "vocab_size": Info.vocab_size,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": Info.max_length + Info.pad_token_id + 1,
    "pad_token_id": 1,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


@pytest.fixture
def world_text(tmp_path):
    """A 'pretrained' world text encoder: a random 2-layer XLM-R saved as a local HF folder."""
    torch.manual_seed(5)
    model = AutoModel.from_config(AutoConfig.for_model(**WORLD_TEXT))
    model.save_pretrained(tmp_path / "text")
    return model, {"name": f"hf:{tmp_path / 'text'}", "pretrained": True}


@dataclass
class WorldInfo(Info):
    backbones: dict = field(default_factory=dict)


def preset(**overrides):
    cfg = OmegaConf.load(CONFIG).method
    cfg.ablation = None
    return OmegaConf.merge(cfg, OmegaConf.create(overrides))


def build(world_text, **overrides):
    backbones = {**random_backbones(width=32), "text": world_text[1]}
    torch.manual_seed(0)
    return CCRk(preset(**overrides), OPTIM, WorldInfo(backbones=backbones), EVALUATION)


def test_fusion_self_attention_and_ffn_are_the_world_text_layers_at_init(world_text):
    source, _ = world_text
    module = build(world_text)
    assert len(module.fusion.layers) == 2
    for fusion, text in zip(
        module.fusion.layers, source.encoder.layer, strict=True
    ):  # layers 0 and 1, in order
        attention = text.attention.self
        assert torch.equal(
            fusion.self_attn.in_proj_weight,
            torch.cat([attention.query.weight, attention.key.weight, attention.value.weight]),
        )
        assert torch.equal(fusion.self_attn.out_proj.weight, text.attention.output.dense.weight)
        assert torch.equal(fusion.norm_self.weight, text.attention.output.LayerNorm.weight)
        assert torch.equal(fusion.ffn[0].weight, text.intermediate.dense.weight)
        assert torch.equal(fusion.ffn[2].weight, text.output.dense.weight)
        assert torch.equal(fusion.norm_ffn.bias, text.output.LayerNorm.bias)
        assert fusion.self_attn.num_heads == 2  # the text model's heads (fusion.heads: null)
        text_weights = [
            p for p in text.parameters() if p.shape == fusion.cross_attn.in_proj_weight.shape
        ]
        assert not any(torch.equal(fusion.cross_attn.in_proj_weight, w) for w in text_weights)
    # the text encoder keeps both layers (the dual encoder is clip's size), as separate weights
    kept = module.text_encoder.backbone.model.encoder.layer
    assert len(kept) == 2 and torch.equal(
        kept[1].output.dense.weight, source.encoder.layer[1].output.dense.weight
    )
    assert (
        kept[1].output.dense.weight.data_ptr() != module.fusion.layers[1].ffn[2].weight.data_ptr()
    )


def test_new_parameters_train_at_twice_the_lr_and_pretrained_ones_at_the_lr(world_text):
    module = build(world_text)
    lr_of = {}
    for group in param_groups(module, 0.01, 1e-3, module.lr_scales()):
        lr_of.update({id(p): group["lr"] for p in group["params"]})
    params = dict(module.named_parameters())
    doubled = [n for n in params if lr_of[id(params[n])] == pytest.approx(2e-3)]
    assert all(lr_of[id(p)] in (pytest.approx(1e-3), pytest.approx(2e-3)) for p in params.values())
    assert {n.split(".")[0] for n in doubled} == {
        "fusion",
        "vision_proj",
        "text_proj",
        "itm_head",
        "temperature",
    }
    assert {n.split(".")[3] for n in doubled if n.startswith("fusion.")} == {
        "cross_attn",
        "norm_cross",
    }
    for name in (
        "fusion.layers.0.self_attn.in_proj_weight",
        "fusion.layers.1.ffn.0.weight",
        "text_encoder.backbone.model.encoder.layer.0.attention.self.query.weight",
        "image_encoder.backbone.patch_embed.weight",
    ):
        assert lr_of[id(params[name])] == pytest.approx(1e-3), name


def test_a_random_fusion_encoder_is_new_as_a_whole(world_text):
    module = build(world_text, fusion={"init_from_text_layers": None})
    scales = module.lr_scales()
    assert scales["fusion"] == 2.0
    assert not torch.equal(
        module.fusion.layers[0].ffn[0].weight,
        world_text[0].encoder.layer[0].intermediate.dense.weight,
    )


def test_the_seeded_preset_trains_a_step(world_text):
    module = build(world_text)
    module.log = module.log_dict = lambda *args, **kwargs: None
    loss = module.training_step(training_batch(), 0)
    assert torch.isfinite(loss)
    loss.backward()
    assert module.fusion.layers[0].cross_attn.in_proj_weight.grad.abs().sum() > 0


def test_upper_takes_the_top_layers_and_repeats_the_lowest_when_the_text_model_is_shallower():
    assert seed_layer_indices("upper", 2, 2) == [0, 1]
    assert seed_layer_indices("upper", 6, 24) == [18, 19, 20, 21, 22, 23]
    assert seed_layer_indices("upper", 2, 1) == [0, 0]
    assert seed_layer_indices([13, 15], 2, 24) == [13, 15]
    with pytest.raises(
        ValueError, match="init_from_text_layers has 1 layers but fusion.layers is 2"
    ):
        seed_layer_indices([3], 2, 24)


def test_seeding_with_other_heads_or_from_a_tiny_text_encoder_is_a_clear_error(world_text):
    with pytest.raises(
        ValueError, match=r"fusion.heads=4, but the text layers that seed the fusion have 2"
    ):
        build(world_text, fusion={"heads": 4})
    with pytest.raises(ValueError, match="init_from_text_layers needs an 'hf:' text encoder"):
        CCRk(preset(fusion={"heads": 4}), OPTIM, Info(), EVALUATION)
