"""The clip baseline: one present language per instance, defaults from its YAML, and it learns."""

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from worlds import RANDOM_BACKBONES

from ccr.methods.clip.module import CLIPModule
from ccr.methods.layers.batches import sample_one_language

CONFIGS = Path(__file__).resolve().parents[1] / "ccr/experiments/configs"
INFO = SimpleNamespace(
    languages=["en", "de", "fr"],
    vocab_size=40,
    pad_token_id=0,
    cls_token_id=1,
    eos_token_id=2,
    mask_token_id=3,
    max_length=8,
    image_size=16,
    num_objects=0,
    backbones=RANDOM_BACKBONES,
)


def _clip(**method_overrides):
    method = OmegaConf.merge(
        OmegaConf.load(CONFIGS / "method" / "clip.yaml").method, method_overrides
    )
    base = OmegaConf.load(CONFIGS / "base.yaml")
    return CLIPModule(method, base.optim, INFO, base.evaluation)


def _toy_batch(n=12, present=None):
    """Image i is a flat colour; its caption in every language is <cls> (4 + i) <eos>; absent
    languages are all padding, as the data contract says."""
    generator = torch.Generator().manual_seed(0)
    colours = torch.rand(n, 3, 1, 1, generator=generator)
    images = colours.expand(n, 3, 16, 16).clone()
    ids = torch.zeros(n, 3, 8, dtype=torch.long)
    ids[:, :, 0], ids[:, :, 2] = 1, 2
    ids[:, :, 1] = (4 + torch.arange(n))[:, None] + torch.tensor(
        [0, 12, 24]
    )  # a different word per language
    present = torch.ones(n, 3, dtype=torch.bool) if present is None else present
    ids[~present] = 0
    return {
        "images": images,
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "present": present,
        "languages": INFO.languages,
        "ids": [str(i) for i in range(n)],
    }


def test_sampled_language_is_always_present_and_covers_every_present_one():
    present = torch.tensor([[True, False, True], [False, True, False], [True, True, True]])
    draws = torch.stack([sample_one_language(present) for _ in range(300)])  # [300, 3]
    for row in range(3):
        assert set(draws[:, row].tolist()) == set(present[row].nonzero().flatten().tolist())
    assert 60 < (draws[:, 2] == 0).sum() < 140  # uniform over three languages


def test_instance_without_any_caption_is_an_error():
    with pytest.raises(ValueError, match=r"batch rows \[1\] have no caption"):
        sample_one_language(torch.tensor([[True, False], [False, False]]))


def test_defaults_come_from_the_yaml_and_embeddings_are_normalised():
    module = _clip()
    assert module.temperature().item() == pytest.approx(0.07)
    batch = _toy_batch(4)
    images, texts = (
        module.encode_images(batch["images"]),
        module.encode_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0]),
    )
    assert images.shape == texts.shape == (4, 64)
    torch.testing.assert_close(images.norm(dim=-1), torch.ones(4))
    assert (
        module.image_encoder.backbone.pos_embed.shape[1] == 1 + (16 // 8) ** 2
    )  # image_size from DataInfo


def test_training_encodes_one_present_caption_per_instance(monkeypatch):
    present = torch.tensor([[True, False, False], [False, True, True], [True, True, True]]).repeat(
        4, 1
    )
    module, batch = _clip(), _toy_batch(12, present)
    encoded = []
    original = module.encode_texts
    monkeypatch.setattr(
        module, "encode_texts", lambda ids, mask: encoded.append(ids) or original(ids, mask)
    )
    for _ in range(10):
        assert torch.isfinite(module.contrastive_loss(batch))
    for ids in encoded:
        assert ids.shape == (12, 8)
        matches = (ids[:, None] == batch["input_ids"]).all(
            -1
        )  # [12, K]: which language was encoded
        assert torch.equal(matches.sum(1), torch.ones(12, dtype=torch.long))
        assert not (matches & ~present).any()


def test_clip_learns_a_toy_matching_problem():
    torch.manual_seed(0)
    module, batch = _clip(), _toy_batch(12)
    module.optim_cfg.warmup_steps = 5
    with torch.no_grad():
        before = module.contrastive_loss(batch).item()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=60,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader([batch] * 60, batch_size=None))
    module.eval()
    with torch.no_grad():
        after = module.contrastive_loss(batch).item()
        scores = (
            module.encode_images(batch["images"])
            @ module.encode_texts(batch["input_ids"][:, 1], batch["attention_mask"][:, 1]).t()
        )
    assert after < before / 3, (before, after)
    assert (scores.argmax(1) == torch.arange(12)).float().mean() >= 0.75


def test_training_clamps_the_temperature_in_place_at_clips_bound():
    """τ pushed below 0.01 (logit scale > 100) sits where the clamped forward has no gradient;
    Lightning's optimiser step must put it back on the bound. lr 0: only the clamp moves it."""
    import math

    module = _clip()
    assert (module.temperature.min_value, module.temperature.max_value) == (0.01, 1.0)
    module.optim_cfg.lr = 0.0
    with torch.no_grad():
        module.temperature.log_tau.fill_(math.log(1e-4))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader([_toy_batch(6)], batch_size=None))
    assert module.temperature.log_tau.item() == pytest.approx(math.log(0.01))
