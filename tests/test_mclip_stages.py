"""mCLIP's stages (spec §9 test 11 and the issue's resume test): Stage-1 freezing, checkpoints that
resume where they stopped, the pipeline handing trained weights from stage to stage, and the
paper-size configuration built at tiny width."""

import copy
from dataclasses import replace

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from test_mclip_method import BASE, DATA, caption_ids, image_batch, method_config, snapshot

from ccr.methods.mclip.module import MCLIP, ClipBaselineTeacher, OpenClipTeacher, build_mte_stage
from ccr.methods.mclip.translation import mte_embeddings


def parallel_batch(n=6, seed=0, src="en", tgt="xx"):
    src_ids, src_mask = caption_ids(n, seed=seed)
    tgt_ids, tgt_mask = caption_ids(n, seed=seed + 100)
    return {
        "src_input_ids": src_ids,
        "src_attention_mask": src_mask,
        "tgt_input_ids": tgt_ids,
        "tgt_attention_mask": tgt_mask,
        "src_language": src,
        "tgt_language": tgt,
    }


def stage_one(joint, seed=0, **overrides):
    torch.manual_seed(seed)
    return build_mte_stage(method_config(**overrides), BASE.optim, DATA, BASE.evaluation, joint)


def adam_step(module, batch):
    optimizer = module.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = 1e-3
    module.train()
    module.training_step(batch, 0).backward()
    optimizer.step()


def changed_names(before, after):
    return {name for name in before if not torch.equal(before[name], after[name])}


def test_stage_1a_trains_only_the_decoder_and_its_language_tags():
    module = stage_one(joint=False)
    module.train()
    assert not module.mte.training and not module.teacher.training
    before = snapshot(module)
    adam_step(module, parallel_batch())
    changed = changed_names(before, snapshot(module))
    decoder = {name for name, _ in module.named_parameters() if name.startswith("decoder.")}
    assert changed == decoder and "decoder.language_tags.weight" in changed


@pytest.mark.parametrize("train_embeddings", [False, True])
def test_stage_1b_trains_encoder_layers_and_embeddings_only_when_asked(train_embeddings):
    module = stage_one(joint=True, **{"translation.ctl.train_embeddings": train_embeddings})
    before = snapshot(module)
    adam_step(module, parallel_batch())
    changed = changed_names(before, snapshot(module))
    embeddings = {
        f"mte.backbone.model.embeddings.{n}"
        for n, _ in mte_embeddings(module.mte).named_parameters()
    }
    assert "mte.backbone.model.embeddings.word_embeddings.weight" in embeddings
    assert bool(changed & embeddings) == train_embeddings  # the paper (False) freezes them
    assert not any(name.startswith("teacher.") for name in changed)
    encoder = {
        name
        for name, _ in module.named_parameters()
        if name.startswith("mte.backbone.model.encoder.")
    }
    assert encoder <= changed and any(name.startswith("decoder.") for name in changed)


def test_stage_1b_contrastive_term_is_weighted_by_two():
    module = stage_one(joint=True, **{"translation.dropout": 0.0}).eval()
    batch = parallel_batch()
    joint_loss = module.training_step(batch, 0)
    module.joint = False
    nmt_only = module.training_step(batch, 0)
    from ccr.methods.mclip.translation import contrastive_translation_loss

    src = module.mte(batch["src_input_ids"], batch["src_attention_mask"])
    tgt = module.mte(batch["tgt_input_ids"], batch["tgt_attention_mask"])
    ctl = contrastive_translation_loss(src.states, src.mask, tgt.states, tgt.mask, 0.1)
    assert joint_loss.item() == pytest.approx((nmt_only + 2.0 * ctl).item(), rel=1e-5)


def fit(module, batches, max_steps, ckpt_path=None, save_to=None):
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(
        module,
        train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None),
        ckpt_path=ckpt_path,
    )
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return trainer


@pytest.mark.parametrize("stage", ["mte_ctl", "trikd"])
def test_a_stage_resumed_from_its_checkpoint_continues_where_it_stopped(stage, tmp_path):
    quiet = {
        "translation.dropout": 0.0,
        "trikd.dropout": 0.0,
        "trikd.attn_dropout": 0.0,
        "mte.config.hidden_dropout_prob": 0.0,
        "mte.config.attention_probs_dropout_prob": 0.0,
        "trikd.warmup_steps": 2,
        "translation.ctl.decay_from_step": 1,
    }
    data = replace(
        DATA, backbones=copy.deepcopy(DATA.backbones)
    )  # the MTE (world's text) without dropout
    data.backbones["text"]["config"].update(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    if stage == "trikd":

        def build():
            return MCLIP(method_config(**quiet), BASE.optim, data, BASE.evaluation)

        batches = [image_batch(seed=1)]
    else:

        def build():
            return build_mte_stage(method_config(**quiet), BASE.optim, data, BASE.evaluation, True)

        batches = [parallel_batch(seed=1)]
    # one batch per epoch: Lightning restarts a plain loader's epoch on resume, so only then is the
    # data order of the resumed run the same as the uninterrupted one
    torch.manual_seed(0)
    straight = build()
    fit(straight, batches, 4)
    torch.manual_seed(0)
    first = build()
    fit(first, batches, 2, save_to=tmp_path / "half.ckpt")
    assert changed_names(snapshot(first), snapshot(straight))  # the half-way state differs
    torch.manual_seed(123)
    resumed = build()
    trainer = fit(resumed, batches, 4, ckpt_path=tmp_path / "half.ckpt")
    assert trainer.global_step == 4
    expected, got = snapshot(straight), snapshot(resumed)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-6), name


