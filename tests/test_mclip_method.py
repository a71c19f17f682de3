"""mCLIP's TriKD module (spec §9 tests 1-5, 8-10, 16, 18): frozen towers, trainable projectors,
loss composition, pooling, inference path, and a trained model preferring the true pairing."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from worlds import random_backbones

from ccr.datamodules.datamodule import DataInfo
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.mclip.module import MCLIP, selected_stages
from ccr.methods.mclip.translation import inverse_sqrt_factor

CONFIGS = Path(__file__).resolve().parents[1] / "ccr/experiments/configs"
DATA = DataInfo(
    languages=["en", "xx"],
    vocab_size=40,
    pad_token_id=0,
    cls_token_id=1,
    eos_token_id=2,
    mask_token_id=3,
    max_length=10,
    image_size=32,
    num_objects=0,
)
DATA.backbones = random_backbones(hf_text_for=DATA)
BASE = OmegaConf.load(CONFIGS / "base.yaml")


def method_config(name="mclip", **overrides):
    """The preset with ``overrides``, its run-level interpolations (``${protocol}``,
    ``${variant}``) resolved as ``ccr.experiments.config.compose`` would with the preset's defaults."""
    preset = OmegaConf.load(CONFIGS / "method" / f"{name}.yaml")
    dotlist = [f"{k}={'null' if v is None else v}" for k, v in overrides.items()]
    cfg = OmegaConf.merge(preset.method, OmegaConf.from_dotlist(dotlist))
    root = OmegaConf.create({"protocol": preset.protocol, "variant": None, "method": cfg})
    return OmegaConf.create(OmegaConf.to_container(root.method, resolve=True))


def build_mclip(seed=0, **overrides) -> MCLIP:
    torch.manual_seed(seed)
    return MCLIP(method_config(**overrides), BASE.optim, DATA, BASE.evaluation)


