"""CCRk's ablations (spec §3.5, paper Table 2 / Fig. 5) selected by ``variant=``: each changes what
the training step computes (a test per switch fails if the switch is ignored), names its own
leaderboard row, and impossible settings are one-line errors."""

import pytest
import torch
from omegaconf import OmegaConf
from worlds import random_backbones

import ccr.methods.ccrk.module as ccrk_module
from ccr.experiments.config import compose, method_label, typed
from ccr.experiments.runs import config_fingerprint
from ccr.methods.ccrk.module import CCRk
from tests.test_ccrk_module import (
    EVALUATION,
    OPTIM,
    B,
    Info,
    K,
    build,
    training_batch,
)

VARIANTS = (
    "full",
    "no_kcl",
    "no_hard_mitm",
    "no_hard_cmlm",
    "no_cl",
    "pure_kcl",
    "pure_one_to_one",
)


def variant_module(variant, rerank_k=0):
    """A tiny CCRk built from the method section ``variant=<variant>`` composes, on a random-init
    HF XLM-R standing in for the world's (the preset seeds its fusion from it)."""
    method = compose(["method=ccrk", f"variant={variant}"]).method
    evaluation = {**EVALUATION, "rerank_k": rerank_k}
    torch.manual_seed(0)
    return CCRk(method, OPTIM, Info(backbones=random_backbones(hf_text_for=Info())), evaluation)


@pytest.fixture
def seen(monkeypatch):
    """What one training step hands to the contrastive loss, the samplers and the CMLM masking."""
    record = {"kcl_rows": [], "modes": [], "samples": [], "cmlm_rows": []}
    sampler, kcl, masking = (
        ccrk_module.sample_hard_examples,
        ccrk_module.one_to_k_loss,
        ccrk_module.mask_tokens,
    )

    def record_sampler(image_feat, text_feat, temperature, mode, present):
        record["modes"].append(mode)
        record["samples"].append(sampler(image_feat, text_feat, temperature, mode, present))
        return record["samples"][-1]

    def record_kcl(image_feat, text_feat, *args, **kwargs):
        record["kcl_rows"].append(len(text_feat))
        return kcl(image_feat, text_feat, *args, **kwargs)

    def record_masking(input_ids, *args, **kwargs):
        record["cmlm_rows"].append(input_ids.clone())
        return masking(input_ids, *args, **kwargs)

    monkeypatch.setattr(ccrk_module, "sample_hard_examples", record_sampler)
    monkeypatch.setattr(ccrk_module, "one_to_k_loss", record_kcl)
    monkeypatch.setattr(ccrk_module, "mask_tokens", record_masking)
    return record


def step(module, seen):
    loss = module.training_step(training_batch(), 0)
    assert torch.isfinite(loss)
    return loss


def test_full_model_uses_kcl_over_all_languages_and_hard_mining(seen):
    step(variant_module("full"), seen)
    assert seen["kcl_rows"] == [B * K] and seen["modes"] == ["reference"]


def test_no_kcl_contrasts_one_language_per_image(seen):
    step(variant_module("no_kcl"), seen)
    assert seen["kcl_rows"] == [B] and seen["modes"] == ["reference"]


def test_no_hard_mitm_draws_matching_pairs_uniformly(seen):
    step(variant_module("no_hard_mitm"), seen)
    assert seen["modes"] == ["reference", "uniform"]


def test_no_hard_cmlm_masks_a_uniformly_drawn_language(seen, monkeypatch):
    """The full model masks the hard positive; w/o H-CMLM masks a separate uniform draw (seeded, so it
    differs from that step's hard positive somewhere)."""
    drawn = []
    real_draw = ccrk_module.draw_positive_text
    monkeypatch.setattr(
        ccrk_module, "draw_positive_text", lambda w: drawn.append(real_draw(w)) or drawn[-1]
    )
    step(variant_module("full"), seen)
    full_rows = seen["cmlm_rows"].pop()
    assert torch.equal(
        full_rows,
        training_batch()["input_ids"].reshape(B * K, -1)[seen["samples"][-1].positive_text],
    )
    assert drawn == []
    step(variant_module("no_hard_cmlm"), seen)
    assert len(drawn) == 1 and drawn[0].tolist() != seen["samples"][-1].positive_text.tolist()
    assert torch.equal(
        seen["cmlm_rows"][-1], training_batch()["input_ids"].reshape(B * K, -1)[drawn[0]]
    )


def test_no_cl_trains_matching_and_masked_lm_only(seen, monkeypatch):
    module = variant_module("no_cl", rerank_k=10**6)
    monkeypatch.setattr(module, "matching_loss", lambda *a: torch.tensor(0.25))
    monkeypatch.setattr(module, "masked_lm_loss", lambda *a: torch.tensor(2.0))
    assert step(module, seen).item() == pytest.approx(2.25)
    assert seen["kcl_rows"] == []


def test_no_cl_must_rank_by_itm():
    with pytest.raises(ValueError, match="evaluation.rerank_k"):
        variant_module("no_cl")


@pytest.mark.parametrize("variant, rows", [("pure_kcl", B * K), ("pure_one_to_one", B)])
def test_pure_contrastive_has_no_fusion_and_trains_the_contrastive_loss_alone(
    variant, rows, seen, monkeypatch
):
    module = variant_module(variant)
    assert (
        not hasattr(module, "fusion")
        and not hasattr(module, "itm_head")
        and not hasattr(module, "mlm_head")
    )
    monkeypatch.setattr(module, "contrastive_loss", lambda *a: torch.tensor(1.5))
    assert step(module, seen).item() == pytest.approx(1.5)
    monkeypatch.undo()
    module = variant_module(variant)
    loss = module.training_step(training_batch(), 0)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)
    assert module.reranker(None, None) is None


def test_pure_contrastive_cannot_rerank():
    with pytest.raises(ValueError, match="rerank_k=0"):
        variant_module("pure_kcl", rerank_k=16)


def test_every_variant_is_its_own_leaderboard_row():
    configs = [compose(["method=ccrk", f"variant={v}"]) for v in VARIANTS]
    assert [method_label(c) for c in configs] == [f"ccrk+{v}" for v in VARIANTS]
    assert len({config_fingerprint(c) for c in configs}) == len(VARIANTS)


def test_unknown_variant_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="no_kcl"):
        variant_module("no_such_thing")


def test_training_step_clamps_a_temperature_pushed_past_its_bounds():
    """τ's parameter below (or above) its bound is put back in place by the step itself, before the
    forward pass ([ref]); the step's own gradient at the bound cannot do it."""
    module = build()
    for outside, bound in (
        (-12.0, module.temperature.min_value),
        (3.0, module.temperature.max_value),
    ):
        with torch.no_grad():
            module.temperature.log_tau.fill_(outside)
        module.training_step(training_batch(), 0)
        assert module.temperature.log_tau.exp().item() == pytest.approx(bound)


TINY_FUSION = {"fusion": {"init_from_text_layers": None, "heads": 4}}  # as method_config()


def test_a_run_stored_before_the_ablation_keys_still_loads():
    """config.yaml files written before issue 14 lack these keys: read through the method's
    schema (as ccr.experiments.evaluate reads a run), the full model."""
    stored = OmegaConf.to_container(compose(["method=ccrk"]))
    for key in ("use_fusion", "ablation", "ablations"):
        stored["method"].pop(key)
    method = OmegaConf.merge(typed(OmegaConf.create(stored)).method, TINY_FUSION)
    module = CCRk(method, OPTIM, Info(), EVALUATION)
    assert module.method_cfg.use_fusion and hasattr(module, "fusion")