class FakeDataModule:
    """The two training views a pipeline asks for, as fixed in-memory batches."""

    def __init__(self):
        self.languages_asked = []

    def train_dataloader(self, languages=None):
        self.languages_asked.append(list(languages))
        return torch.utils.data.DataLoader([image_batch(seed=3)], batch_size=None)

    def parallel_dataloader(self, beta=None, max_tokens=None):
        return torch.utils.data.DataLoader([parallel_batch(seed=4)], batch_size=None)


def test_the_pipeline_hands_each_stage_the_previous_stages_weights(tmp_path):
    method = method_config()
    stages = MCLIP.pipeline(method, BASE.optim, DATA, BASE.evaluation, protocol="zero-shot")
    assert [s.name for s in stages] == ["teacher", "mte_nmt", "mte_ctl", "trikd"]
    budgets = [
        method.teacher.max_steps,
        method.translation.nmt.max_steps,
        method.translation.ctl.max_steps,
        method.trikd.max_steps,
    ]
    assert [s.max_steps for s in stages] == budgets
    data = FakeDataModule()
    previous, trained = None, {}
    for stage in stages:
        module = stage.build(previous)
        fit(module, list(stage.dataloader(data)), 1, save_to=tmp_path / stage.name / "done.ckpt")
        trained[stage.name] = snapshot(module)
        previous = tmp_path / stage.name / "done.ckpt"
    assert data.languages_asked == [["en"], ["en"]]
    final = stages[-1].build(tmp_path / "mte_ctl" / "done.ckpt")
    assert isinstance(final.teacher, ClipBaselineTeacher)
    for name, tensor in final.teacher.model.state_dict().items():
        assert torch.equal(tensor, trained["teacher"][name]), name
    for name, tensor in final.mte.state_dict().items():
        assert torch.equal(tensor, trained["mte_ctl"]["mte." + name]), name
    assert changed_names(
        {k: trained["mte_nmt"][k] for k in trained["mte_ctl"] if k.startswith("mte.")},
        trained["mte_ctl"],
    )  # Stage 1b moved the encoder that TriKD receives
    assert not hasattr(final, "decoder")
    skeleton = stages[-1].build(
        None
    )  # how ccr/experiments/evaluate.py rebuilds the evaluated module
    skeleton.load_state_dict(torch.load(previous, weights_only=False)["state_dict"])
    assert not changed_names(trained["trikd"], snapshot(skeleton))


