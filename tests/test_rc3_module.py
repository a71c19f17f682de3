"""The RC3 module (spec rc3.md §2, §3, §9 items 11-13, 15): which parameters each objective trains,
weak data only in R-XVtCL, every ablation switch acting, input formats, MLM masking, decoder
targets, the stop-gradient of the textual relevance, and a short smoke run."""

import copy

import pytest
import torch
from rc3_helpers import (
    LANGUAGES,
    B,
    Info,
    build,
    config,
    parallel_batch,
    train_batch,
    with_tiny_regions,
)
from torch.utils.data import DataLoader

from ccr.methods.rc3.module import RC3, VisualInput, mask_content
from ccr.methods.rc3.seq2seq import Encoded

WEAK = [i % 2 == 1 for i in range(B)]


def seeded_losses(module, batch, seed=0):
    torch.manual_seed(seed)
    return module.losses(batch, parallel_batch())


def grad_owners(module, loss):
    module.zero_grad()
    loss.backward(retain_graph=True)
    return {
        n for n, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0
    }


def test_each_objective_trains_exactly_its_parts():
    module = build()
    losses = seeded_losses(module, train_batch(weak=WEAK))
    assert set(losses) == {"mclm", "itm", "probe", "rxvtcl", "kl", "xtcl"}
    owners = {
        name: grad_owners(module, losses[name])
        for name in ("mclm", "itm", "probe", "rxvtcl", "xtcl")
    }
    decoder = {n for n in owners["mclm"] if n.startswith("net.model.decoder.")}
    assert decoder and not any(
        n.startswith("net.model.decoder.")
        for k in ("itm", "rxvtcl", "xtcl", "probe")
        for n in owners[k]
    )
    assert owners["probe"] == {n for n, _ in module.named_parameters() if n.startswith("probe_")}
    assert "itm_head.weight" in owners["itm"] and "itm_head.weight" not in owners["rxvtcl"]
    assert any(n.startswith("mlm_head.transform") for n in owners["mclm"])
    # XTCL is text only: no visual tokeniser; R-XVtCL reaches the patch pathway and the encoder
    assert not any(n.startswith("net.visual.") for n in owners["xtcl"])
    assert "net.visual.patch_embed.weight" in owners["rxvtcl"]
    assert "net.model.encoder.layers.0.fc1.weight" in owners["xtcl"] & owners["rxvtcl"]
    assert module.net.visual.roi_proj is None  # patch-only default: no ROI layer at all


def test_weak_rows_never_enter_the_strict_only_losses():
    batch = train_batch(weak=WEAK)
    base = seeded_losses(build(), batch)  # fresh modules: the trackers start equal
    changed = dict(batch)
    weak = torch.tensor(WEAK)
    changed["images"] = batch["images"].clone()
    changed["images"][weak] = torch.randn_like(batch["images"][weak]) * 5
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][weak] = torch.flip(batch["input_ids"][weak], [0])
    other = seeded_losses(build(), changed)
    for name in ("mclm", "itm", "probe", "xtcl"):
        assert torch.equal(base[name], other[name]), name
    assert not torch.equal(base["rxvtcl"], other["rxvtcl"])  # the weak rows do count in R-XVtCL


def nan_weak_images(batch):
    batch = dict(batch)
    batch["images"] = batch["images"].clone()
    batch["images"][torch.tensor(WEAK)] = float("nan")
    return batch


def test_no_weak_switch_leaves_weak_data_out():
    batch = nan_weak_images(train_batch(weak=WEAK))
    assert torch.isnan(seeded_losses(build(), batch)["rxvtcl"])  # full model reads weak rows
    losses = seeded_losses(build("variant=no_weak"), batch)
    assert "kl" not in losses and all(torch.isfinite(v) for v in losses.values())


def test_no_kl_switch_treats_weak_pairs_as_full_positives():
    batch = train_batch(weak=WEAK)
    full, no_kl = seeded_losses(build(), batch), seeded_losses(build("variant=no_kl"), batch)
    assert "kl" in full and "kl" not in no_kl
    assert full["kl"] > 0
    # same RNG draws, same weights: the only difference is the KL of the weak anchors
    assert full["rxvtcl"] > no_kl["rxvtcl"]


