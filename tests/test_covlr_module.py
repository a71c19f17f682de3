"""The CoVLR module (spec covlr.md): registration, parameter groups, gradient routing, the ablation
switches, and what reaches each loss. The tiny setup here (spec §2.3 sizes, dropout 0, fp32) is
shared by the other covlr tests."""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from worlds import RANDOM_BACKBONES

from ccr.methods.covlr.module import CoVLR

CONFIG = Path(__file__).resolve().parents[1] / "ccr/experiments/configs/method/covlr.yaml"
B, K, L, VOCAB, IMAGE, CLASSES = 8, 3, 16, 120, 32, 10
OPTIM = OmegaConf.create(
    {
        "lr": 1e-3,
        "weight_decay": 0.02,
        "betas": [0.9, 0.98],
        "eps": 1e-6,
        "warmup_steps": 2,
        "min_lr_ratio": 0.01,
    }
)
EVALUATION = OmegaConf.create(
    {
        "ks": [1, 5, 10],
        "ndcg_k": 10,
        "unimodal_ndcg_ks": [10, 20, 50],
        "chunk_size": 1024,
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
    num_objects: int = CLASSES
    backbones: dict = field(default_factory=lambda: RANDOM_BACKBONES)
    object_categories: tuple | None = None  # None: each label is its own category

    def __post_init__(self):
        if self.object_categories is None:
            self.object_categories = tuple(f"label{i:03d}" for i in range(self.num_objects))


def method_config(**overrides):
    """covlr.yaml at the spec's tiny test sizes, plus ``overrides``."""
    tiny = {"ablation": None, "embed_dim": 32, "cross_modal": {"layers": 1, "heads": 2}}
    return OmegaConf.merge(OmegaConf.load(CONFIG).method, tiny, overrides)


def build(num_objects=CLASSES, **overrides):
    torch.manual_seed(0)
    module = CoVLR(method_config(**overrides), OPTIM, Info(num_objects=num_objects), EVALUATION)
    module.log = module.log_dict = lambda *args, **kwargs: None  # no trainer attached here
    return module


def training_batch(seed=0, batch=B, languages=K, absent=(), labels=True):
    """A docs/interfaces.md training batch: ids [B, K, L] with <s> first and </s> last, objects."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch, languages, L), generator=gen)
    lengths = torch.randint(4, L + 1, (batch, languages), generator=gen)
    mask = (torch.arange(L) < lengths[..., None]).long()
    ids[..., 0] = Info.cls_token_id
    ids.scatter_(2, (lengths - 1)[..., None], Info.eos_token_id)
    ids[mask == 0] = Info.pad_token_id
    present = torch.ones(batch, languages, dtype=torch.bool)
    for instance, language in absent:
        present[instance, language] = False
        ids[instance, language] = Info.pad_token_id
        mask[instance, language] = 0
    out = {
        "images": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen),
        "input_ids": ids,
        "attention_mask": mask,
        "present": present,
        "languages": list(Info.languages)[:languages],
        "ids": [str(i) for i in range(batch)],
    }
    if labels:
        objects = (torch.rand(batch, CLASSES, generator=gen) < 0.3).long()
        objects[0] = 0  # one unlabelled image: masked out of the classification loss
        objects[1, 0] = 1
        out["objects"] = objects
    return out


def grads(module):
    """Name -> gradient clone (zeros where a parameter got none)."""
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in module.named_parameters()
    }


# ---- tests ----------------------------------------------------------------------------------------

import math  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ccr.methods.covlr.module as covlr  # noqa: E402
from ccr import methods  # noqa: E402
from ccr.methods.covlr.augment import drop_tokens, flip_and_translate  # noqa: E402
from ccr.methods.covlr.intra_modal import soft_label_cross_entropy, view_info_nce  # noqa: E402
from ccr.methods.covlr.patch_masking import MaskedPatches, mask_patches  # noqa: E402
from ccr.methods.layers.contrastive import info_nce  # noqa: E402


def test_registered_under_covlr():
    assert methods.get("covlr") is CoVLR


def test_training_step_reaches_every_parameter_and_logs_finite_terms():
    for mode in ("cls", "nce"):
        module = build(uni_mode=mode)
        loss = module.training_step(training_batch(), 0)
        assert torch.isfinite(loss)
        loss.backward()
        assert [
            n for n, p in module.named_parameters() if p.grad is None or p.grad.abs().sum() == 0
        ] == []


def test_itc_values_of_spec_8_5():
    eye = torch.eye(4)
    assert info_nce(eye, eye, 0.2).item() == pytest.approx(math.log(1 + 3 * math.exp(-5)), abs=1e-6)
    assert info_nce(eye, eye, 0.2).item() == pytest.approx(0.020012, abs=1e-6)
    same = F.normalize(torch.ones(4, 4), dim=1)
    assert info_nce(same, same, 0.2).item() == pytest.approx(1.386294, abs=1e-6)
    assert view_info_nce(eye, eye, 0.2).item() == pytest.approx(0.020012, abs=1e-6)
    assert view_info_nce(same, same, 0.2).item() == pytest.approx(1.386294, abs=1e-6)


def test_soft_label_cross_entropy_uses_the_normalised_multi_hot_target():
    labels = torch.tensor([[1, 1, 0, 0]])
    assert soft_label_cross_entropy(torch.zeros(1, 4), labels).item() == pytest.approx(
        1.386294, abs=1e-6
    )
    margin = torch.tensor([[50.0, 50.0, 0.0, 0.0]])
    assert soft_label_cross_entropy(margin, labels).item() == pytest.approx(math.log(2), abs=1e-6)
    # an unlabelled row is left out of the mean, not counted as zero loss
    both = soft_label_cross_entropy(torch.zeros(2, 4), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]))
    assert both.item() == pytest.approx(1.386294, abs=1e-6)
    assert (
        soft_label_cross_entropy(torch.zeros(2, 4, requires_grad=True), torch.zeros(2, 4)).item()
        == 0.0
    )


def test_patch_masking_rates_split_and_global_token():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(2000, 17, 4)
    vector = torch.full((4,), 99.0)
    masked = mask_patches(tokens, vector, 0.15, generator=gen)
    selected = masked.selected
    assert not selected[:, 0].any()
    assert selected.any(1).all()  # at least one target per image
    rate = selected[:, 1:].float().mean().item()
    assert abs(rate - (0.15 + 0.85**16 * 1 / 16)) < 0.005  # 15 % plus the forced one of empty rows
    is_mask = (masked.tokens == 99.0).all(-1) & selected
    kept = (masked.tokens == tokens).all(-1) & selected
    total = selected.sum().item()
    assert abs(is_mask.sum().item() / total - 0.8) < 0.01
    assert abs(kept.sum().item() / total - 0.1) < 0.01
    assert torch.equal(masked.tokens[~selected], tokens[~selected])


def test_mpm_loss_is_the_mse_over_masked_positions_only(monkeypatch):
    module = build()
    tokens = torch.randn(B, 17, 64)
    states, mask = torch.randn(B, 6, 64), torch.ones(B, 6, dtype=torch.bool)
    selected = torch.zeros(B, 17, dtype=torch.bool)
    selected[:, 3] = selected[0, 7] = True

    def fixed_mask(tokens_in, vector, probability):
        return MaskedPatches(
            torch.where(selected[..., None], vector.expand_as(tokens_in), tokens_in), selected
        )

    monkeypatch.setattr(covlr, "mask_patches", fixed_mask)

    class PassQueries(nn.Module):  # fused = the corrupted tokens
        def forward(self, queries, *context):
            return queries

    monkeypatch.setattr(module, "cross_t2i", PassQueries())
    monkeypatch.setattr(module, "mpm_head", nn.Identity())
    loss = module.masked_patch_loss(tokens, states, mask)
    expected = (module.mask_vector.detach() - tokens[selected]).square().mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    changed = tokens.clone()
    changed[~selected] += 5.0  # unmasked targets do not enter the loss
    assert module.masked_patch_loss(changed, states, mask).item() == pytest.approx(
        loss.item(), rel=1e-6
    )
    changed[0, 7] += 5.0
    assert module.masked_patch_loss(changed, states, mask).item() != pytest.approx(
        loss.item(), rel=1e-6
    )


def test_flip_and_translate_moves_whole_pixels_with_zero_fill():
    image = torch.arange(2 * 3 * 10 * 10, dtype=torch.float32).view(2, 3, 10, 10) + 1
    out = flip_and_translate(image, max_shift=0.0, flip_probability=1.0)
    assert torch.equal(out, image.flip(-1))
    gen = torch.Generator().manual_seed(0)
    shifted = flip_and_translate(image, max_shift=0.2, flip_probability=0.0, generator=gen)
    for b in range(2):  # every output is a shifted copy: some (dy, dx) in [-2, 2]² reproduces it
        matches = []
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                expected = torch.zeros_like(image[b])
                ys, xs = slice(max(dy, 0), 10 + min(dy, 0)), slice(max(dx, 0), 10 + min(dx, 0))
                yo, xo = slice(max(-dy, 0), 10 + min(-dy, 0)), slice(max(-dx, 0), 10 + min(-dx, 0))
                expected[:, ys, xs] = image[b][:, yo, xo]
                matches.append(torch.equal(shifted[b], expected))
        assert sum(matches) == 1


def test_drop_tokens_keeps_specials_and_order():
    ids = torch.tensor([[0, 10, 11, 12, 13, 2, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    out_ids, out_mask = drop_tokens(ids, mask, (0, 1, 2, 4), pad_token_id=1, probability=1.0)
    assert out_ids.tolist() == [[0, 2, 1, 1, 1, 1, 1, 1]] and out_mask.tolist() == [
        [1, 1, 0, 0, 0, 0, 0, 0]
    ]
    same_ids, same_mask = drop_tokens(ids, mask, (0, 1, 2, 4), pad_token_id=1, probability=1e-9)
    assert torch.equal(same_ids, ids) and torch.equal(same_mask, mask)


# ---- labels and augmentations reach the right loss (spec §8, §7) --------------------------------------


def record_calls(monkeypatch, name):
    calls = []
    original = getattr(covlr, name)

    def recorder(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(covlr, name, recorder)
    return calls


def test_cls_labels_reach_image_and_every_present_caption(monkeypatch):
    calls = record_calls(monkeypatch, "soft_label_cross_entropy")
    batch = training_batch(absent=[(2, 1), (5, 0), (5, 2)])
    build().training_step(batch, 0)
    image_labels, text_labels = calls[0][1], calls[1][1]
    assert torch.equal(image_labels, batch["objects"])
    present = batch["present"]
    expected = batch["objects"].repeat_interleave(K, dim=0)[present.reshape(-1)]
    assert len(text_labels) == int(present.sum()) == B * K - 3
    assert torch.equal(text_labels, expected)


def test_drawn_caption_switch_classifies_only_the_steps_caption(monkeypatch):
    calls = record_calls(monkeypatch, "soft_label_cross_entropy")
    batch = training_batch()
    build(uni_text_captions="drawn").training_step(batch, 0)
    assert len(calls[1][1]) == B and torch.equal(calls[1][1], batch["objects"])


def test_cls_without_labels_in_the_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="no 'objects'"):
        build().training_step(training_batch(labels=False), 0)
    with pytest.raises(ValueError, match="needs object labels"):
        build(num_objects=0, uni_mode="cls")
    assert build(num_objects=0).uni_mode == "nce" and build().uni_mode == "cls"


def test_nce_views_are_the_augmented_images_and_another_languages_caption(monkeypatch):
    monkeypatch.setattr(covlr, "flip_and_translate", lambda images, *args: images.flip(-1))
    module = build(uni_mode="nce")
    batch = training_batch(absent=[(3, 1), (3, 2)])  # instance 3 has only language 0
    torch.manual_seed(5)
    view = module.training_view(batch)
    for row in range(B):
        if row == 3:  # no other language: a token-dropout copy of its own caption
            kept = view.positive_ids[row][view.positive_mask[row].bool()]
            own = view.input_ids[row][view.attention_mask[row].bool()]
            assert set(kept.tolist()) <= set(own.tolist())
        else:
            matches = [
                k
                for k in range(K)
                if torch.equal(
                    view.positive_ids[row], batch["input_ids"][row, k, : view.positive_ids.shape[1]]
                )
            ]
            drawn = [
                k
                for k in range(K)
                if torch.equal(
                    view.input_ids[row], batch["input_ids"][row, k, : view.input_ids.shape[1]]
                )
            ]
            assert matches and drawn and not set(matches) & set(drawn)
    params = dict(module.named_parameters())
    calls = record_calls(monkeypatch, "view_info_nce")
    losses = module.intra_modal_losses(
        view, {n: params[n] for n in module.virtual_parameter_names()}
    )
    image = module.image_uni_head(module.image_tower(view.images)[:, 0])
    flipped = module.image_uni_head(module.image_tower(view.images.flip(-1))[:, 0])
    assert losses["uni_img"].item() == pytest.approx(
        view_info_nce(image, flipped, 0.2).item(), abs=1e-6
    )
    text = module.text_uni_head(module.text_tower(view.input_ids, view.attention_mask)[1])
    positive = module.text_uni_head(module.text_tower(view.positive_ids, view.positive_mask)[1])
    assert losses["uni_txt"].item() == pytest.approx(
        view_info_nce(text, positive, 0.2).item(), abs=1e-5
    )
    assert len(calls) == 2  # one image and one text NCE, nothing else


# ---- ablation switches: each changes what is computed ---------------------------------------------------


@pytest.mark.parametrize(
    "switch, absent_terms, absent_modules",
    [
        ({"use_mlm": False}, {"mlm"}, {"cross_i2t", "mlm_head"}),
        ({"use_mpm": False}, {"mpm"}, {"cross_t2i", "mpm_head", "mask_vector"}),
        ({"use_uni_img": False}, {"uni_img"}, {"image_uni_head"}),
        ({"use_uni_txt": False}, {"uni_txt"}, {"text_uni_head"}),
    ],
)
def test_ablation_switch_removes_its_term_and_modules(switch, absent_terms, absent_modules):
    full, ablated = build(), build(**switch)
    view = full.training_view(training_batch())
    terms = set(ablated.cross_modal_losses(view)) | set(
        ablated.intra_modal_losses(view, dict(ablated.named_parameters()))
    )
    all_terms = {"itc", "mlm", "mpm", "uni_img", "uni_txt"}
    assert terms == all_terms - absent_terms
    tops = {name.split(".")[0] for name, _ in ablated.named_parameters()}
    assert not tops & absent_modules
    assert absent_modules <= {name.split(".")[0] for name, _ in full.named_parameters()}


def test_virtual_step_covers_only_the_towers_the_uni_loss_reads():
    assert build(use_uni_img=False).parameter_groups()["virt"] == ["text_tower"]
    names = build(use_uni_txt=False).virtual_parameter_names()
    assert names and all(n.startswith("image_tower.") for n in names)


def test_sixteen_bit_mixed_precision_is_rejected():
    with pytest.raises(ValueError, match="16-mixed"):
        covlr.check_precision("16-mixed")
    covlr.check_precision("32-true")
    covlr.check_precision("bf16-mixed")


def test_evaluation_encodes_every_caption_in_one_padded_call():
    """As CCRk: length buckets would give a caption's retrieval embedding its neighbours' rounding."""
    module = build().eval()
    batch = training_batch()
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    shapes = []
    module.text_tower.register_forward_hook(
        lambda m, args, out: shapes.append(tuple(args[0].shape))
    )
    with torch.no_grad():
        module.encode_texts(ids, mask)
    assert shapes == [tuple(ids.shape)]
