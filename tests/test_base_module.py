"""RetrievalModule: optimizer groups, warm-up + cosine schedule, a bf16-mixed CPU training step,
and the evaluation loop (index placement, dropping sampler padding, logging, re-ranking caches)."""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from ccr import metrics
from ccr.methods.base import RetrievalModule, Stage
from ccr.methods.layers.contrastive import LearnableTemperature, info_nce
from ccr.methods.layers.optim import param_groups, warmup_cosine

N_IMAGES, CAPTIONS_PER_IMAGE, LENGTH, VOCAB = 6, 2, 5, 30
OPTIM = OmegaConf.create(
    {
        "lr": 1e-3,
        "weight_decay": 0.02,
        "betas": [0.9, 0.98],
        "eps": 1e-6,
        "warmup_steps": 4,
        "min_lr_ratio": 0.01,
    }
)


@dataclass
class ToyInfo:
    languages: list
    vocab_size: int = VOCAB
    pad_token_id: int = 0
    cls_token_id: int = 1
    eos_token_id: int = 2
    mask_token_id: int = 3
    max_length: int = LENGTH
    image_size: int = 8
    num_objects: int = 0


class ToyMethod(RetrievalModule):
    """Linear image encoder, bag-of-embeddings text encoder; caches its inputs for re-ranking."""

    def __init__(self, method, optim, data, evaluation):
        super().__init__(method, optim, data, evaluation)
        self.image = nn.Linear(3 * 8 * 8, 16)
        info = self.data_info  # normalised by the base (a checkpoint restores it from a dict)
        self.text = nn.Embedding(info.vocab_size, 16, padding_idx=info.pad_token_id)
        self.norm = nn.LayerNorm(16)
        self.pos_embed = nn.Parameter(torch.zeros(1, LENGTH, 16))
        self.temperature = LearnableTemperature()
        self.rerank_inputs = None

    def encode_images(self, images):
        return F.normalize(self.norm(self.image(images.flatten(1))), dim=-1)

    def encode_texts(self, input_ids, attention_mask):
        states = self.text(input_ids) + self.pos_embed[:, : input_ids.shape[1]]
        pooled = (states * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
        return F.normalize(pooled, dim=-1)

    def training_step(self, batch, batch_idx):
        return info_nce(
            self.encode_images(batch["images"]),
            self.encode_texts(batch["input_ids"][:, 0], batch["attention_mask"][:, 0]),
            self.temperature(),
        )

    def image_cache(self, images):
        return images.flatten(1)

    def text_cache(self, input_ids, attention_mask):
        return {"ids": input_ids, "mask": attention_mask}

    def reranker(self, image_emb_cache, text_cache):
        self.rerank_inputs = (image_emb_cache, text_cache)
        return "scorer"


class ToyData(L.LightningDataModule):
    """6 images with 2 captions each; the image loader repeats image 0 at the end, as a distributed
    sampler pads its last batch."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(N_IMAGES, 3, 8, 8, generator=generator)
        self.ids = torch.randint(
            4, VOCAB, (N_IMAGES * CAPTIONS_PER_IMAGE, LENGTH), generator=generator
        )
        self.ids[:, -1] = 0
        self.caption_image = torch.arange(N_IMAGES).repeat_interleave(CAPTIONS_PER_IMAGE)
        self.info = ToyInfo(languages=["en", "de"])

    def train_dataloader(self):
        batch = {
            "images": self.images,
            "input_ids": self.ids[::2, None],
            "attention_mask": (self.ids[::2, None] != 0).long(),
            "present": torch.ones(N_IMAGES, 1, dtype=torch.bool),
            "languages": ["en"],
            "ids": list("abcdef"),
        }
        return DataLoader([batch] * 4, batch_size=None)

    def val_dataloader(self):
        padded = list(range(N_IMAGES)) + [0]
        images = [{"images": self.images[i], "index": torch.tensor(i)} for i in padded]
        captions = [
            {
                "input_ids": self.ids[i],
                "attention_mask": (self.ids[i] != 0).long(),
                "index": torch.tensor(i),
            }
            for i in range(len(self.ids))
        ]
        return [DataLoader(images, batch_size=4), DataLoader(captions, batch_size=5)]

    test_dataloader = val_dataloader

    def eval_view(self, split):
        return SimpleNamespace(
            image_ids=[f"img{i}" for i in range(N_IMAGES)],
            caption_image=self.caption_image,
            caption_language=["en", "de"] * N_IMAGES,
            languages=["en", "de"],
            relevance=None,
            mrv_languages=None,
        )


def _module(rerank_k=0, cls=None, **evaluation_keys):
    evaluation = OmegaConf.create(
        {
            "ks": [1, 5],
            "ndcg_k": 10,
            "unimodal_ndcg_ks": [10, 20],
            "chunk_size": 64,
            "batch_size": 4,
            "rerank_k": rerank_k,
            **evaluation_keys,
        }
    )
    return (cls or ToyMethod)(
        OmegaConf.create({"name": "toy"}), OPTIM, ToyInfo(languages=["en", "de"]), evaluation
    )


class PixelTokenScorer:
    """A toy cross-encoder: the image's first pixel times the caption's first token id."""

    device = torch.device("cpu")

    def __init__(self, pixels, ids):
        self.pixels, self.ids = pixels, ids

    def captions(self, index):
        return self.ids[index, 0].float()

    def score(self, images, block, rows):
        return self.pixels[images, 0] * block[rows]


class ToyCrossEncoder(ToyMethod):
    own_embeddings = False  # e.g. RC3, whose embeddings are a first-stage probe's

    def cross_encoder(self, image_cache, text_cache):
        return PixelTokenScorer(image_cache, text_cache["ids"])


class GradedToyData(ToyData):
    def eval_view(self, split):
        view = super().eval_view(split)
        view.relevance = torch.eye(N_IMAGES)
        return view


def _trainer(**kwargs):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


@pytest.fixture
def fake_report(monkeypatch):
    calls = []

    def report(image_emb, text_emb, caption_image, caption_language, image_ids, **kwargs):
        calls.append(
            dict(image_emb=image_emb, text_emb=text_emb, caption_image=caption_image, **kwargs)
        )
        return {"mR": 42.0, "en/i2t/R@1": 50.0}

    monkeypatch.setattr(metrics.evaluation, "retrieval_report", report)
    return calls


def test_param_groups_skip_decay_on_norms_biases_positions_and_temperature():
    module = _module()
    groups = param_groups(module, weight_decay=0.1, lr=1e-3, lr_scales={"temperature": 2.0})
    by_param = {id(p): g for g in groups for p in g["params"]}
    named = dict(module.named_parameters())
    for name in ("image.weight", "text.weight"):
        assert by_param[id(named[name])]["weight_decay"] == 0.1, name
    for name in ("image.bias", "norm.weight", "norm.bias", "pos_embed"):
        assert by_param[id(named[name])]["weight_decay"] == 0.0, name
    assert by_param[id(named["temperature.log_tau"])] == {
        "params": [named["temperature.log_tau"]],
        "weight_decay": 0.0,
        "lr": 2e-3,
    }
    assert sum(len(g["params"]) for g in groups) == len(named)


def test_warmup_cosine_schedule_values():
    def factor(step):
        return warmup_cosine(step, warmup_steps=4, total_steps=104, min_lr_ratio=0.01)

    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == 1.0
    assert factor(54) == pytest.approx(0.505)
    assert factor(4 + 25) == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert factor(104) == pytest.approx(0.01) and factor(500) == pytest.approx(0.01)


def test_bf16_mixed_training_step_on_cpu_steps_the_schedule(tmp_path):
    module = _module()
    before = module.image.weight.detach().clone()
    trainer = _trainer(precision="bf16-mixed", max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=ToyData())
    assert trainer.global_step == 1
    assert not torch.equal(before, module.image.weight)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    lrs = sorted({g["lr"] for g in trainer.optimizers[0].param_groups})
    assert lrs == pytest.approx([1e-3 * warmup_cosine(1, 4, 1, 0.01)])
    trainer.save_checkpoint(tmp_path / "toy.ckpt")
    restored = ToyMethod.load_from_checkpoint(tmp_path / "toy.ckpt")
    assert restored.data_info.languages == ["en", "de"]
    torch.testing.assert_close(restored.image.weight, module.image.weight)


def test_evaluation_places_embeddings_by_index_and_logs_every_metric(fake_report):
    module, data = _module(), ToyData()
    trainer = _trainer()
    logged = trainer.validate(module, datamodule=data, verbose=False)[0]
    (call,) = fake_report
    with torch.no_grad():
        torch.testing.assert_close(call["image_emb"], module.encode_images(data.images))
        torch.testing.assert_close(
            call["text_emb"], module.encode_texts(data.ids, (data.ids != 0).long())
        )
    assert call["image_emb"].shape == (N_IMAGES, 16) and call["text_emb"].shape == (12, 16)
    assert torch.equal(call["caption_image"], data.caption_image)
    assert call["ks"] == (1, 5) and call["rerank_k"] == 0 and call["reranker"] is None
    assert logged == {"val/mR": 42.0, "val/en/i2t/R@1": 50.0}
    assert module.last_report == {"mR": 42.0, "en/i2t/R@1": 50.0}
    trainer.test(module, datamodule=data, verbose=False)
    assert set(trainer.callback_metrics) >= {"test/mR", "test/en/i2t/R@1"}


def test_reranking_receives_index_ordered_caches(fake_report):
    module, data = _module(rerank_k=3), ToyData()
    _trainer().validate(module, datamodule=data, verbose=False)
    image_cache, text_cache = module.rerank_inputs
    torch.testing.assert_close(image_cache, data.images.flatten(1))
    assert torch.equal(text_cache["ids"], data.ids)
    assert fake_report[0]["reranker"] == "scorer" and fake_report[0]["rerank_k"] == 3


def test_cross_encoder_scorer_hands_the_report_every_pair_scored_by_the_method(fake_report):
    module, data = (
        _module(cls=ToyCrossEncoder, scorer="cross_encoder", pair_batch_size=5, caption_chunk=3),
        GradedToyData(),
    )
    _trainer().validate(module, datamodule=data, verbose=False)
    module.eval_cfg.scorer = (
        "embeddings"  # the same method ranking by its embeddings reports i2i/t2t
    )
    _trainer().validate(module, datamodule=data, verbose=False)
    call, by_embeddings = fake_report
    expected = (
        data.images.flatten(1)[:, :1] * data.ids[:, 0].float()[None, :]
    )  # [6 images, 12 captions]
    assert torch.equal(call["pair_scores"], expected)
    assert call["reranker"] is None and call["rerank_k"] == 0
    assert (
        call["image_relevance"] is None
    )  # the embeddings are not the method's own: no uni-modal NDCG
    assert by_embeddings["pair_scores"] is None and by_embeddings["image_relevance"] is not None


def test_cross_encoder_scorer_needs_a_method_with_one_and_no_rerank_k():
    with pytest.raises(
        ValueError, match="evaluation.scorer=cross_encoder: ToyMethod has no cross-encoder"
    ):
        _module(scorer="cross_encoder")
    with pytest.raises(
        ValueError, match="scores every pair, leaving nothing to re-rank: set evaluation.rerank_k=0"
    ):
        _module(rerank_k=3, cls=ToyCrossEncoder, scorer="cross_encoder")


def test_evaluation_fails_when_an_item_was_never_encoded(fake_report):
    class MissingCaption(ToyData):
        def val_dataloader(self):
            images, captions = super().val_dataloader()
            return [images, DataLoader(list(captions.dataset)[:-1], batch_size=5)]

    with pytest.raises(RuntimeError, match="val evaluation: 1 of 12 captions were never encoded"):
        _trainer().validate(_module(), datamodule=MissingCaption(), verbose=False)


def test_default_pipeline_is_one_main_stage():
    info = ToyInfo(languages=["en"])
    evaluation = OmegaConf.create({"rerank_k": 0})
    (stage,) = ToyMethod.pipeline(OmegaConf.create({"name": "toy"}), OPTIM, info, evaluation)
    assert isinstance(stage, Stage) and stage.name == "main" and stage.max_steps is None
    assert isinstance(stage.build(None), ToyMethod)
    data = ToyData()
    data.train_dataloader = lambda: "the training loader"
    assert stage.dataloader(data) == "the training loader"


def test_evaluation_with_the_real_report_logs_every_key():
    module, data = _module(), ToyData()
    logged = _trainer().validate(module, datamodule=data, verbose=False)[0]
    with torch.no_grad():
        expected = metrics.retrieval_report(
            module.encode_images(data.images),
            module.encode_texts(data.ids, (data.ids != 0).long()),
            data.caption_image,
            ["en", "de"] * N_IMAGES,
            [f"img{i}" for i in range(N_IMAGES)],
            ks=(1, 5),
            chunk_size=64,
        )
    assert {"mR", "en/i2t/R@1", "de/t2i/R@5"} <= set(expected)
    assert module.last_report == pytest.approx(expected, nan_ok=True)
    assert logged == pytest.approx({f"val/{k}": v for k, v in expected.items()}, nan_ok=True)


def test_every_evaluation_encoder_call_has_its_loaders_batch_shape(fake_report):
    """CPU kernels round differently for different batch shapes (1e-7 on a projection head), and a
    DDP run's shards end in other short batches than one process's loader does; near-tied t2t
    scores then reordered, so a DDP run's scores differed from re-scoring its checkpoint. A short
    batch is filled up to its loader's batch size, and only its own rows are kept."""

    class ShapeSensitive(ToyMethod):
        def encode_images(self, images):
            self.calls.append(("images", len(images)))
            return super().encode_images(images) + len(images)  # a rounding that follows the shape

        def encode_texts(self, input_ids, attention_mask):
            self.calls.append(("captions", len(input_ids)))
            return super().encode_texts(input_ids, attention_mask) + len(input_ids)

    module, data = _module(), ToyData()
    module.__class__, module.calls = ShapeSensitive, []
    _trainer().validate(module, datamodule=data, verbose=False)
    assert set(module.calls) == {("images", 4), ("captions", 5)}
    (call,) = fake_report
    with torch.no_grad():
        torch.testing.assert_close(
            call["image_emb"], ToyMethod.encode_images(module, data.images) + 4
        )
        torch.testing.assert_close(
            call["text_emb"], ToyMethod.encode_texts(module, data.ids, (data.ids != 0).long()) + 5
        )


def test_a_last_stage_that_builds_no_retrieval_module_is_an_error_naming_it():
    from ccr.experiments.train import last_report

    stage = Stage(
        "translate", build=lambda previous: L.LightningModule(), dataloader=lambda dm: None
    )
    with pytest.raises(
        TypeError, match="stage 'translate' built a LightningModule; the last stage must"
    ):
        last_report(stage.build(None), stage)
