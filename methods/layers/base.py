"""The LightningModule every method extends: evaluation loop, optimizer and schedule, train logging.

A method implements ``encode_images``, ``encode_texts`` and ``training_step``; optionally
``reranker`` (with ``image_cache``/``text_cache`` to keep what it needs per item), ``lr_scales`` and
``pipeline`` (several training stages).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, is_dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Mapping

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

import metrics
from methods.layers.batches import fill_rows, first_rows
from methods.layers.optim import SCHEDULES, param_groups, warmup_step_count

if TYPE_CHECKING:
    from datamodules.datamodule import CCRDataModule

EVAL_SIDES = ("images", "captions")  # evaluation dataloaders, in order: [image_loader, caption_loader]


@dataclass
class Stage:
    """One training stage: how to build its module (from the previous stage's checkpoint, None for
    the first), which loader trains it, and an optional step budget (None: the trainer preset's)
    with the config key that sets it (shown to the user, e.g. ``method.trikd.max_steps``)."""

    name: str
    build: Callable[[Path | None], L.LightningModule]
    dataloader: Callable[["CCRDataModule"], DataLoader]
    max_steps: int | None = None
    budget_key: str | None = None


class RetrievalModule(L.LightningModule):
    """Base of every retrieval method; see ``docs/interfaces.md`` ("Methods").

    Subclasses read their settings from ``self.method_cfg``, ``self.optim_cfg``, ``self.eval_cfg``
    (DictConfig) and ``self.data_info`` rather than the raw arguments: a checkpoint rebuilds the
    module from plain dicts, which the base normalises.
    """

    def __init__(self, method, optim, data, evaluation):
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
        self.last_report: dict[str, float] | None = None
        self.evaluation: metrics.RetrievalEvaluation | None = None  # one per evaluation epoch
        self._last_batch_end: float | None = None
        self.eval_batch: dict | None = None  # the evaluation batch being encoded (None outside)

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

    def reranker(self, image_emb_cache, text_cache) -> metrics.Reranker | None:
        """A scorer for each query's top-k candidates, built from the evaluated set's caches
        (index-ordered, as returned by ``image_cache``/``text_cache``); None: no re-ranking."""
        return None

    def lr_scales(self) -> dict[str, float]:
        """Learning-rate multipliers by parameter-name prefix (e.g. new heads at 2x)."""
        return {}

    @classmethod
    def check_config(cls, method, languages: list[str]) -> None:
        """Raise ``ValueError`` for a setting that cannot run, judged from the method's config
        and the run's ``data.languages`` alone: called before any data is read. Default: none."""

    @classmethod
    def pipeline(cls, method, optim, data, evaluation) -> list[Stage]:
        """Default: one stage, 'main', building ``cls(...)`` and training on the training loader."""
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

    def on_validation_epoch_start(self) -> None:
        self.evaluation = metrics.RetrievalEvaluation.from_config(self.eval_cfg)

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Encode one batch of the image or caption loader into ``self.evaluation`` by index.

        A short batch is filled up to its loader's batch size with copies of its first row, whose
        outputs are dropped: CPU kernels round differently for different shapes, and a DDP run's
        shards end in other short batches than one process does, so without one shape an item's
        embedding (and near-tied rankings) would depend on how the set was sharded.
        ``self.eval_batch`` holds the whole filled batch while it is encoded, for methods whose
        encoding depends on the item (its ``index``, e.g. for its language) or reads more than
        images or captions (e.g. an image's shipped ``roi_features``)."""
        rerank = self.eval_cfg.rerank_k > 0
        side = EVAL_SIDES[dataloader_idx]
        count = len(batch["index"])
        batch = fill_rows(batch, self._eval_batch_size(dataloader_idx))
        self.eval_batch = batch
        if side == "images":
            emb = self.encode_images(batch["images"])
            cache = self.image_cache(batch["images"]) if rerank else None
        else:
            emb = self.encode_texts(batch["input_ids"], batch["attention_mask"])
            cache = self.text_cache(batch["input_ids"], batch["attention_mask"]) if rerank else None
        self.eval_batch = None
        self.evaluation.update(side, batch["index"][:count], emb[:count].float(), first_rows(cache, count))

    def _eval_batch_size(self, dataloader_idx: int) -> int | None:
        loaders = self.trainer.test_dataloaders if self.trainer.testing else self.trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        return getattr(loaders[dataloader_idx], "batch_size", None)

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        self._report("val")

    def on_test_epoch_end(self) -> None:
        self._report("test")

    def _report(self, split: str) -> None:
        """Score the split from every process's rows (``metrics.RetrievalEvaluation``) and log it."""
        if self.trainer.sanity_checking:
            return
        view = self.trainer.datamodule.eval_view(split)
        try:
            report = self.evaluation.compute(
                caption_image=view.caption_image,
                caption_language=view.caption_language,
                image_ids=view.image_ids,
                image_relevance=view.relevance,
                mrv_languages=view.mrv_languages,
                build_reranker=self.reranker,
            )
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
    if is_dataclass(config):
        return asdict(config)
    if isinstance(config, SimpleNamespace):
        return dict(vars(config))
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return dict(config)


def _batch_size(batch: dict) -> int:
    """Number of instances in a training batch (the leading size of its first tensor)."""
    return next(value.shape[0] for value in batch.values() if isinstance(value, Tensor))
