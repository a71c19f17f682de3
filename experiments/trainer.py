"""Build the Lightning ``Trainer`` of a run from its ``trainer`` preset, and measure throughput."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig


class Throughput(Callback):
    """Training samples per second, timed over the optimisation steps only (no validation)."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds += time.perf_counter() - self._start
        first_tensor = next(v for v in batch.values() if hasattr(v, "shape"))
        self.samples += first_tensor.shape[0]

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


def configure_threads(cfg: DictConfig) -> None:
    """Apply the preset's torch intra-op thread count (CPU runs), if it sets one."""
    if cfg.trainer.cpu_threads:
        torch.set_num_threads(int(cfg.trainer.cpu_threads))


def build_trainer(
    cfg: DictConfig, run_dir: Path, checkpoint_dir: Path, max_steps: int | None = None,
    callbacks: list[Callback] = (),
) -> L.Trainer:
    """A Trainer that logs to TensorBoard and CSV in ``run_dir`` and checkpoints to ``checkpoint_dir``."""
    t = cfg.trainer
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir, save_last=True, save_top_k=0,
        every_n_train_steps=max(1, t.checkpoint_every_n_steps),
    )
    loggers = [
        TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version=checkpoint_dir.name),
        CSVLogger(save_dir=str(run_dir), name="csv", version=checkpoint_dir.name),
    ]
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=t.strategy,
        precision=t.precision,
        max_steps=max_steps if max_steps is not None else t.max_steps,
        max_epochs=t.max_epochs,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches,
        num_sanity_val_steps=0,
        logger=loggers,
        callbacks=[checkpoint, TQDMProgressBar(refresh_rate=t.progress_refresh_rate), *callbacks],
        default_root_dir=str(run_dir),
        deterministic=False,
        enable_model_summary=False,
    )
