"""The CL2CM module (spec cl2cm.md §2, §3, §9 items 1, 10-13): shapes, which parts each loss
trains, the teacher isolated from L_ckt's gradient, the baseline = plain InfoNCE, every ablation
switch acting, inference through the CM network only, padding and batch-order invariance, and the
paper preset's architecture built from tiny local models."""

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from worlds import random_backbones

import ccr.methods.cl2cm.module as cl2cm_module
from ccr import methods
from ccr.experiments.config import compose
from ccr.methods.cl2cm.module import CL2CM

B, L, VOCAB, IMAGE = 6, 14, 90, 32
ABLATIONS = [
    "full",
    "cm_only",
    "cl_inst",
    "cl_multi",
    "ckt_sent",
    "ckt_word",
    "word_ckt_word",
    "attention_labels",
    "ot_unbalanced",
    "ot_partial",
    "kl_teacher_student",
]


@dataclass
class Info:
    languages: tuple = ("en", "de", "ja")
    vocab_size: int = VOCAB
    pad_token_id: int = 1
    cls_token_id: int = 0
    eos_token_id: int = 2
    mask_token_id: int = 4
    max_length: int = L + 10
    image_size: int = IMAGE
    num_objects: int = 0
    backbones: dict = field(default_factory=lambda: random_backbones(width=32))


def config(*overrides):
    return compose(["method=cl2cm", "method.embed_dim=16", *overrides])


def build(*overrides, seed=0):
    cfg = config(*overrides)
    torch.manual_seed(seed)
    return CL2CM(cfg.method, cfg.optim, Info(), cfg.evaluation)


