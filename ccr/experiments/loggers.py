"""Experiment loggers as a config choice: ``trainer.logger`` lists them (default TensorBoard and
CSV, written into the run folder); Weights & Biases and MLflow are optional extras
(``pip install 'ccr-suite[wandb]'`` / ``'ccr-suite[mlflow]'``)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from omegaconf import DictConfig

from ccr.experiments.config import ConfigError, method_label

PACKAGES = {"tensorboard": "tensorboard", "csv": None, "wandb": "wandb", "mlflow": "mlflow"}


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """A failed write (a full disk) names ``path``: a write error carries no file name, and
    Lightning's TensorBoard logger reports any failure as a value it cannot log."""
    try:
        yield
    except (OSError, ValueError) as err:
        cause = err if isinstance(err, OSError) else err.__cause__
        if isinstance(cause, OSError) and cause.filename is None:
            raise OSError(cause.errno, cause.strerror, path) from err
        raise


class _TensorBoardLogger(TensorBoardLogger):
    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        with _naming(self.log_dir):
            super().log_metrics(metrics, step)

    def save(self) -> None:
        with _naming(self.log_dir):
            super().save()


class _CSVLogger(CSVLogger):
    def save(self) -> None:
        with _naming(self.experiment.metrics_file_path):
            super().save()


def check_loggers(cfg: DictConfig) -> list[str]:
    """The configured logger names; an unknown one or a missing optional package is a one-line
    error naming the key (before anything runs)."""
    names = [str(n) for n in cfg.trainer.logger]
    for name in names:
        if name not in PACKAGES:
            raise ConfigError(
                f"trainer.logger: unknown logger '{name}'; choose from {list(PACKAGES)}"
            )
        package = PACKAGES[name]
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"trainer.logger: '{name}' needs the {package} package: "
                f"pip install 'ccr-suite[{name}]' (or {package})"
            )
    return names


def build_loggers(cfg: DictConfig, run_dir: Path, version: str, flush_every: int) -> list[Logger]:
    """One Lightning logger per configured name. TensorBoard and CSV write under ``run_dir``;
    W&B names the run ``<data>/<method>/<run folder>/<version>`` in project ``$WANDB_PROJECT``
    (default ccr-suite); MLflow logs to ``$MLFLOW_TRACKING_URI`` (default ``run_dir/mlruns``)."""
    name = f"{cfg.preset.data}/{method_label(cfg)}/{run_dir.name}/{version}"
    loggers: list[Logger] = []
    for kind in check_loggers(cfg):
        if kind == "tensorboard":
            loggers.append(
                _TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version=version)
            )
        elif kind == "csv":
            loggers.append(
                _CSVLogger(
                    save_dir=str(run_dir),
                    name="csv",
                    version=version,
                    flush_logs_every_n_steps=flush_every,
                )
            )
        elif kind == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            loggers.append(
                WandbLogger(
                    name=name,
                    save_dir=str(run_dir),
                    project=os.environ.get("WANDB_PROJECT", "ccr-suite"),
                )
            )
        else:
            from lightning.pytorch.loggers import MLFlowLogger

            uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
            loggers.append(
                MLFlowLogger(experiment_name="ccr-suite", run_name=name, tracking_uri=uri)
            )
    return loggers
