"""The CCRk module: one training step on an interfaces.md batch, gradient flow, Eq. 6 as a plain sum,
CMLM on MITM's hard positive, τ bounds, the ablation switches and the ITM reranker (spec §10)."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from worlds import RANDOM_BACKBONES

import ccr.methods.ccrk.module as ccrk_module
from ccr import methods
from ccr.methods.ccrk.module import CCRk

CONFIG = Path(__file__).resolve().parents[1] / "ccr/experiments/configs/method/ccrk.yaml"
B, K, L, VOCAB, IMAGE = 8, 3, 16, 120, 32
OPTIM = OmegaConf.create(
    {
        "lr": 1e-3,
        "weight_decay": 0.01,
        "betas": [0.9, 0.98],
        "eps": 1e-8,
        "warmup_steps": 2,
        "min_lr_ratio": 0.0,
        "schedule": "linear",
    }
)
EVALUATION = OmegaConf.create(
    {
        "ks": [1, 5, 10],
        "ndcg_k": 10,
        "unimodal_ndcg_ks": [10, 20, 50],
        "chunk_size": 1024,
        "batch_size": 8,
        "rerank_k": 0,
    }
)


@dataclass
class Info:
    languages: tuple = ("de", "en", "ja")
    vocab_size: int = VOCAB
    pad_token_id: int = 1
    cls_token_id: int = 0
    eos_token_id: int = 2
    mask_token_id: int = 4
    max_length: int = L
    image_size: int = IMAGE
    num_objects: int = 0
    backbones: dict = field(default_factory=lambda: RANDOM_BACKBONES)


def method_config(**overrides):
    """The tiny preset's method section as a run sees it: the full model unless ``ablation`` is given
    (the preset's ``optim:`` and ``evaluation:`` blocks go to the run's sections, not here)."""
    cfg = OmegaConf.load(CONFIG).method
    cfg.ablation = None
    # RANDOM_BACKBONES' tiny text encoder has no HF layers to seed the fusion from (see
    # tests/test_ccrk_fusion_init.py for the preset's seeded fusion): a random 4-head fusion
    cfg.fusion.init_from_text_layers, cfg.fusion.heads = None, 4
    return OmegaConf.merge(cfg, OmegaConf.create(overrides))


def build(**overrides):
    torch.manual_seed(0)
    return CCRk(method_config(**overrides), OPTIM, Info(), EVALUATION)


def training_batch(seed=0, absent=()):
    """A batch shaped like docs/interfaces.md: ids [B, K, L] with <s> first and </s> last."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (B, K, L), generator=gen)
    lengths = torch.randint(4, L + 1, (B, K), generator=gen)
    mask = (torch.arange(L) < lengths[..., None]).long()
    ids[..., 0] = Info.cls_token_id
    ids.scatter_(2, (lengths - 1)[..., None], Info.eos_token_id)
    ids[mask == 0] = Info.pad_token_id
    present = torch.ones(B, K, dtype=torch.bool)
    for instance, language in absent:
        present[instance, language] = False
        ids[instance, language] = Info.pad_token_id
        mask[instance, language] = 0
    return {
        "images": torch.randn(B, 3, IMAGE, IMAGE, generator=gen),
        "input_ids": ids,
        "attention_mask": mask,
        "present": present,
        "languages": list(Info.languages),
        "ids": [str(i) for i in range(B)],
    }


def test_registered_under_ccrk():
    assert methods.get("ccrk") is CCRk