def save_word_level_tokenizer(folder):
    """A tiny Hugging Face tokenizer (`<s>`=0, `<pad>`=1, `</s>`=2) standing in for XLM-R's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = [
        "<s>",
        "<pad>",
        "</s>",
        "<unk>",
        "a",
        "red",
        "blue",
        "circle",
        "square",
        "on",
        "the",
        "left",
    ]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(folder)
    return fast


def test_the_paper_configuration_builds_and_trains_at_tiny_width(tmp_path):
    paper = method_config("mclip_paper")
    assert (
        paper.stages == ["mte_nmt", "mte_ctl", "trikd"] and paper.mte.name == "hf:xlm-roberta-base"
    )
    assert (
        paper.teacher.open_clip.model == "ViT-B-32"
        and paper.teacher.open_clip.pretrained == "openai"
    )
    assert (paper.trikd.heads, paper.trikd.ffn, paper.trikd.lr, paper.trikd.warmup_steps) == (
        12,
        3072,
        1e-2,
        500,
    )
    assert (paper.translation.layers, paper.translation.ctl_weight, paper.trikd.ttc_weight) == (
        12,
        2.0,
        0.1,
    )
    tokenizer = save_word_level_tokenizer(tmp_path / "tokenizer")
    tiny = OmegaConf.merge(
        paper,
        {
            "teacher": {
                "open_clip": {
                    "mte_tokenizer": str(tmp_path / "tokenizer"),
                    "pretrained": None,
                    "config": {
                        "embed_dim": 32,
                        "vision_cfg": {
                            "image_size": 32,
                            "patch_size": 8,
                            "width": 64,
                            "layers": 2,
                            "head_width": 32,
                        },
                        "text_cfg": {
                            "context_length": 16,
                            "vocab_size": 49408,
                            "width": 64,
                            "heads": 2,
                            "layers": 2,
                        },
                    },
                }
            },
            "mte": {
                "name": "hf",
                "config": {
                    "model_type": "xlm-roberta",
                    "vocab_size": len(tokenizer),
                    "hidden_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "intermediate_size": 128,
                    "max_position_embeddings": 20,
                    "pad_token_id": 1,
                    "bos_token_id": 0,
                    "eos_token_id": 2,
                },
            },
            "translation": {"layers": 2, "heads": 4, "ffn": 128},
            "trikd": {"heads": 4, "ffn": 128},
        },
    )
    data = DATA.__class__(
        **{
            **DATA.__dict__,
            "vocab_size": len(tokenizer),
            "pad_token_id": 1,
            "cls_token_id": 0,
            "eos_token_id": 2,
        }
    )
    stages = MCLIP.pipeline(tiny, BASE.optim, data, BASE.evaluation, protocol="zero-shot")
    assert [s.name for s in stages] == ["mte_nmt", "mte_ctl", "trikd"]
    module = stages[-1].build(None)
    assert isinstance(module.teacher, OpenClipTeacher)
    encoded = tokenizer(
        ["a red circle", "a blue square on the left", "the red square", "a circle"],
        padding="max_length",
        max_length=10,
        return_tensors="pt",
    )
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    clip_tokens = module.teacher.clip_tokenizer(["a red circle"])
    with torch.no_grad():
        assert torch.allclose(
            module.teacher.encode_texts(ids[:1], mask[:1]),
            module.teacher.text(clip_tokens, clip_tokens != 0)[1],
        )
    before = snapshot(module)
    batch = {
        "images": torch.randn(4, 3, 32, 32),
        "input_ids": ids[:, None],
        "attention_mask": mask[:, None],
        "present": torch.ones(4, 1, dtype=torch.bool),
        "languages": ["en"],
    }
    optimizer = module.configure_optimizers()["optimizer"]
    module.train()
    loss = module.training_step(batch, 0)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    changed = changed_names(before, snapshot(module))
    assert changed and all(
        name.startswith(("clip_projector.", "x_projector.", "logit_scale")) for name in changed
    )


@pytest.mark.parametrize("cut", ["source", "target"])
def test_stage_1b_ctl_sends_gradient_into_the_encoder_through_either_side(cut, monkeypatch):
    """Spec §9 test 13 at module level: the source is encoded first, the target second; with one
    side's gradient cut the encoder layers still receive gradient through the other."""
    module = stage_one(joint=True, **{"translation.dropout": 0.0})
    module.train()
    forward, calls = module.mte.forward, []

    def cut_one_side(input_ids, attention_mask):
        output = forward(input_ids, attention_mask)
        if ("source", "target")[len(calls)] == cut:
            output.states.register_hook(torch.zeros_like)
        calls.append(cut)
        return output

    monkeypatch.setattr(module.mte, "forward", cut_one_side)
    module.training_step(parallel_batch(), 0).backward()
    assert len(calls) == 2
    layers = [
        p for n, p in module.named_parameters() if n.startswith("mte.backbone.model.encoder.")
    ]
    assert sum(float(p.grad.abs().sum()) for p in layers if p.grad is not None) > 0


def test_the_paper_preset_has_the_papers_trainable_count(tmp_path):
    """Spec §9 test 3 on mclip_paper.yaml itself: only where the weights come from changes (tiny
    saved models with the paper's interface widths: a 512-d CLIP joint space, a 768-d, 12-head
    XLM-R); the TriKD section is the preset's."""
    import open_clip
    from transformers import XLMRobertaConfig, XLMRobertaModel

    tokenizer = save_word_level_tokenizer(tmp_path / "tokenizer")
    mte_dir = tmp_path / "xlmr"
    XLMRobertaModel(
        XLMRobertaConfig(
            vocab_size=len(tokenizer),
            hidden_size=768,
            num_hidden_layers=1,
            num_attention_heads=12,
            intermediate_size=64,
            max_position_embeddings=20,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        )
    ).save_pretrained(mte_dir)
    clip_config = {
        "embed_dim": 512,
        "vision_cfg": {
            "image_size": 32,
            "patch_size": 16,
            "width": 64,
            "layers": 1,
            "head_width": 32,
        },
        "text_cfg": {
            "context_length": 16,
            "vocab_size": 49408,
            "width": 64,
            "heads": 2,
            "layers": 1,
        },
    }
    torch.save(open_clip.CLIP(**clip_config).state_dict(), tmp_path / "clip.pt")
    paper = method_config(
        "mclip_paper",
        **{
            "mte.name": f"hf:{mte_dir}",
            "teacher.open_clip.pretrained": str(tmp_path / "clip.pt"),
            "teacher.open_clip.mte_tokenizer": str(tmp_path / "tokenizer"),
        },
    )
    paper.teacher.open_clip.config = clip_config
    data = DATA.__class__(
        **{
            **DATA.__dict__,
            "vocab_size": len(tokenizer),
            "pad_token_id": 1,
            "cls_token_id": 0,
            "eos_token_id": 2,
        }
    )
    stages = MCLIP.pipeline(paper, BASE.optim, data, BASE.evaluation, protocol="zero-shot")
    module = stages[-1].build(None)
    assert module.mte.out_dim == 768 and module.teacher.embed_dim == 512
    assert (
        tuple(module.clip_projector.weight.shape) == (768, 512)
        and module.clip_projector.bias is None
    )
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert trainable == 14_568_961