def caption_ids(n, length=DATA.max_length, seed=0, min_length=4):
    """Right-padded `<cls> words <eos>` rows of random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, DATA.vocab_size, (n, length), generator=g)
    lengths = torch.randint(min_length, length + 1, (n,), generator=g)
    positions = torch.arange(length)
    mask = (positions < lengths[:, None]).long()
    ids[:, 0] = DATA.cls_token_id
    ids[torch.arange(n), lengths - 1] = DATA.eos_token_id
    return ids.masked_fill(mask == 0, DATA.pad_token_id), mask


def image_batch(n=6, languages=("en",), seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = [caption_ids(n, seed=seed + 1 + k) for k in range(len(languages))]
    return {
        "images": torch.randn(n, 3, 32, 32, generator=g),
        "input_ids": torch.stack([p[0] for p in pairs], 1),
        "attention_mask": torch.stack([p[1] for p in pairs], 1),
        "present": torch.ones(n, len(languages), dtype=torch.bool),
        "languages": list(languages),
    }


def snapshot(module):
    return {
        name: t.detach().clone()
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    }


def optimizer_step(module, batch, lr=1e-2):
    optimizer = module.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = lr  # past the warm-up, so every trainable tensor visibly moves
    module.train()
    module.training_step(batch, 0).backward()
    optimizer.step()
    return optimizer


TRAINABLE = ("clip_projector.", "x_projector.", "logit_scale")


def test_frozen_towers_are_bit_identical_after_a_step():
    module = build_mclip()
    before = snapshot(module)
    optimizer_step(module, image_batch())
    for tower in (module.teacher, module.mte):
        for name, tensor in [*tower.named_parameters(), *tower.named_buffers()]:
            prefix = "teacher." if tower is module.teacher else "mte."
            assert torch.equal(tensor, before[prefix + name]), name
        for param in tower.parameters():
            assert not param.requires_grad and param.grad is None


def test_only_the_projectors_and_the_temperature_move():
    module = build_mclip()
    before = snapshot(module)
    optimizer = optimizer_step(module, image_batch())
    after = snapshot(module)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    trainable = {name for name, p in module.named_parameters() if name.startswith(TRAINABLE)}
    assert changed == trainable
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for name, p in module.named_parameters() if name in trainable}


def x_projector_parameters(dim, ffn):
    attention = 4 * dim * dim + 4 * dim
    return attention + 2 * dim * ffn + ffn + dim + 4 * dim


def test_tiny_trainable_count_matches_the_formula():
    module = build_mclip()
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert (
        tuple(module.clip_projector.weight.shape) == (64, 32) and module.clip_projector.bias is None
    )
    assert trainable == 32 * 64 + 2 * x_projector_parameters(64, 128) + 1


def test_one_clip_projector_serves_images_and_english_texts():
    module = build_mclip().eval()
    batch = image_batch()
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    h_x = module.encode_texts(ids, mask)
    info_nce(module.encode_images(batch["images"]), h_x.detach(), 0.07).backward()
    image_grad = module.clip_projector.weight.grad.clone()
    module.zero_grad()
    info_nce(module.teacher_texts(ids, mask), h_x.detach(), 0.07).backward()
    assert image_grad.abs().sum() > 0 and module.clip_projector.weight.grad.abs().sum() > 0
    assert module.logit_scale.grad is None


def test_temperatures_initialise_and_clamp_as_specified():
    module = build_mclip().eval()
    assert module.logit_scale.item() == pytest.approx(2.6593, abs=1e-4)
    assert module.ttc_temperature == 0.07 and not isinstance(
        module.ttc_temperature, torch.nn.Parameter
    )
    batch = image_batch()
    with torch.no_grad():
        module.logit_scale.fill_(10.0)
        h_i = module.encode_images(batch["images"])
        h_x = module.encode_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0])
        h_t = module.teacher_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0])
        expected = info_nce(h_i, h_x, 1 / 100.0) + 0.1 * info_nce(h_t, h_x, 0.07)
        assert module.training_step(batch, 0).item() == pytest.approx(expected.item(), rel=1e-5)
    assert build_mclip(**{"trikd.ttc_scale_mode": "reference"}).ttc_temperature == pytest.approx(
        1 / math.log(1 / 0.07)
    )


def test_english_loss_is_itc_plus_a_tenth_of_ttc_recomputed_independently():
    module = build_mclip().eval()
    batch = image_batch()
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    with torch.no_grad():
        v = module.teacher.encode_images(batch["images"])
        t = module.teacher.encode_texts(ids, mask)
        states = module.mte(ids, mask).states
        h_i = torch.nn.functional.normalize(v @ module.clip_projector.weight.T, dim=-1)
        h_t = torch.nn.functional.normalize(t @ module.clip_projector.weight.T, dim=-1)
        z = module.x_projector(states, mask.bool())
        h_x = torch.nn.functional.normalize(z, dim=-1)
        itc = info_nce(h_i, h_x, 0.07)
        ttc = info_nce(h_t, h_x, 0.07)
        assert module.training_step(batch, 0).item() == pytest.approx(
            (itc + 0.1 * ttc).item(), rel=1e-5
        )


def test_non_english_captions_use_itc_only_and_never_call_the_teacher_text_tower(monkeypatch):
    module = build_mclip().eval()

    def refuse(*args, **kwargs):
        raise AssertionError("the CLIP text tower was called on non-English captions")

    monkeypatch.setattr(module.teacher, "encode_texts", refuse)
    batch = image_batch(languages=("xx",))
    with torch.no_grad():
        h_i = module.encode_images(batch["images"])
        h_x = module.encode_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0])
        assert module.training_step(batch, 0).item() == pytest.approx(
            info_nce(h_i, h_x, 0.07).item(), rel=1e-5
        )


def test_text_embedding_is_read_at_the_last_token_and_ignores_extra_padding():
    module = build_mclip().eval()
    ids, mask = caption_ids(4, length=8)
    shortest = int(mask.sum(1).argmin())
    alone = slice(shortest, shortest + 1)
    assert mask[shortest].sum() < mask.sum(1).max()  # padded beyond its length inside the batch
    with torch.no_grad():
        in_batch = module.encode_texts(ids, mask)[shortest]
        assert torch.allclose(module.encode_texts(ids[alone], mask[alone])[0], in_batch, atol=1e-6)
        states = torch.randn(2, 5, 64)
        z_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        pooled = module.x_projector(states, z_mask)
        full = states
        for layer in module.x_projector.layers:
            full = layer(full, ~z_mask.bool())
        assert torch.allclose(pooled, full[[0, 1], [2, 4]])


def test_towers_stay_deterministic_in_train_mode_while_projector_dropout_is_active():
    module = build_mclip()
    module.train()
    assert not module.teacher.training and not module.mte.training and module.x_projector.training
    batch = image_batch()
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    with torch.no_grad():
        assert torch.equal(
            module.teacher.encode_images(batch["images"]),
            module.teacher.encode_images(batch["images"]),
        )
        assert torch.equal(module.mte(ids, mask).states, module.mte(ids, mask).states)
        assert not torch.allclose(module.encode_texts(ids, mask), module.encode_texts(ids, mask))


def test_inference_uses_the_mte_only_and_returns_unit_vectors(monkeypatch):
    module = build_mclip().eval()

    def refuse(*args, **kwargs):
        raise AssertionError("inference called the CLIP text tower")

    monkeypatch.setattr(module.teacher, "encode_texts", refuse)
    batch = image_batch()
    with torch.no_grad():
        images = module.encode_images(batch["images"])
        texts = module.encode_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0])
    assert images.shape == texts.shape == (6, 64)
    assert torch.allclose(images.norm(dim=-1), torch.ones(6)) and torch.allclose(
        texts.norm(dim=-1), torch.ones(6)
    )


def test_training_prefers_the_true_pairing_to_a_shuffled_one():
    module = build_mclip()
    batch = image_batch(n=8)
    optimizer = module.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    module.train()
    for _ in range(30):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    module.eval()
    with torch.no_grad():
        h_i = module.encode_images(batch["images"])
        h_x = module.encode_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0])
    shuffled = h_x[torch.roll(torch.arange(8), 1)]
    assert info_nce(h_i, h_x, 0.07) < info_nce(h_i, shuffled, 0.07)
    assert (h_i @ h_x.T).argmax(1).eq(torch.arange(8)).float().mean() > 0.5


def test_inverse_sqrt_schedule_matches_the_trikd_numbers():
    def lr(step):
        return 1e-2 * inverse_sqrt_factor(step, 500, 500, 1e-7 / 1e-2)

    assert lr(0) == pytest.approx(1e-7)
    assert lr(250) == pytest.approx(5.0e-3, rel=1e-4)
    assert lr(500) == pytest.approx(1e-2)
    assert lr(2000) == pytest.approx(5e-3)

    def no_warmup(step):
        return 1e-4 * inverse_sqrt_factor(step, 0, 10, 1.0)

    assert no_warmup(0) == no_warmup(10) == 1e-4 and no_warmup(40) == pytest.approx(5e-5)


@pytest.mark.parametrize(
    "stages",
    [
        ["teacher"],
        ["trikd", "teacher"],
        ["mte_ctl", "mte_nmt", "trikd"],
        ["teacher", "teacher", "trikd"],
        ["other", "trikd"],
        [],
    ],
)
def test_a_bad_stage_list_is_refused(stages):
    with pytest.raises(ValueError, match="method.stages"):
        selected_stages(OmegaConf.create({"stages": stages}))


def test_evaluation_encodes_every_caption_at_the_batch_width():
    """As CL2CM's: no trimming of all-pad columns in evaluation, so a caption's embedding does not
    follow the rounding of a width its batch neighbours chose."""
    module = build_mclip().eval()
    ids, mask = caption_ids(4, length=6)
    extra = DATA.max_length - 6  # trailing columns that are padding in every caption
    ids, mask = F.pad(ids, (0, extra), value=DATA.pad_token_id), F.pad(mask, (0, extra), value=0)
    shapes = []
    module.mte.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        module.encode_texts(ids, mask)
    assert shapes == [tuple(ids.shape)]
