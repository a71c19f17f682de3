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
from methods.layers.optim import param_groups, warmup_cosine

if TYPE_CHECKING:
    from datamodules.datamodule import CCRDataModule

IMAGES, CAPTIONS = 0, 1  # evaluation dataloader indices: [image_loader, caption_loader]


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
        self._eval_outputs: dict[int, list[tuple[Tensor, Tensor, Any]]] = {}
        self._last_batch_end: float | None = None

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
        schedule = partial(
            warmup_cosine,
            warmup_steps=cfg.warmup_steps,
            total_steps=int(self.trainer.estimated_stepping_batches),
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
        self._eval_outputs = {IMAGES: [], CAPTIONS: []}

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        rerank = self.eval_cfg.rerank_k > 0
        if dataloader_idx == IMAGES:
            emb = self.encode_images(batch["images"])
            cache = self.image_cache(batch["images"]) if rerank else None
        else:
            emb = self.encode_texts(batch["input_ids"], batch["attention_mask"])
            cache = self.text_cache(batch["input_ids"], batch["attention_mask"]) if rerank else None
        self._eval_outputs[dataloader_idx].append((batch["index"], emb.float(), cache))

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        self._report("val")

    def on_test_epoch_end(self) -> None:
        self._report("test")

    def _report(self, split: str) -> None:
        if self.trainer.sanity_checking:
            return
        view = self.trainer.datamodule.eval_view(split)
        image_emb, image_cache = self._collect(IMAGES, len(view.image_ids), split)
        text_emb, text_cache = self._collect(CAPTIONS, len(view.caption_image), split)
        rerank_k = self.eval_cfg.rerank_k
        reranker = self.reranker(image_cache, text_cache) if rerank_k > 0 else None
        report = metrics.retrieval_report(
            image_emb,
            text_emb,
            view.caption_image.to(image_emb.device),
            view.caption_language,
            view.image_ids,
            ks=tuple(self.eval_cfg.ks),
            ndcg_k=self.eval_cfg.ndcg_k,
            chunk_size=self.eval_cfg.chunk_size,
            reranker=reranker,
            rerank_k=rerank_k if reranker is not None else 0,
            image_relevance=view.relevance,
        )
        self.last_report = {key: float(value) for key, value in report.items()}
        self.log_dict({f"{split}/{key}": value for key, value in self.last_report.items()})
        self._eval_outputs = {}

    def _collect(self, loader: int, count: int, split: str):
        """Index-ordered embeddings (and caches) of one eval loader, gathered from every
        process; the duplicates a distributed sampler pads with are dropped, a missing item is an
        error."""
        outputs = self._eval_outputs[loader]
        what = "images" if loader == IMAGES else "captions"
        if not outputs:
            raise RuntimeError(
                f"{split} evaluation produced no {what} (is the {what} loader empty?)"
            )
        index = self._gather(torch.cat([o[0] for o in outputs]))
        if int(index.max()) >= count:
            raise RuntimeError(
                f"{split} evaluation: {what} index {int(index.max())} out of range ({count} {what})"
            )
        emb = _place(index, self._gather(torch.cat([o[1] for o in outputs])), count)
        missing = count - torch.unique(index).numel()
        if missing:
            raise RuntimeError(
                f"{split} evaluation: {missing} of {count} {what} were never encoded"
            )
        caches = [o[2] for o in outputs]
        if caches[0] is None:
            return emb, None
        if isinstance(caches[0], Mapping):
            return emb, {
                key: _place(index, self._gather(torch.cat([c[key] for c in caches])), count)
                for key in caches[0]
            }
        return emb, _place(index, self._gather(torch.cat(caches)), count)

    def _gather(self, tensor: Tensor) -> Tensor:
        """Concatenate a per-process tensor over processes (every process holds the same count)."""
        if self.trainer.world_size == 1:
            return tensor
        return self.all_gather(tensor).flatten(0, 1)


def _plain(config: Any) -> dict:
    """A config (DictConfig, dict, or DataInfo as a dataclass or namespace) as a plain dict."""
    if is_dataclass(config):
        return asdict(config)
    if isinstance(config, SimpleNamespace):
        return dict(vars(config))
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return dict(config)


def _place(index: Tensor, values: Tensor, count: int) -> Tensor:
    """Rows of ``values`` put at their ``index`` (duplicates carry equal values)."""
    placed = values.new_zeros((count, *values.shape[1:]))
    placed[index] = values
    return placed


def _batch_size(batch: dict) -> int:
    """Number of instances in a training batch (the leading size of its first tensor)."""
    return next(value.shape[0] for value in batch.values() if isinstance(value, Tensor))