def test_training_step_reaches_every_trainable_parameter():
    module = build()
    loss = module.training_step(training_batch(), 0)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    no_grad = [
        name
        for name, p in module.named_parameters()
        if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert no_grad == []
    parts = {name.split(".")[0] for name, _ in module.named_parameters()}
    assert parts == {
        "image_encoder",
        "text_encoder",
        "fusion",
        "vision_proj",
        "text_proj",
        "itm_head",
        "mlm_head",
        "temperature",
    }


def test_total_is_the_plain_sum_of_the_terms(monkeypatch):
    module = build()
    monkeypatch.setattr(module, "contrastive_loss", lambda *a: torch.tensor(1.5))
    monkeypatch.setattr(module, "matching_loss", lambda *a: torch.tensor(0.25))
    monkeypatch.setattr(module, "masked_lm_loss", lambda *a: torch.tensor(2.0))
    assert module.training_step(training_batch(), 0).item() == pytest.approx(3.75)


def test_cmlm_masks_the_hard_positive_used_by_mitm(monkeypatch):
    samples, masked_ids = [], []
    original_sampler, original_masking = ccrk_module.sample_hard_examples, ccrk_module.mask_tokens

    def record_sampler(*args, **kwargs):
        samples.append(original_sampler(*args, **kwargs))
        return samples[-1]

    def record_masking(input_ids, *args, **kwargs):
        masked_ids.append(input_ids.clone())
        return original_masking(input_ids, *args, **kwargs)

    monkeypatch.setattr(ccrk_module, "sample_hard_examples", record_sampler)
    monkeypatch.setattr(ccrk_module, "mask_tokens", record_masking)
    batch = training_batch()
    build().training_step(batch, 0)
    assert len(samples) == 1 and len(masked_ids) == 1
    assert torch.equal(
        masked_ids[0], batch["input_ids"].reshape(B * K, L)[samples[0].positive_text]
    )


def test_ablation_switches_change_what_the_losses_see(monkeypatch):
    seen = {"modes": [], "text_rows": []}
    original_sampler, original_kcl = ccrk_module.sample_hard_examples, ccrk_module.one_to_k_loss

    def record_sampler(image_feat, text_feat, temperature, mode, present):
        seen["modes"].append(mode)
        return original_sampler(image_feat, text_feat, temperature, mode, present)

    def record_kcl(image_feat, text_feat, *args, **kwargs):
        seen["text_rows"].append(len(text_feat))
        return original_kcl(image_feat, text_feat, *args, **kwargs)

    monkeypatch.setattr(ccrk_module, "sample_hard_examples", record_sampler)
    monkeypatch.setattr(ccrk_module, "one_to_k_loss", record_kcl)
    for overrides in (
        {},
        {"contrastive": "one_to_one"},
        {"hard_mitm": False},
        {"hard_cmlm": False},
        {"hard_mining": "paper", "kcl_weighting": "reference"},
    ):
        seen["modes"].clear()
        seen["text_rows"].clear()
        loss = build(**overrides).training_step(training_batch(), 0)
        assert torch.isfinite(loss)
        expected_rows = B if overrides.get("contrastive") == "one_to_one" else B * K
        assert seen["text_rows"] == [expected_rows]
        mining = overrides.get("hard_mining", "reference")
        expected_modes = [mining, "uniform"] if overrides.get("hard_mitm") is False else [mining]
        assert seen["modes"] == expected_modes


@pytest.mark.parametrize("mining", ["reference", "paper"])
def test_absent_captions_are_handled(mining):
    module = build(hard_mining=mining)
    loss = module.training_step(training_batch(absent=[(0, 1), (3, 0), (3, 2)]), 0)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


def test_bad_switch_is_an_error():
    with pytest.raises(ValueError, match="method.contrastive"):
        build(contrastive="one_to_many")


def test_training_clamps_a_temperature_pushed_past_its_bound():
    """Through Lightning's optimiser step: τ below its bound (where the clamped forward has no
    gradient) is put back on the bound in place; lr 0, so only the clamp can move it."""
    import math

    import lightning as L

    module = build()
    module.optim_cfg.lr = 0.0
    with torch.no_grad():
        module.temperature.log_tau.fill_(math.log(1e-5))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(
        module, train_dataloaders=torch.utils.data.DataLoader([training_batch()], batch_size=None)
    )
    assert module.temperature.log_tau.item() == pytest.approx(math.log(0.001))


def itm_logits(module, image_states, ids, mask):
    text = module.text_encoder(ids, mask)
    return module.itm_head(module.fuse(text.states, text.mask, image_states)[:, 0])


@pytest.mark.parametrize("score", ["prob", "logit"])
def test_reranker_scores_the_requested_pairs_in_both_directions(score):
    module = build(rerank_score=score).eval()
    module.eval_cfg.pair_batch_size = 5  # several calls per direction
    batch = training_batch()
    images = batch["images"][:4]
    ids, mask = batch["input_ids"][:6, 0], batch["attention_mask"][:6, 0]
    reranker = module.reranker(module.image_cache(images), module.text_cache(ids, mask))
    queries, candidates = torch.tensor([2, 0]), torch.tensor([[5, 0, 3], [1, 1, 4]])
    i2t = reranker("i2t", queries, candidates)
    with torch.no_grad():
        logits = torch.stack(
            [
                itm_logits(
                    module,
                    module.image_encoder(images[[q]]).expand(3, -1, -1),
                    ids[candidates[row]],
                    mask[candidates[row]],
                )
                for row, q in enumerate(queries.tolist())
            ]
        )
    expected = (
        logits[..., 1] - logits[..., 0] if score == "prob" else logits[..., 1]
    )  # prob: as log-odds
    assert torch.allclose(i2t, expected, atol=1e-5)
    t2i = reranker("t2i", torch.tensor([5, 4]), torch.tensor([[2, 1], [0, 3]]))
    assert torch.allclose(t2i[0, 0], i2t[0, 0], atol=1e-6)  # image 2 with caption 5, either way
    assert torch.allclose(t2i[1, 0], i2t[1, 2], atol=1e-6)  # image 0 with caption 4


def test_length_buckets_leave_real_token_states_unchanged():
    module = build().eval()
    batch = training_batch()
    ids, mask = batch["input_ids"].reshape(B * K, L), batch["attention_mask"].reshape(B * K, L)
    image_states = module.image_encoder(batch["images"]).repeat_interleave(K, dim=0)
    with torch.no_grad():
        bucketed = module.encode_captions(ids, mask)
        fused = module.fuse(bucketed.states, bucketed.mask, image_states)
        module.method_cfg.length_buckets = 1
        whole = module.text_encoder(ids, mask)
        whole_fused = module.fuse(whole.states, whole.mask, image_states)
    real = mask.bool()
    assert torch.allclose(bucketed.states[real], whole.states[real], atol=1e-5)
    assert torch.allclose(bucketed.pooled, whole.pooled, atol=1e-5)
    assert torch.allclose(fused[real], whole_fused[real], atol=1e-5)


def test_itm_reranking_through_the_metrics_hook_orders_by_itm_when_k_covers_everything():
    from ccr import metrics

    module = build().eval()
    batch = training_batch(seed=4)
    images = batch["images"][:5]
    ids = (
        batch["input_ids"][:5, :2].transpose(0, 1).reshape(10, L)
    )  # language-major: de 0..4, en 0..4
    mask = batch["attention_mask"][:5, :2].transpose(0, 1).reshape(10, L)
    caption_image = torch.arange(5).repeat(2)
    languages = ["de"] * 5 + ["en"] * 5
    with torch.no_grad():
        image_emb, text_emb = module.encode_images(images), module.encode_texts(ids, mask)
        reranker = module.reranker(module.image_cache(images), module.text_cache(ids, mask))
        report = metrics.retrieval_report(
            image_emb,
            text_emb,
            caption_image,
            languages,
            [str(i) for i in range(5)],
            ks=(1,),
            reranker=reranker,
            rerank_k=50,
        )
        image_states = module.image_cache(images)
        itm = torch.stack(
            [module.match_scores(image_states, ids[[t] * 5], mask[[t] * 5]) for t in range(10)], 1
        )
    for slot, lang in enumerate(("de", "en")):
        scores = itm[:, slot * 5 : (slot + 1) * 5]  # [image, caption of this language]
        gold_scores = scores.diagonal()
        i2t_ranks = (scores > gold_scores[:, None]).sum(
            1
        )  # 0-based rank of the gold caption per image
        t2i_ranks = (scores > gold_scores[None, :]).sum(0)
        assert report[f"{lang}/i2t/MeanR"] == pytest.approx(i2t_ranks.double().mean().item() + 1)
        assert report[f"{lang}/t2i/MeanR"] == pytest.approx(t2i_ranks.double().mean().item() + 1)
        assert report[f"{lang}/i2t/R@1"] == pytest.approx(
            100 * (i2t_ranks == 0).double().mean().item()
        )


def test_smoke_training_lowers_the_loss_and_aligns_the_batch():
    """§10.15 in small: languages are fixed token remappings of one base caption per instance."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(5, VOCAB, (B, L - 2), generator=gen)
    remap = [
        torch.cat([torch.arange(5), 5 + torch.randperm(VOCAB - 5, generator=gen)]) for _ in range(K)
    ]
    ids = torch.stack(
        [
            torch.cat(
                [torch.zeros(B, 1, dtype=torch.long), remap[k][base], torch.full((B, 1), 2)], 1
            )
            for k in range(K)
        ],
        1,
    )
    batch = {
        "images": torch.randn(B, 3, IMAGE, IMAGE, generator=gen),
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "present": torch.ones(B, K, dtype=torch.bool),
    }
    module = build()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5])
    with torch.no_grad():
        image_emb = module.encode_images(batch["images"])
        text_emb = module.encode_texts(
            ids.reshape(B * K, L), batch["attention_mask"].reshape(B * K, L)
        )
    owner = torch.arange(B).repeat_interleave(K)
    t2i_r1 = ((text_emb @ image_emb.t()).argmax(1) == owner).float().mean().item()
    i2t_r1 = (owner[(image_emb @ text_emb.t()).argmax(1)] == torch.arange(B)).float().mean().item()
    assert t2i_r1 > 0.5 and i2t_r1 > 0.5  # chance: 1/8


def test_the_matching_head_learns_a_batch_whose_images_it_can_tell_apart():
    """MITM through the real path (encoders, fusion, ITM head) memorises 8 instances: on the default
    world's random-init encoders it sat at the 1:2 prior (0.636) because the image tokens of
    different scenes barely differed, not because the path was broken (issue 14)."""
    from ccr.methods.ccrk.hard_sampling import matching_loss, sample_hard_examples

    module, batch = build(), training_batch(seed=3)
    ids, mask = batch["input_ids"].reshape(B * K, L), batch["attention_mask"].reshape(B * K, L)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(80):
        images = module.image_encoder(batch["images"])
        text = module.encode_captions(ids, mask)
        samples = sample_hard_examples(
            module.vision_proj(images[:, 0]),
            module.text_proj(text.pooled),
            module.temperature(),
            "uniform",
            generator=generator,
        )
        loss = matching_loss(
            module.fuse, module.itm_head, text.states, text.mask, images, samples
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.3, losses[::10]  # the prior's entropy is 0.636


def test_evaluation_encodes_every_caption_in_one_padded_call():
    """Length buckets give each group its own shape, and CPU kernels round differently per shape:
    a caption's retrieval embedding would follow its batch neighbours (and a DDP shard's scores
    differ from one process's). Evaluation encodes the batch as it comes, in one call."""
    module = build().eval()
    batch = training_batch()
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    shapes = []
    module.text_encoder.register_forward_hook(
        lambda m, args, out: shapes.append(tuple(args[0].shape))
    )
    with torch.no_grad():
        module.encode_texts(ids, mask)
    assert shapes == [tuple(ids.shape)]
