"""Model selection on the val split (``evaluation.select_on``).

Papers that fine-tune (RC3 on Flickr30K, spec §5) test the step that scored best on the dev
split, not the last one. With ``evaluation.select_on=<report key>`` (``en/mR``: English mean
recall) the final stage keeps the weights of its best validation (higher is better) next to its
checkpoints, and those weights become the stage's ``done.ckpt``: the test, a later re-evaluation
and the leaderboard all score the selected step. Which step won, and its score, go into
``selected.json`` beside it and then into ``metrics.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from experiments.config import ConfigError
from experiments.runs import load_checkpoint, write_atomic

SELECTED = "selected"  # selected.ckpt (weights of the best validation) and selected.json


def selection_checkpoint(cfg: DictConfig, checkpoint_dir: Path) -> ModelCheckpoint | None:
    """The callback that keeps the best-scoring validation's weights, or None without selection."""
    key = cfg.evaluation.select_on
    if key is None:
        return None
    return ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename=SELECTED,
        monitor=f"val/{key}",
        mode="max",
        save_top_k=1,
        save_weights_only=True,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )


def check_selection(cfg: DictConfig, final_loader: DataLoader, final_steps: int) -> None:
    """Before anything trains: selection needs a val split, and a final stage that validates."""
    key = cfg.evaluation.select_on
    if key is None:
        return
    if cfg.data.splits.get("val") is None:
        raise ConfigError(
            f"evaluation.select_on={key} selects on the val split, but data.splits.val is null"
        )
    if cfg.trainer.val_check_interval is not None:
        return
    every = cfg.trainer.check_val_every_n_epoch
    epochs = final_steps * cfg.trainer.accumulate_grad_batches // len(final_loader)
    if every is None or epochs < every:
        raise ConfigError(
            f"evaluation.select_on={key}: the final stage trains {final_steps} steps, "
            f"{epochs} full epoch(s) of {len(final_loader)} batches, and validates every "
            f"{every} epoch(s), so it would never validate; set trainer.val_check_interval "
            "(steps) or a smaller trainer.check_val_every_n_epoch"
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
