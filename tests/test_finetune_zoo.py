"""Fine-tuning from a zoo model: at step 0 a method built on ``method.encoders=zoo:<name>`` scores
exactly what the model's external row scored (same weights, preprocessing, tokenisation,
normalisation), for a tiny saved model of each loader family; LiT locks the image tower."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from external_models import (
    save_tiny_hf_clip,
    save_tiny_mclip,
    save_tiny_metaclip2,
    save_tiny_open_clip,
    save_tiny_remote_code,
)
from test_external import world_overrides
from test_zoo import CORPUS, family_entries

from ccr.experiments import external, train
from ccr.experiments.config import ConfigError, compose
from ccr.experiments.trainer import build_trainer

FAMILIES = ["tiny-open-clip", "tiny-hf-clip", "tiny-metaclip2", "tiny-remote", "tiny-mclip"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    models = {
        "open_clip": save_tiny_open_clip(root / "open-clip"),
        "hf_clip": save_tiny_hf_clip(root / "hf-clip", CORPUS),
        "hf_metaclip2": save_tiny_metaclip2(root / "metaclip2", CORPUS),
        "hf_remote": save_tiny_remote_code(root / "remote", CORPUS),
        "mclip": save_tiny_mclip(root / "mclip", CORPUS),
    }
    family_entries(root / "zoo", models)
    return root / "zoo"


def step_zero_report(cfg):
    """The test report of the method as built, before any training step."""
    data = train.build_datamodule(cfg)
    (stage,) = train.stages_of(cfg, data)
    L.seed_everything(cfg.seed, verbose=False)
    module = stage.build(None)
    trainer = build_trainer(cfg, Path(cfg.run_dir), Path(cfg.run_dir) / "eval", callbacks=[])
    trainer.test(module, datamodule=train.StageData(data, stage), verbose=False)
    return module.last_report


@pytest.mark.parametrize("family", FAMILIES)
def test_clip_from_a_zoo_model_scores_its_external_row_exactly_at_step_zero(
    family, world, zoo_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("CCR_ZOO_DIR", str(zoo_dir))
    external.main([f"model=zoo:{family}", "device=cpu", *world_overrides(world, tmp_path / "ext")])
    (row,) = [json.loads(p.read_text()) for p in (tmp_path / "ext").rglob("metrics.json")]
    cfg = compose(
        [
            "method=clip",
            f"method.encoders=zoo:{family}",
            *world_overrides(world, tmp_path / "runs"),
            "trainer.cpu_threads=1",
        ]
    )
    assert (
        cfg.method.projection == "none" and cfg.data.pretrained_io.model == row["external"]["model"]
    )
    report = step_zero_report(cfg)
    cross_modal = {k: v for k, v in row["metrics"].items() if not k.startswith(("i2i/", "t2t/"))}
    assert {k: report[k] for k in cross_modal} == cross_modal


def test_method_encoders_needs_a_zoo_name_and_top_level_encoders(zoo_dir, monkeypatch):
    monkeypatch.setenv("CCR_ZOO_DIR", str(zoo_dir))
    with pytest.raises(ConfigError, match="method.encoders=hf:x: expected zoo:<name>"):
        compose(["method=clip", "method.encoders=hf:x"])
    with pytest.raises(ConfigError, match="method mclip has no top-level image_encoder"):
        compose(["method=mclip", "method.encoders=zoo:tiny-open-clip"])
    with pytest.raises(ConfigError, match="method ccrk reads token states"):
        compose(["method=ccrk", "method.encoders=zoo:tiny-open-clip"])
    with pytest.raises(ConfigError, match="zoo:absent: no"):
        compose(["method=clip", "method.encoders=zoo:absent"])


def test_lit_is_labelled_so(zoo_dir):
    assert compose(["method=clip", "method.lit=true"]).variant == "lit"
    assert compose(["method=clip", "method.lit=true", "variant=lit+xlmr"]).variant == "lit+xlmr"
    with pytest.raises(ConfigError, match="variant=big would hide it"):
        compose(["method=clip", "method.lit=true", "variant=big"])


@pytest.mark.slow
def test_lit_from_a_zoo_model_leaves_the_image_tower_bit_identical_after_training(
    world, zoo_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("CCR_ZOO_DIR", str(zoo_dir))
    cfg = compose(
        [
            "method=clip",
            "method.encoders=zoo:tiny-open-clip",
            "method.lit=true",
            *world_overrides(world, tmp_path / "runs"),
            "data.batch_size=4",
            "trainer.max_steps=3",
            "trainer.cpu_threads=1",
            "optim.warmup_steps=0",
            "optim.lr=0.01",
        ]
    )
    data = train.build_datamodule(cfg)
    (stage,) = train.stages_of(cfg, data)
    L.seed_everything(cfg.seed, verbose=False)
    before = {k: v.clone() for k, v in stage.build(None).state_dict().items()}
    run_dir = train.train(cfg)
    record = json.loads((run_dir / "metrics.json").read_text())
    assert record["method"] == "clip+lit" and record["train_steps"] == 3
    after = torch.load(run_dir / "checkpoints" / train.DONE, weights_only=True)["state_dict"]
    image = [k for k in before if k.startswith(("image_encoder.", "image_proj."))]
    text = [k for k in before if k.startswith("text_encoder.")]
    assert image and text
    assert all(torch.equal(before[k], after[k]) for k in image)
    assert any(not torch.equal(before[k], after[k]) for k in text)


def test_the_new_keys_at_their_defaults_leave_a_runs_fingerprint_unchanged():
    """Runs composed before projection / lit / pretrained_io / logger existed group with new ones."""
    from omegaconf import OmegaConf

    from ccr.experiments.runs import config_fingerprint

    config = OmegaConf.to_container(compose(["method=clip"]), resolve=True)
    assert (config["method"]["projection"], config["method"]["lit"]) == ("linear", False)
    earlier = {
        **config,
        "method": {k: v for k, v in config["method"].items() if k not in ("projection", "lit")},
        "data": {k: v for k, v in config["data"].items() if k != "pretrained_io"},
        "trainer": {k: v for k, v in config["trainer"].items() if k != "logger"},
    }
    assert config_fingerprint(config) == config_fingerprint(earlier)
    lit = OmegaConf.to_container(compose(["method=clip", "method.lit=true"]), resolve=True)
    assert config_fingerprint(lit) != config_fingerprint(config)


def test_lit_keeps_the_locked_image_tower_in_eval_mode_while_the_text_side_trains(world, tmp_path):
    cfg = compose(
        [
            "method=clip",
            "method.lit=true",
            "method.image_encoder.name=tiny",
            "method.text_encoder.name=tiny",
            *world_overrides(world, tmp_path / "runs"),
        ]
    )
    data = train.build_datamodule(cfg)
    (stage,) = train.stages_of(cfg, data)
    module = stage.build(None).train()
    assert not module.image_encoder.training and not module.image_proj.training
    assert module.text_encoder.training and module.text_proj.training
    assert not any(p.requires_grad for p in module.image_tower_parameters())
    assert all(p.requires_grad for p in module.text_encoder.parameters())