def test_without_weak_rows_no_kl_trains_exactly_like_the_full_model():
    """At weak_fraction 0 the regulariser has nothing to act on: the "w/o KL" ablation is the
    full model, bit for bit (so its rows at weak_fraction 0 are rc3's)."""
    batch = train_batch(weak=[False] * B)
    trained = []
    for variant in ("full", "no_kl"):
        module = build(f"variant={variant}")
        optimiser = torch.optim.Adam(module.parameters(), lr=1e-3)
        for step in range(3):
            torch.manual_seed(step)
            losses = module.losses(batch, parallel_batch())
            optimiser.zero_grad()
            module.total_loss(losses).backward()
            optimiser.step()
        assert "kl" not in losses
        trained.append(module.state_dict())
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_no_rxvtcl_and_no_xtcl_switches():
    batch = nan_weak_images(train_batch(weak=WEAK))
    no_rx = seeded_losses(build("variant=no_rxvtcl"), batch)
    assert set(no_rx) == {"mclm", "itm", "probe", "xtcl"}
    only = seeded_losses(build("variant=no_rxvtcl_xtcl"), batch)
    assert set(only) == {"mclm", "itm", "probe"}


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(ValueError, match="rc3 ablation 'nope'"):
        build("variant=nope")


def test_variant_changes_the_leaderboard_label():
    from ccr.experiments.config import compose, method_label

    assert method_label(compose(["method=rc3", "variant=no_kl"])) == "rc3+no_kl"
    default = compose(["method=rc3"]).evaluation  # the paper's scorer: the ITM head over every pair
    assert (default.scorer, default.rerank_k) == ("cross_encoder", 0)


def test_text_relevance_carries_no_gradient(monkeypatch):  # §9.11
    module = build()
    probe = torch.nn.Parameter(torch.ones(()))
    original = module.text_representation

    def through_probe(ids, mask, language):
        return original(ids, mask, language) * probe

    monkeypatch.setattr(module, "text_representation", through_probe)
    losses = seeded_losses(module, train_batch(weak=WEAK))
    losses["kl"].requires_grad and losses["rxvtcl"].backward()
    assert probe.grad is None


