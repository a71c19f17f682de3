"""Model selection on the val split (``evaluation.select_on``).

Papers that fine-tune (RC3 on Flickr30K, spec §5) test the step that scored best on the dev
split, not the last one. With ``evaluation.select_on=<report key>`` (``en/mR``: English mean
recall) the final stage keeps the weights of its best validation (the key says which way is
better: higher recall, lower MeanR) next to its checkpoints, and those weights become the
stage's ``done.ckpt``: the test, a later re-evaluation and the leaderboard all score the
selected step. Which step won, and its score, go into
``selected.json`` beside it and then into ``metrics.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig
from torch.utils.data import DataLoader, IterableDataset

from ccr import metrics
from ccr.experiments.config import ConfigError
from ccr.experiments.runs import load_checkpoint, write_atomic
from ccr.experiments.trainer import process_count

SELECTED = "selected"  # selected.ckpt (weights of the best validation) and selected.json


def selection_checkpoint(cfg: DictConfig, checkpoint_dir: Path) -> ModelCheckpoint | None:
    """The callback that keeps the best-scoring validation's weights (the highest recall, NDCG
    or MRR; the lowest MeanR, MedR or MRV), or None without selection."""
    key = cfg.evaluation.select_on
    if key is None:
        return None
    return ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename=SELECTED,
        monitor=f"val/{key}",
        mode=metrics.better_direction(key),
        save_top_k=1,
        save_weights_only=True,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )


def validation_steps(
    batches_per_epoch: int,
    steps: int,
    *,
    accumulate: int = 1,
    every_n_epochs: int | None = 1,
    interval: int | float | None = None,
) -> list[int]:
    """The optimiser steps after which Lightning validates a stage of ``steps`` steps over epochs
    of ``batches_per_epoch`` batches: in every ``every_n_epochs``-th epoch (None: every epoch,
    counting ``interval`` batches across epochs), after every ``interval`` batches (an int), a
    fraction of the epoch's batches (a float), or at its end (None)."""
    if batches_per_epoch < 1 or (every_n_epochs is None and not isinstance(interval, int)):
        return []  # no training batch, or a schedule Lightning refuses itself
    within = (
        interval
        if isinstance(interval, int)
        else max(1, int(batches_per_epoch * (1.0 if interval is None else interval)))
    )
    found, step, batch = [], 0, 0
    while step < steps:
        epoch, in_epoch = divmod(batch, batches_per_epoch)
        batch += 1
        if (in_epoch + 1) % accumulate == 0 or in_epoch + 1 == batches_per_epoch:
            step += 1  # an optimiser step (the last batch of an epoch always steps)
        if every_n_epochs is None:
            due = batch % within == 0
        else:
            due = (epoch + 1) % every_n_epochs == 0 and (in_epoch + 1) % within == 0
        if due:
            found.append(step)
    return found


def batches_per_process(loader: DataLoader, processes: int) -> int:
    """Training batches each of ``processes`` processes sees per epoch. Lightning deals a map-style
    dataset out with a DistributedSampler (ceil(N / processes) items each, batched as the loader
    batches); a stream splits its batches over the ranks itself, the same number on each."""
    if processes == 1:
        return len(loader)
    if isinstance(loader.dataset, IterableDataset):
        return len(loader) // processes
    if loader.batch_size is None:  # a batch sampler: Lightning deals out its batches
        return math.ceil(len(loader) / processes)
    items = math.ceil(len(loader.dataset) / processes)  # type: ignore[arg-type]
    return items // loader.batch_size if loader.drop_last else math.ceil(items / loader.batch_size)


def check_selection(
    cfg: DictConfig, final_loader: DataLoader, final_steps: int, val_languages: list[str]
) -> None:
    """Before anything trains: the final stage validates at least once, and the val split has
    the language ``evaluation.select_on`` names (the key itself is checked at composition)."""
    key = cfg.evaluation.select_on
    if key is None:
        return
    language = key.split("/", 1)[0]
    if "/" in key and language not in ("all", "i2i", "t2t") and language not in val_languages:
        raise ConfigError(
            f"evaluation.select_on={key}: the val split ({cfg.data.splits.val}) "
            f"has no {language!r} captions; it has {', '.join(val_languages)}"
        )
    t = cfg.trainer
    processes = process_count(cfg)
    batches = batches_per_process(final_loader, processes)
    if validation_steps(
        batches,
        final_steps,
        accumulate=t.accumulate_grad_batches,
        every_n_epochs=t.check_val_every_n_epoch,
        interval=t.val_check_interval,
    ):
        return
    share = " per process" if processes > 1 else ""
    raise ConfigError(
        f"evaluation.select_on={key}: the final stage trains {final_steps} steps over epochs of "
        f"{batches} batches{share}, and with trainer.check_val_every_n_epoch="
        f"{t.check_val_every_n_epoch} and trainer.val_check_interval={t.val_check_interval} it "
        "would never validate; set a smaller trainer.check_val_every_n_epoch, or "
        "trainer.val_check_interval (batches) with trainer.check_val_every_n_epoch=null"
    )


def keep_selected(callback: ModelCheckpoint, module, stage_name: str) -> dict:
    """Load the selected weights into ``module``; record and return which step won."""
    best = callback.best_model_path
    if not best or callback.best_model_score is None:
        raise RuntimeError(
            f"stage '{stage_name}' never validated on {callback.monitor}: nothing to select"
        )
    score = float(callback.best_model_score)
    if not math.isfinite(score):
        raise RuntimeError(f"stage '{stage_name}': the best {callback.monitor} is {score}")
    checkpoint = load_checkpoint(best)
    module.load_state_dict(checkpoint["state_dict"])
    selected = {"metric": callback.monitor, "score": score, "step": int(checkpoint["global_step"])}
    write_atomic(Path(best).with_suffix(".json"), json.dumps(selected, indent=1) + "\n")
    return selected


def recorded_selection(checkpoint_dir: Path) -> dict | None:
    """What :func:`keep_selected` recorded for a stage finished before an interruption."""
    path = checkpoint_dir / f"{SELECTED}.json"
    return json.loads(path.read_text()) if path.exists() else None
