"""mCLIP's ablations (spec Table 2) as ``variant=`` switches: each changes what trains, and each
test fails if its switch is ignored."""

import pytest
import torch
import torch.nn.functional as F
from test_mclip_method import BASE, DATA, image_batch, method_config, snapshot
from test_mclip_stages import adam_step, changed_names, parallel_batch

from ccr.experiments.config import compose, method_label
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.mclip.module import ABLATIONS, MCLIP, build_mte_stage, selected_stages
from ccr.methods.mclip.translation import contrastive_translation_loss, translation_nll

QUIET = {
    "translation.dropout": 0.0,
    "mte.config.hidden_dropout_prob": 0.0,
    "mte.config.attention_probs_dropout_prob": 0.0,
}


def stage_one(variant, joint=True):
    torch.manual_seed(0)
    return build_mte_stage(
        method_config(variant=variant, **QUIET), BASE.optim, DATA, BASE.evaluation, joint
    ).eval()


def nmt_and_ctl(module, batch):
    """The two Stage-1 terms recomputed from the module's parts."""
    src = module.mte(batch["src_input_ids"], batch["src_attention_mask"])
    tgt = module.mte(batch["tgt_input_ids"], batch["tgt_attention_mask"])
    ctl = contrastive_translation_loss(src.states, src.mask, tgt.states, tgt.mask, 0.1)
    if module.decoder is None:
        return None, ctl
    logits, gold = module.decoder(
        batch["tgt_input_ids"],
        src.states,
        src.mask,
        batch["tgt_language"],
        module.mte.input_embeddings().weight,
    )
    return translation_nll(logits, gold, DATA.pad_token_id), ctl


def test_the_variant_of_the_run_reaches_the_method_and_names_its_own_leaderboard_row():
    for name in ABLATIONS:
        cfg = compose(["method=mclip", f"variant={name}"])
        assert cfg.method.variant == name and method_label(cfg) == f"mclip+{name}"
    assert compose(["method=mclip"]).method.variant is None  # the full model


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="mclip variant 'no_ttc'"):
        selected_stages(method_config(variant="no_ttc"))


@pytest.mark.parametrize("variant", ["no_ctl", "no_nmt"])
def test_a_stage_one_variant_without_stage_one_is_refused(variant):
    with pytest.raises(ValueError, match="changes Stage 1b"):
        selected_stages(method_config(variant=variant, stages="[teacher,trikd]"))


def test_full_stage_one_is_nmt_plus_two_ctl():
    module = stage_one(None)
    batch = parallel_batch()
    with torch.no_grad():
        nmt, ctl = nmt_and_ctl(module, batch)
        assert module.training_step(batch, 0).item() == pytest.approx(
            (nmt + 2 * ctl).item(), rel=1e-5
        )


def test_no_ctl_trains_the_encoder_on_nmt_alone():
    module = stage_one("no_ctl")
    batch = parallel_batch()
    with torch.no_grad():
        nmt, _ = nmt_and_ctl(module, batch)
        assert module.training_step(batch, 0).item() == pytest.approx(nmt.item(), rel=1e-5)
    before = snapshot(module)
    adam_step(module, batch)
    encoder = {
        n for n, _ in module.named_parameters() if n.startswith("mte.backbone.model.encoder.")
    }
    assert encoder <= changed_names(
        before, snapshot(module)
    )  # still the joint stage (two-stage NMT)
    assert selected_stages(method_config(variant="no_ctl")) == [
        "teacher",
        "mte_nmt",
        "mte_ctl",
        "trikd",
    ]


def test_no_nmt_tunes_the_encoder_with_ctl_alone_and_has_no_decoder():
    method = method_config(variant="no_nmt", **QUIET)
    assert selected_stages(method) == ["teacher", "mte_ctl", "trikd"]
    module = stage_one("no_nmt")
    assert module.decoder is None
    batch = parallel_batch()
    with torch.no_grad():
        _, ctl = nmt_and_ctl(module, batch)
        assert module.training_step(batch, 0).item() == pytest.approx((2 * ctl).item(), rel=1e-5)
    stages = MCLIP.pipeline(method, BASE.optim, DATA, BASE.evaluation, protocol="zero-shot")
    assert [s.name for s in stages] == ["teacher", "mte_ctl", "trikd"]


@pytest.mark.parametrize("variant", ["no_stage1", "no_stage1_no_ttc", "no_stage1_no_itc"])
def test_no_stage_one_variants_start_tri_kd_from_the_mte_as_it_comes(variant):
    method = method_config(variant=variant)
    stages = MCLIP.pipeline(method, BASE.optim, DATA, BASE.evaluation, protocol="zero-shot")
    assert [s.name for s in stages] == ["teacher", "trikd"]
    paper = method_config("mclip_paper", variant=variant)
    assert selected_stages(paper) == ["trikd"]


def trikd_terms(module, batch):
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    h_i = module.encode_images(batch["images"])
    h_x = module.encode_texts(ids, mask)
    h_t = F.normalize(module.clip_projector(module.teacher.encode_texts(ids, mask)), dim=-1)
    return info_nce(h_i, h_x, 0.07), info_nce(h_t, h_x, 0.07)


def test_no_ttc_is_itc_alone_and_never_calls_the_teacher_text_tower(monkeypatch):
    torch.manual_seed(0)
    full = MCLIP(method_config(), BASE.optim, DATA, BASE.evaluation).eval()
    torch.manual_seed(0)
    module = MCLIP(
        method_config(variant="no_stage1_no_ttc"), BASE.optim, DATA, BASE.evaluation
    ).eval()
    batch = image_batch()
    with torch.no_grad():
        itc, ttc = trikd_terms(module, batch)
        assert full.training_step(batch, 0).item() == pytest.approx(
            (itc + 0.1 * ttc).item(), rel=1e-5
        )

        def refuse(*args, **kwargs):
            raise AssertionError("TTC ablated, yet the CLIP text tower was called")

        monkeypatch.setattr(module.teacher, "encode_texts", refuse)
        assert module.training_step(batch, 0).item() == pytest.approx(itc.item(), rel=1e-5)


def test_no_itc_is_a_tenth_of_ttc_and_leaves_the_temperature_alone():
    torch.manual_seed(0)
    module = MCLIP(method_config(variant="no_stage1_no_itc"), BASE.optim, DATA, BASE.evaluation)
    batch = image_batch()
    module.eval()
    with torch.no_grad():
        _, ttc = trikd_terms(module, batch)
        assert module.training_step(batch, 0).item() == pytest.approx((0.1 * ttc).item(), rel=1e-5)
    assert not module.logit_scale.requires_grad
    optimizer = module.configure_optimizers()["optimizer"]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(module.logit_scale) not in in_optimizer
    before = snapshot(module)
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    module.train()
    module.training_step(batch, 0).backward()
    optimizer.step()
    changed = changed_names(before, snapshot(module))
    assert "clip_projector.weight" in changed and "logit_scale" not in changed


def test_no_itc_refuses_captions_the_teacher_cannot_read():
    module = MCLIP(method_config(variant="no_stage1_no_itc"), BASE.optim, DATA, BASE.evaluation)
    with pytest.raises(ValueError, match="without ITC has no loss for 'xx'"):
        module.training_step(image_batch(languages=("xx",)), 0)