def test_strict_rois_weak_patches_and_combined_layout():  # §9.12
    module = build("method.visual.strict_input=combined")
    batch = train_batch(weak=WEAK)
    batch["roi_features"] = torch.randn(B, 4, 8)
    seen = []
    encode = module.net.encode

    def spy(ids, mask, visual=None, visual_mask=None):
        out = encode(ids, mask, visual, visual_mask)
        seen.append(
            (None if visual is None else visual.shape[1], ids.shape[1], out.states.shape[1])
        )
        return out

    module.net.encode = spy
    seeded_losses(module, batch)
    patches = (16 // 8) ** 2
    fused = [s for s in seen if s[0] is not None]
    assert {v for v, _, _ in fused} == {4 + 1 + patches, patches}  # strict combined, weak patches
    for visual, text, total in fused:
        assert total == 1 + visual + text
    rois = module.net.visual.rois(batch["roi_features"][:2])
    tokens = module.net.combined_tokens(rois, module.net.visual.patches(batch["images"][:2]))
    sep = module.net.embed(torch.tensor([module.net.special_ids["sep"]]))[0]
    assert torch.equal(
        tokens[0, 4], sep
    )  # [SEP] right after the ROIs (position 37 at 36 ROIs, after [CLS])


def test_roi_input_without_features_is_a_clear_error():
    module = build("method.visual.strict_input=roi")
    with pytest.raises(ValueError, match="roi_features"):
        seeded_losses(module, train_batch())


def test_grid_regions_stand_in_for_missing_roi_features_and_never_train():  # §2.8 (2)
    module = with_tiny_regions()
    frozen = {n for n, _ in module.regions.named_parameters()}
    assert frozen and not any(p.requires_grad for p in module.regions.parameters())
    module.train()
    assert not module.regions.training  # no dropout / batch statistics in the frozen backbone
    before = {n: p.clone() for n, p in module.regions.state_dict().items()}
    losses = seeded_losses(module, train_batch(weak=WEAK))
    module.total_loss(losses).backward()
    assert all(p.grad is None for p in module.regions.parameters())
    assert module.net.visual.roi_proj.weight.grad is not None  # the regions fed the strict pool
    assert all(torch.equal(before[n], t) for n, t in module.regions.state_dict().items())
    images = train_batch()["images"][:2]
    regions = module.regions(images)
    assert regions.shape == (2, (16 // 8) ** 2, 8)  # one region per patch, the global token dropped
    assert torch.equal(
        module.eval_visual(images).tokens, module.net.visual.rois(regions)
    )  # evaluation too


@pytest.mark.parametrize("variant", ["full", "no_weak", "no_rxvtcl", "no_rxvtcl_xtcl"])
def test_every_trained_parameter_gets_a_gradient_without_weak_rows(variant):
    """DDP (no unused-parameter search) needs each trainable parameter in every step's graph; with
    ROI input the patch pathway is read by weak triplets only, so a batch without any must still
    reach it (stand-in rows), and a variant that never reads patches must not train it."""
    module = with_tiny_regions(f"variant={variant}")
    losses = seeded_losses(module, train_batch())
    module.total_loss(losses).backward()
    missing = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing
    patch_trained = module.net.visual.patch_embed.weight.requires_grad
    assert patch_trained == (variant == "full")


def test_shipped_roi_features_win_over_grid_regions():
    module = with_tiny_regions()
    batch = train_batch()
    batch["roi_features"] = torch.randn(B, 3, 8)
    calls = []
    module.regions.register_forward_hook(lambda *args: calls.append(1))
    seen = []
    encode = module.net.encode
    module.net.encode = lambda ids, mask, visual=None, visual_mask=None: (
        seen.append(None if visual is None else visual.shape[1])
        or encode(ids, mask, visual, visual_mask)
    )
    seeded_losses(module, batch)
    assert not calls and 3 in seen


def test_absent_shipped_regions_are_masked_out():
    """An image with fewer detector regions than the batch holds is zero-padded and masked
    (``roi_mask``): what the padding holds changes no loss, and its image-only features are those
    of its real regions alone."""
    batch = train_batch(weak=WEAK)
    batch["roi_features"] = torch.randn(B, 4, 8)
    batch["roi_mask"] = torch.arange(4) < torch.tensor([2, 3, 4, 1, 4, 2, 3, 4])[:, None]
    noisy = dict(
        batch, roi_features=batch["roi_features"].masked_fill(~batch["roi_mask"][..., None], 7.0)
    )
    base, other = (
        seeded_losses(with_tiny_regions(), batch),
        seeded_losses(with_tiny_regions(), noisy),
    )
    assert base.keys() == other.keys()
    for name in base:
        torch.testing.assert_close(base[name], other[name])
    module = with_tiny_regions().eval()
    images, rois = batch["images"][:1], batch["roi_features"][:1]
    with torch.no_grad():
        padded = module.image_only_features(
            module.visual_tokens(images, rois, batch["roi_mask"][:1])
        )
        alone = module.image_only_features(module.visual_tokens(images, rois[:, :2]))
    torch.testing.assert_close(padded, alone)


def test_language_tag_is_last_real_token_and_states_read_at_index_zero():  # §9.12
    module = build()
    ids, mask = train_batch()["input_ids"][:, 0], train_batch()["attention_mask"][:, 0]
    tagged = module.net.tag_source(ids, mask, "ja")
    last = mask.sum(1) - 1
    assert (tagged[torch.arange(B), last] == module.net.tag_ids["ja"]).all()
    assert (tagged[:, 0] == Info.cls_token_id).all()
    encoded = module.net.encode(tagged, mask)
    assert torch.equal(encoded.pooled, encoded.states[:, 0])


def test_mlm_masks_fifteen_percent_of_content_tokens_only():  # §9.13
    module = build()
    ids, mask = train_batch(n=256)["input_ids"][:, 0], train_batch(n=256)["attention_mask"][:, 0]
    specials = module.specials()
    content = mask.bool() & ~torch.isin(ids, torch.tensor(specials))
    rates = []
    torch.manual_seed(0)
    for _ in range(20):
        masked, labels = mask_content(ids, mask, Info.mask_token_id, specials, 0.15)
        chosen = labels != -100
        assert not (chosen & ~content).any()
        assert (masked[chosen] == Info.mask_token_id).all() and torch.equal(
            masked[~chosen], ids[~chosen]
        )
        rates.append(chosen.sum() / content.sum())
    assert float(torch.stack(rates).mean()) == pytest.approx(0.15, abs=0.01)


def test_decoder_targets_are_the_other_language(monkeypatch):  # §9.13
    module = build()
    seen = {}
    original = module.net.translation_nll

    def spy(encoded, target_ids, target_mask, language):
        seen.update(target=target_ids, language=language)
        return original(encoded, target_ids, target_mask, language)

    monkeypatch.setattr(module.net, "translation_nll", spy)
    batch = train_batch()
    captured = {}
    from ccr.methods.rc3 import module as rc3_module

    Triplets = rc3_module.Triplets

    class Spy(Triplets):
        def __init__(self, *args):
            super().__init__(*args)
            captured.setdefault("t", self)  # the strict triplets come first

    monkeypatch.setattr(rc3_module, "Triplets", Spy)
    seeded_losses(module, batch)
    t = captured["t"]
    assert seen["language"] == t.lang_j != t.lang_i
    assert torch.equal(seen["target"], t.ids_j)
    k = LANGUAGES.index(t.lang_j)
    assert torch.equal(t.ids_j, batch["input_ids"][t.rows, k][:, : t.ids_j.shape[1]])


def smoke_train(variant, steps=40):
    """``steps`` Adam steps on 16 tiny triplets (8 weak); returns the module and its totals."""
    module = build("method.anchors_per_task=8", f"variant={variant}")
    batch = train_batch(weak=[i >= 8 for i in range(16)], n=16)
    optimiser = torch.optim.Adam(module.parameters(), lr=1e-3)
    totals = []
    for step in range(steps):
        torch.manual_seed(step)
        losses = module.losses(batch, parallel_batch())
        total = module.total_loss(losses)
        optimiser.zero_grad()
        total.backward()
        optimiser.step()
        assert all(torch.isfinite(v) for v in losses.values()), (step, losses)
        totals.append(total.item())
    module.settings.use_kl = True  # measure the KL of the trained weights on the same batch
    torch.manual_seed(0)
    with torch.no_grad():
        kl = module.losses(batch, parallel_batch())["kl"].item()
    return module, totals, kl


def test_smoke_run_loss_decreases():  # §9.15 (total loss; the KL: see the next test)
    module, totals, kl = smoke_train("full")
    assert sum(totals[-5:]) < sum(totals[:5])
    assert module.vt_tracker.p_avg() > 0 and int(module.vt_tracker.count) == 41


def test_the_modules_kl_gradient_lowers_the_kl(monkeypatch):
    """From a model trained 20 steps without the KL: the regulariser's share of the weak loss
    (R-XVtCL with minus without the KL, same draws) is the KL, and a small step on it lowers the KL
    against the same (detached) textual target. The live KL can still rise: the step moves the
    shared encoder, hence TR and P_tr, too (see docs/rc3.md)."""
    import ccr.methods.rc3.module as rc3_module

    module, _, _ = smoke_train("no_kl", steps=20)
    batch = train_batch(weak=[i >= 8 for i in range(16)], n=16)
    trackers = copy.deepcopy(module.vt_tracker.state_dict())
    target = {}
    live = rc3_module.textual_distances

    def frozen_target(tr_i, tr_j, perm):
        target.setdefault("d_tr", live(tr_i, tr_j, perm))
        return target["d_tr"]

    monkeypatch.setattr(rc3_module, "textual_distances", frozen_target)

    def rxvtcl(use_kl):
        module.settings.use_kl = use_kl
        module.vt_tracker.load_state_dict(trackers)
        torch.manual_seed(0)
        losses = module.losses(batch, parallel_batch())
        return losses["rxvtcl"], losses.get("kl")

    with_kl, kl_before = rxvtcl(True)
    without_kl, _ = rxvtcl(False)
    share = with_kl - without_kl
    assert share.item() == pytest.approx(kl_before.item(), rel=1e-4)  # Eq. 13: a sum of two means
    module.zero_grad()
    share.backward()
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    _, kl_after = rxvtcl(True)
    assert kl_before > 0.005 and kl_after < 0.95 * kl_before


def test_match_logits_score_each_pair_with_the_itm_head():
    module = build().eval()
    batch = train_batch()
    visual = module.net.visual.patches(batch["images"][:3])
    ids = module.net.tag_source(batch["input_ids"][:3, 0], batch["attention_mask"][:3, 0], "en")
    got = module.match_logits(VisualInput(visual), ids, batch["attention_mask"][:3, 0])
    one = module.itm_head(
        module.net.encode(ids[1:2], batch["attention_mask"][1:2, 0], visual[1:2]).pooled
    )
    assert got[1].item() == pytest.approx(one.item(), abs=1e-5)
    assert isinstance(module.net.encode(ids, batch["attention_mask"][:3, 0]), Encoded)


def test_evaluation_embeddings_do_not_depend_on_the_batch_they_come_in():
    """Issue 16: a caption's first-stage embedding is bit-identical whether it is encoded with 11
    others, alone, or in a split batch, and whatever its batch was padded to (CPU kernels round
    differently per shape; on near-tied t2t scores that reordered a DDP run's ranking)."""
    module = build(
        "method.backbone.d_model=64", "method.backbone.heads=4", "method.backbone.ffn_dim=128"
    ).eval()
    batch = train_batch(n=12)
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]

    def texts(rows, width):
        return module.encode_texts(ids[rows, :width], mask[rows, :width], ["en"] * len(rows))

    def images(rows):
        return module.encode_images(batch["images"][rows])

    with torch.no_grad():
        together = texts(list(range(12)), ids.shape[1])
        assert torch.equal(texts([3], int(mask[3].sum())), together[3:4])
        assert torch.equal(
            torch.cat(
                [texts(list(range(5)), ids.shape[1]), texts(list(range(5, 12)), ids.shape[1])]
            ),
            together,
        )
        assert torch.equal(images([2]), images(list(range(12)))[2:3])


def test_xtcl_draws_step_indexed_batches_from_the_loader_its_stage_attaches():
    """Issue 33: the parallel-text stream comes from the pretrain stage (``extra_loaders``), built
    when first read, not from the trainer's datamodule; without it XTCL is a one-line error."""
    cfg = config()
    (pretrain,) = RC3.pipeline(
        cfg.method, cfg.optim, Info(), cfg.evaluation, protocol=cfg.protocol
    )[:1]
    built = []

    class Data:
        def parallel_dataloader(self):
            built.append(True)
            return DataLoader([parallel_batch()], batch_size=None, sampler=OneItemSampler())

    module = pretrain.build(None)
    with pytest.raises(RuntimeError, match="no 'parallel' loader was attached"):
        module.next_parallel_batch()
    module.attach_loaders(pretrain.extra_loaders(Data()))
    assert not built  # a factory: the loader is made on the first training step (after DDP init)
    batch = module.next_parallel_batch()
    assert built == [True]
    assert torch.equal(batch["src_input_ids"], parallel_batch()["src_input_ids"])


class OneItemSampler(torch.utils.data.Sampler):
    """A one-item sampler with the ``set_epoch`` the training samplers have."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([0])

    def __len__(self):
        return 1


def test_rc3s_own_text_pass_without_caption_languages_is_a_one_line_error():
    """A module outside evaluation is given each caption's language; without it, it says so."""
    module = build().eval()
    batch = train_batch(n=4)
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    with pytest.raises(ValueError, match="rc3 tags every caption with its language"):
        module.encode_texts(ids, mask)
    with torch.no_grad():
        tagged = module.encode_texts(ids, mask, ["en"] * 4)
        assert not torch.equal(tagged, module.encode_texts(ids, mask, ["de"] * 4))