def captions(gen, length=L):
    ids = torch.randint(5, VOCAB, (B, length), generator=gen)
    lengths = torch.randint(4, L + 1, (B,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids[:, 0] = Info.cls_token_id
    ids.scatter_(1, (lengths - 1)[:, None], Info.eos_token_id)
    ids[mask == 0] = Info.pad_token_id
    return ids, mask


def triple_batch(seed=0, length=L):
    gen = torch.Generator().manual_seed(seed)
    src, src_mask = captions(gen, length)
    tgt, tgt_mask = captions(gen, length)
    return {
        "images": torch.randn(B, 3, IMAGE, IMAGE, generator=gen),
        "src_input_ids": src,
        "src_attention_mask": src_mask,
        "tgt_input_ids": tgt,
        "tgt_attention_mask": tgt_mask,
        "tgt_languages": ["de"] * B,
        "ids": [str(i) for i in range(B)],
    }


def grads_of(module, loss):
    module.zero_grad()
    loss.backward(retain_graph=True)
    return {name: p.grad for name, p in module.named_parameters()}


def nonzero(grads, prefix):
    return any(
        g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.startswith(prefix)
    )


def test_registered_and_every_loss_is_finite_with_the_spec_shapes():
    assert methods.get("cl2cm") is CL2CM
    module = build()
    losses = module.losses(triple_batch())
    assert set(losses) == {"cm_inst", "cl_inst", "word", "ckt"}
    assert all(v.dim() == 0 and torch.isfinite(v) for v in losses.values())
    batch = triple_batch()
    assert module.encode_images(batch["images"]).shape == (B, 16)
    assert module.encode_texts(batch["tgt_input_ids"], batch["tgt_attention_mask"]).shape == (B, 16)
    total = module.total_loss(losses)
    expected = 0.4 * losses["cm_inst"] + 0.6 * losses["ckt"] + losses["cl_inst"] + losses["word"]
    assert torch.allclose(total, expected)


def test_gradient_paths_of_each_loss():
    module = build()
    losses = module.losses(triple_batch())
    for name in ("cl_inst", "word"):  # CL losses: the text encoder only
        grads = grads_of(module, losses[name])
        assert nonzero(grads, "text_encoder.")
        assert not nonzero(grads, "image_encoder.") and not nonzero(grads, "text_head.")
    for name in ("cm_inst", "ckt"):  # CM losses: image encoder, text head, text encoder
        grads = grads_of(module, losses[name])
        assert nonzero(grads, "image_encoder.") and nonzero(grads, "text_head.")
        assert nonzero(grads, "text_encoder.")
    assert not module.temperature.log_tau.requires_grad  # τ_n fixed (adopted)


def test_ckt_gives_no_gradient_to_the_teacher_side(monkeypatch):
    """Backpropagating L_ckt reaches neither the source-caption states nor S_cl."""
    module = build()
    seen = {}
    original = module.teacher_similarity

    def spy(cls_s, cls_t, hs, ht, ws, wt):
        seen["hs"], seen["cls_s"] = hs, cls_s
        seen["S_cl"] = original(cls_s, cls_t, hs, ht, ws, wt)
        return seen["S_cl"]

    monkeypatch.setattr(module, "teacher_similarity", spy)
    ckt = module.losses(triple_batch())["ckt"]
    assert not seen["S_cl"].requires_grad
    hs_grad, cls_grad = torch.autograd.grad(ckt, [seen["hs"], seen["cls_s"]], allow_unused=True)
    assert hs_grad is None and cls_grad is None
    grads = grads_of(module, ckt)
    assert nonzero(grads, "image_encoder.") and nonzero(grads, "text_head.")


def test_baseline_is_plain_infonce_between_images_and_target_captions():
    module = build("variant=cm_only")
    batch = triple_batch()
    losses = module.losses(batch)
    assert set(losses) == {"cm_inst"}
    f_v = module.encode_images(batch["images"])
    f_t = module.encode_texts(batch["tgt_input_ids"], batch["tgt_attention_mask"])
    S = f_v @ f_t.t() / 0.07
    y = torch.arange(B)
    plain = (F.cross_entropy(S, y) + F.cross_entropy(S.t(), y)) / 2
    assert torch.allclose(module.total_loss(losses), plain, atol=1e-6)
    batch["src_input_ids"] = torch.full_like(batch["src_input_ids"], 7)  # sources are not read
    assert torch.allclose(module.total_loss(module.losses(batch)), plain, atol=1e-6)


def losses_of(variant, *overrides):
    module = build(f"variant={variant}", *overrides)
    return {k: v.item() for k, v in module.losses(triple_batch()).items()}


def test_each_ablation_switch_changes_what_is_computed():
    full = losses_of("full")
    assert set(losses_of("cl_inst")) == {"cm_inst", "cl_inst"}
    assert set(losses_of("cl_multi")) == {"cm_inst", "cl_inst", "word"}
    for variant, key in [
        ("ckt_sent", "ckt"),
        ("ckt_word", "ckt"),
        ("word_ckt_word", "ckt"),
        ("attention_labels", "word"),
        ("ot_unbalanced", "word"),
        ("ot_partial", "word"),
        ("kl_teacher_student", "ckt"),
    ]:
        changed = losses_of(variant)
        assert changed[key] != pytest.approx(full[key], rel=1e-4), variant
    assert set(losses_of("ckt_sent")) == {"cm_inst", "cl_inst", "ckt"}
    assert losses_of("full", "method.word_label_norm=count")["word"] != pytest.approx(full["word"])
    assert losses_of("full", "method.word_temperature=1.0")["word"] != pytest.approx(full["word"])
    assert losses_of("full", "method.kd_temperature=0.5")["ckt"] != pytest.approx(full["ckt"])
    assert losses_of("full", "method.sentence_weight=0.2")["ckt"] != pytest.approx(full["ckt"])


def test_without_transfer_the_cm_loss_is_the_instance_loss_alone():
    module = build("variant=cl_multi")
    losses = module.losses(triple_batch())
    assert torch.allclose(
        module.total_loss(losses), losses["cm_inst"] + losses["cl_inst"] + losses["word"]
    )


def test_the_variant_selects_the_ablation_and_an_unknown_one_is_an_error():
    assert config("variant=ot_partial").method.ablation == "ot_partial"
    assert build("variant=ot_partial").settings.ot.variant == "partial"
    with pytest.raises(ValueError, match="cl2cm ablation 'no_such'"):
        build("variant=no_such")
    free = build("variant=noise30", "method.ablation=cm_only")
    assert not free.settings.use_ckt


def test_lambda_one_needs_no_word_similarity(monkeypatch):
    def forbidden(*args):
        raise AssertionError("S_word computed although λ = 1")

    monkeypatch.setattr(cl2cm_module, "maxsim_word_similarity", forbidden)
    build("method.sentence_weight=1.0").losses(triple_batch())
    with pytest.raises(AssertionError, match="S_word"):
        build().losses(triple_batch())


def test_inference_is_the_cm_dual_encoder_without_ot_or_transfer(monkeypatch):
    module = build().eval()
    batch = triple_batch()
    for name in (
        "sinkhorn_plan",
        "relational_kd_loss",
        "maxsim_word_similarity",
        "ot_pseudo_labels",
        "attention_pseudo_labels",
    ):
        monkeypatch.setattr(cl2cm_module, name, lambda *a, **k: pytest.fail("teacher at test"))
    with torch.no_grad():  # what evaluation calls for every image and caption
        images = module.encode_images(batch["images"])
        texts = module.encode_texts(batch["tgt_input_ids"], batch["tgt_attention_mask"])
    with torch.no_grad():
        f_v = F.normalize(module.image_head(module.image_encoder(batch["images"])[:, 0]), dim=-1)
        out = module.text_encoder(batch["tgt_input_ids"], batch["tgt_attention_mask"])
        f_t = F.normalize(module.text_head(out.pooled), dim=-1)
    assert torch.allclose(images @ texts.t(), f_v @ f_t.t(), atol=1e-6)


def pad_columns(batch, extra):
    padded = dict(batch)
    for side in ("src", "tgt"):
        ids, mask = batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"]
        padded[f"{side}_input_ids"] = F.pad(ids, (0, extra), value=Info.pad_token_id)
        padded[f"{side}_attention_mask"] = F.pad(mask, (0, extra), value=0)
    return padded


def test_extra_padding_and_batch_order_change_no_loss(monkeypatch):
    module = build()
    base = module.losses(triple_batch())
    # without the trimming of all-pad columns, only the masks keep the padding out
    monkeypatch.setattr(cl2cm_module, "trim_padding", lambda ids, mask: (ids, mask))
    padded = pad_columns(triple_batch(), 6)
    for key, value in module.losses(padded).items():
        assert value.item() == pytest.approx(base[key].item(), abs=1e-5), key
    order = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    batch = triple_batch()
    shuffled = {k: v[order] if torch.is_tensor(v) else v for k, v in batch.items()}
    for key, value in module.losses(shuffled).items():
        assert value.item() == pytest.approx(base[key].item(), abs=1e-5), key


def test_source_and_target_share_one_text_encoder_and_training_step_logs():
    module = build()
    assert [n for n, _ in module.named_children()] == [
        "image_encoder",
        "text_encoder",
        "image_head",
        "text_head",
        "temperature",
    ]
    logged = {}
    module.log = lambda name, value, **kw: logged.setdefault(name, value)
    total = module.training_step(triple_batch(), 0)
    assert set(logged) == {"loss/cm_inst", "loss/cl_inst", "loss/word", "loss/ckt", "loss/total"}
    assert logged["loss/total"] == pytest.approx(total.item())


# ---- the paper preset ---------------------------------------------------------------------------

TINY_CLIP = {
    "embed_dim": 512,
    "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
    "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 16, "heads": 1, "layers": 1},
}
TINY_BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
    "pad_token_id": 1,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def test_paper_preset_architecture_from_tiny_local_models_takes_a_step(tmp_path):
    import open_clip
    from transformers import BertConfig, BertModel

    paper = compose(["method=cl2cm_paper"]).method
    assert (
        paper.image_encoder.name == "open_clip:ViT-B-32"
        and paper.image_encoder.pretrained == "openai"
    )
    assert paper.text_encoder.name == "hf:bert-base-multilingual-cased" and paper.embed_dim == 512
    torch.manual_seed(0)
    clip_path = tmp_path / "clip.pt"
    torch.save(open_clip.CLIP(**TINY_CLIP).state_dict(), clip_path)
    bert_dir = tmp_path / "mbert"
    BertModel(BertConfig(**TINY_BERT)).save_pretrained(bert_dir)
    cfg = compose(
        [
            "method=cl2cm_paper",
            f"method.image_encoder.pretrained={clip_path}",
            f"method.text_encoder.name=hf:{bert_dir}",
        ]
    )
    cfg.method.image_encoder.config = TINY_CLIP
    module = CL2CM(cfg.method, cfg.optim, Info(), cfg.evaluation)
    assert isinstance(module.image_head, torch.nn.Identity)  # CLIP's 512-d embedding, no extra head
    assert module.text_head.linear.in_features == 32 and module.text_head.linear.out_features == 512
    stored = BertModel.from_pretrained(bert_dir).embeddings.word_embeddings.weight
    assert torch.equal(module.text_encoder.input_embeddings().weight, stored)
    optimizer = torch.optim.Adam(module.parameters(), lr=2.5e-5)
    loss = module.total_loss(module.losses(triple_batch()))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert module.image_encoder.backbone.visual.conv1.weight.grad.abs().sum() > 0


def test_evaluation_encodes_every_caption_at_the_batch_width():
    """Trimming all-pad columns gives a batch a width that depends on its longest caption, and CPU
    kernels round differently per shape: a caption's retrieval embedding would follow its batch
    neighbours (a DDP shard's scores then differ from one process's). Evaluation does not trim."""
    module = build().eval()
    batch = pad_columns(triple_batch(), 6)
    ids, mask = batch["tgt_input_ids"], batch["tgt_attention_mask"]
    shapes = []
    module.text_encoder.register_forward_hook(
        lambda m, args, out: shapes.append(tuple(args[0].shape))
    )
    with torch.no_grad():
        module.encode_texts(ids, mask)
    assert shapes == [tuple(ids.shape)]
