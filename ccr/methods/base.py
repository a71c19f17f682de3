"""The LightningModule every method extends: evaluation loop, optimizer and schedule, train logging.

A method implements ``encode_images``, ``encode_texts`` and ``training_step``; optionally
``cross_encoder`` (with ``image_cache``/``text_cache`` to keep what it needs per item), which
evaluation runs over each query's top k (``evaluation.rerank_k``) or over every pair
(``evaluation.scorer=cross_encoder``, ``ccr/methods/layers/cross_encoder_scoring.py``), ``lr_scales``
and ``pipeline`` (several training stages). What its encoders read besides images or captions
comes in the evaluation batch (``image_inputs``, ``caption_inputs``; ``ccr/methods/encoding.py``), and
a loader besides its training batches from its stage (``Stage.extra_loaders``): a method never
reads the harness.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from ccr import metrics
from ccr.methods.encoding import CAPTIONS, IMAGES, encode_batch
from ccr.methods.layers.cross_encoder_scoring import PairScorer, TopKRescorer, score_matrix
from ccr.methods.layers.optim import SCHEDULES, param_groups, warmup_step_count

if TYPE_CHECKING:
    from ccr.datamodules.datamodule import CCRDataModule

# evaluation dataloaders, in order: [image_loader, caption_loader]
EVAL_SIDES = (IMAGES, CAPTIONS)
CROSS_ENCODER = (
    "cross_encoder"  # evaluation.scorer: every pair scored by the method's cross-encoder
)
DEFAULT_PROTOCOL = "default"  # the run's protocol for a method with one way to train


@dataclass
class Stage:
    """One training stage: how to build its module (from the previous stage's checkpoint, None for
    the first), which loader trains it, and an optional step budget (None: the trainer preset's)
    with the config key that sets it (shown to the user, e.g. ``method.trikd.max_steps``)."""

    name: str
    build: Callable[[Path | None], L.LightningModule]
    dataloader: Callable[[CCRDataModule], DataLoader]
    max_steps: int | None = None
    budget_key: str | None = None
    # Loaders the module reads besides its training batches (RC3: parallel text), by name, each a
    # factory called when first needed (inside the fit: a DDP sampler shards by the process group);
    # the training harness hands them to the built module (``RetrievalModule.attach_loaders``).
    extra_loaders: Callable[[CCRDataModule], Mapping[str, Callable[[], DataLoader]]] | None = None


class RetrievalModule(L.LightningModule):
    """Base of every retrieval method; see ``docs/interfaces.md`` ("Methods").

    Subclasses read their settings from ``self.method_cfg``, ``self.optim_cfg``, ``self.eval_cfg``
    (DictConfig) and ``self.data_info`` rather than the raw arguments: a checkpoint rebuilds the
    module from plain dicts, which the base normalises.

    A method whose training step encodes through ``ccr.methods.layers.grad_cache.encode_in_chunks``
    with ``self.grad_cache_chunks`` sets ``supports_grad_cache``; the others refuse
    ``optim.grad_cache_chunks`` > 1.
    """

    # True: the training step computes the same function of the captions (to float rounding)
    # whatever pad columns its caption batch carries, which tests/test_dynamic_padding.py checks,
    # so it may train on batches padded to their longest caption (data.pad_to_multiple). Random
    # draws shaped like the batch (dropout) then differ: such a run is another sample of the same
    # training, not a bit-for-bit repeat of a fixed-padding run. Methods not checked refuse it.
    caption_length_invariant = False
    # True: the method's encoders run micro-batch by micro-batch under optim.grad_cache_chunks.
    supports_grad_cache = False

    embedding_scorer = "itc"  # the leaderboard's name for ranking by encode_images/encode_texts
    own_embeddings = True  # False: those embeddings are a helper the method does not define

    method_name: ClassVar[str]  # the name it is registered under (``methods.register``)
    # Evaluation batch keys besides images / captions that the encoders and caches take as
    # keyword arguments, passed when a batch holds them (``ccr.methods.encoding.side_inputs``).
    image_inputs: ClassVar[tuple[str, ...]] = ()
    caption_inputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, method, optim, data, evaluation) -> None:
        super().__init__()
        # Plain containers: checkpoints load with weights_only=True and rebuild the module.
        self.save_hyperparameters(
            {
                "method": _plain(method),
                "optim": _plain(optim),
                "data": _plain(data),
                "evaluation": _plain(evaluation),
            }
        )
        self.method_cfg, self.optim_cfg, self.eval_cfg = (
            OmegaConf.create(c) for c in (method, optim, evaluation)
        )
        self.data_info = SimpleNamespace(**data) if isinstance(data, Mapping) else data
        trimmed = getattr(self.data_info, "pad_to_multiple", None)
        if trimmed and not self.caption_length_invariant:
            raise ValueError(
                f"data.pad_to_multiple={trimmed}: {type(self).__name__} is not checked to "
                "train the same on captions padded to the batch's longest (draws over "
                "token positions, fixed-length inputs); leave data.pad_to_multiple null"
            )
        self.last_report: dict[str, float] | None = None
        self.evaluation: metrics.RetrievalEvaluation | None = None  # one per evaluation epoch
        self._last_batch_end: float | None = None
        if self.grad_cache_chunks > 1 and not self.supports_grad_cache:
            raise ValueError(
                f"optim.grad_cache_chunks={self.grad_cache_chunks}: {type(self).__name__} does "
                "not encode its training batch in micro-batches; set it to 1"
            )
        if self.scores_every_pair and type(self).cross_encoder is RetrievalModule.cross_encoder:
            raise ValueError(
                f"evaluation.scorer={CROSS_ENCODER}: {type(self).__name__} has no "
                "cross-encoder to score pairs with; use evaluation.scorer=embeddings"
            )
        if self.scores_every_pair and self.eval_cfg.rerank_k > 0:
            raise ValueError(
                f"evaluation.scorer={CROSS_ENCODER} scores every pair, leaving nothing to "
                f"re-rank: set evaluation.rerank_k=0 (or evaluation.scorer=embeddings)"
            )

    @property
    def grad_cache_chunks(self) -> int:
        """Micro-batches each training batch is encoded in (``optim.grad_cache_chunks``, 1: none)."""
        return int(self.optim_cfg.get("grad_cache_chunks", 1))

    @property
    def scores_every_pair(self) -> bool:
        """Whether evaluation ranks by the cross-encoder's score of every pair."""
        return self.eval_cfg.get("scorer", "embeddings") == CROSS_ENCODER

    # ---- what a method provides ---------------------------------------------------------------

    def encode_images(self, images: Tensor) -> Tensor:
        """L2-normalised image embeddings ``[B, D]``."""
        raise NotImplementedError

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """L2-normalised text embeddings ``[N, D]``."""
        raise NotImplementedError

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        raise NotImplementedError

    def image_cache(self, images: Tensor) -> Tensor | Mapping[str, Tensor] | None:
        """Per-image tensors a reranker needs (e.g. token states), kept only when re-ranking."""
        return None

    def text_cache(
        self, input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor | Mapping[str, Tensor] | None:
        """Per-caption tensors a reranker needs, kept only when re-ranking."""
        return None

    def cross_encoder(self, image_cache, text_cache) -> PairScorer | None:
        """The method's cross-encoder over the evaluated set's caches (index-ordered, as returned
        by ``image_cache``/``text_cache``); None: it has none."""
        return None

    def reranker(self, image_cache, text_cache) -> metrics.Reranker | None:
        """Each query's top-k candidates re-scored by ``cross_encoder``; None without one."""
        scorer = self.cross_encoder(image_cache, text_cache)
        return None if scorer is None else TopKRescorer(scorer, **self._pair_chunks())

    @torch.no_grad()
    def pair_scores(self, image_cache, text_cache, num_images: int, num_captions: int) -> Tensor:
        """``[num_images, num_captions]``: ``cross_encoder``'s score of every pair."""
        scorer = self.cross_encoder(image_cache, text_cache)
        if scorer is None:
            raise ValueError(
                f"evaluation.scorer={CROSS_ENCODER}: this {type(self).__name__} has no "
                "cross-encoder (see its settings); use evaluation.scorer=embeddings"
            )
        return score_matrix(scorer, num_images, num_captions, **self._pair_chunks())

    def _pair_chunks(self) -> dict[str, int]:
        cfg = self.eval_cfg
        return {
            "caption_chunk": int(cfg.get("caption_chunk", 256)),
            "pair_batch": int(cfg.get("pair_batch_size", 512)),
        }

    def attach_loaders(self, loaders: Mapping[str, Callable[[], DataLoader]]) -> None:
        """Receive the loader factories its stage declares (``Stage.extra_loaders``) before
        training; a method whose stages declare none never gets any."""
        raise TypeError(f"{type(self).__name__} reads no loaders besides its training batches")

    def lr_scales(self) -> dict[str, float]:
        """Learning-rate multipliers by parameter-name prefix (e.g. new heads at 2x)."""
        return {}

    @classmethod
    def check_config(cls, method, languages: list[str], protocol: str = DEFAULT_PROTOCOL) -> None:
        """Raise ``ValueError`` for a setting that cannot run, judged from the method's config,
        the run's ``data.languages`` and its ``protocol`` alone: called before any data is read.
        Default: none."""

    @classmethod
    def pipeline(
        cls, method, optim, data, evaluation, protocol: str = DEFAULT_PROTOCOL
    ) -> list[Stage]:
        """The training stages for the run's ``protocol`` (which a method that trains by protocol
        reads; ``ccr/experiments/method_schema.py``). Default: one stage, 'main', building
        ``cls(...)`` and training on the training loader."""
        return [
            Stage(
                "main",
                build=lambda previous: cls(method, optim, data, evaluation),
                dataloader=lambda datamodule: datamodule.train_dataloader(),
            )
        ]

    # ---- optimizer and schedule ---------------------------------------------------------------

    def configure_optimizers(self):
        cfg = self.optim_cfg
        optimizer = AdamW(
            param_groups(self, cfg.weight_decay, cfg.lr, self.lr_scales()),
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
        )
        total_steps = int(self.trainer.estimated_stepping_batches)
        schedule = partial(
            SCHEDULES[cfg.get("schedule", "cosine")],  # configs older than the key: cosine
            warmup_steps=warmup_step_count(total_steps, cfg.warmup_steps, cfg.get("warmup_ratio")),
            total_steps=total_steps,
            min_lr_ratio=cfg.min_lr_ratio,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    # ---- training logs ------------------------------------------------------------------------

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        """Progress-bar loss and throughput (samples/s over all processes, between batch ends)."""
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        batch_size = _batch_size(batch)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch_size)
        now = time.perf_counter()
        if self._last_batch_end is not None:
            rate = batch_size * self.trainer.world_size / max(now - self._last_batch_end, 1e-9)
            self.log("train/samples_per_s", rate, prog_bar=True, batch_size=batch_size)
        self._last_batch_end = now

    def on_train_epoch_start(self) -> None:
        self._last_batch_end = None

    # ---- evaluation ---------------------------------------------------------------------------

    @property
    def evaluation_metric(self) -> type[metrics.RetrievalEvaluation]:
        """The metric an evaluation epoch runs (a method may report more keys with a subclass)."""
        return metrics.RetrievalEvaluation

    def new_evaluation(self, truth: metrics.GroundTruth) -> metrics.RetrievalEvaluation:
        """The metric of one evaluation of the set ``truth`` describes, scoring pairs as
        ``evaluation.scorer`` and ``evaluation.rerank_k`` ask (the method's cross-encoder over
        every pair, over each query's top k, or none)."""
        if self.scores_every_pair:
            return self.evaluation_metric.from_config(
                self.eval_cfg,
                truth,
                build_pair_scores=partial(
                    self.pair_scores,
                    num_images=truth.num_images,
                    num_captions=truth.num_captions,
                ),
            )
        return self.evaluation_metric.from_config(
            self.eval_cfg, truth, build_reranker=self.reranker
        )

    def on_validation_epoch_start(self) -> None:
        self.evaluation = self.new_evaluation(self._ground_truth("val"))

    def on_test_epoch_start(self) -> None:
        self.evaluation = self.new_evaluation(self._ground_truth("test"))

    def _ground_truth(self, split: str) -> metrics.GroundTruth:
        """The evaluated split's ground truth, from the datamodule's view of it."""
        # Lightning assigns Trainer.datamodule at run time without declaring it on the class.
        view = self.trainer.datamodule.eval_view(split)  # type: ignore[attr-defined]
        return metrics.GroundTruth(
            caption_image=view.caption_image,
            caption_language=view.caption_language,
            image_ids=view.image_ids,
            # uni-modal NDCG ranks the embeddings: reported beside the cross-encoder's ranks only
            # when they are the method's own
            image_relevance=view.relevance
            if self.own_embeddings or not self.scores_every_pair
            else None,
            mrv_languages=view.mrv_languages,
        )

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Encode one batch of the image or caption loader into ``self.evaluation`` by index,
        filled up to its loader's batch size (``ccr.methods.encoding.encode_batch``)."""
        rerank = (
            self.eval_cfg.rerank_k > 0 or self.scores_every_pair
        )  # keep the cross-encoder's caches
        side = EVAL_SIDES[dataloader_idx]
        encoded = encode_batch(self, side, batch, self._eval_batch_size(dataloader_idx), rerank)
        self._current_evaluation().update(side, encoded.index, encoded.embeddings, encoded.cache)

    def _current_evaluation(self) -> metrics.RetrievalEvaluation:
        """The evaluation the epoch's start hook created; an error outside an evaluation epoch."""
        if self.evaluation is None:
            raise RuntimeError(
                "no evaluation in progress: on_validation_epoch_start or "
                "on_test_epoch_start did not run"
            )
        return self.evaluation

    def _eval_batch_size(self, dataloader_idx: int) -> int | None:
        loaders = (
            self.trainer.test_dataloaders if self.trainer.testing else self.trainer.val_dataloaders
        )
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        return getattr(loaders[dataloader_idx], "batch_size", None)

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        self._report("val")

    def on_test_epoch_end(self) -> None:
        self._report("test")

    def _report(self, split: str) -> None:
        """Log the split's report: ``compute()`` scores every process's rows (torchmetrics syncs
        them), so each process logs the same values."""
        if self.trainer.sanity_checking:
            return
        try:
            report = self._current_evaluation().compute()
        except RuntimeError as error:
            raise RuntimeError(f"{split} {error}") from error
        self.evaluation = None
        self.last_report = report
        self.log_dict({f"{split}/{key}": value for key, value in report.items()})


def load_state(path: Path) -> dict[str, Tensor]:
    """A stage checkpoint's weights (loaded weights-only: no pickled code runs)."""
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _plain(config: Any) -> dict:
    """A config (DictConfig, dict, or DataInfo as a dataclass or namespace) as a plain dict."""
    if is_dataclass(config) and not isinstance(config, type):
        return asdict(config)
    if isinstance(config, SimpleNamespace):
        return dict(vars(config))
    if isinstance(config, DictConfig):
        return cast(dict, OmegaConf.to_container(config, resolve=True))  # a mapping gives a dict
    return dict(config)


def _batch_size(batch: dict) -> int:
    """Number of instances in a training batch (the leading size of its first tensor)."""
    return next(value.shape[0] for value in batch.values() if isinstance(value, Tensor))
