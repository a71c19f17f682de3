"""Train a registered method and evaluate it on the test split.

    python -m experiments.train method=ccrk data=synthetic trainer=cpu seed=1 optim.lr=5e-4

Runs the method's stages in order (one, for most methods), resumes with ``ckpt_path=last``, and
writes ``runs/<data>/<method>/<run_id>/metrics.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

import lightning as L
import torch
from omegaconf import DictConfig

import methods
from datamodules.datamodule import CCRDataModule
from experiments.config import ConfigError, compose
from experiments.runs import resolve_run_dir, resume_checkpoint, save_config, write_metrics
from experiments.trainer import Throughput, build_trainer, configure_threads
from methods.layers.base import Stage

DONE = "done.ckpt"


class StageData(L.LightningDataModule):
    """The run's datamodule, with the training loader a stage asks for (e.g. parallel text)."""

    def __init__(self, data: CCRDataModule, stage: Stage) -> None:
        super().__init__()
        self.data, self.stage = data, stage

    def train_dataloader(self):
        return self.stage.dataloader(self.data)

    def val_dataloader(self):
        return self.data.val_dataloader()

    def test_dataloader(self):
        return self.data.test_dataloader()

    def eval_view(self, split: str):
        return self.data.eval_view(split)


def build_datamodule(cfg: DictConfig) -> CCRDataModule:
    data = CCRDataModule(cfg.data, seed=cfg.seed)
    data.prepare_data()
    data.setup("fit")
    return data


def stages_of(cfg: DictConfig, data: CCRDataModule) -> list[Stage]:
    method_cls = methods.get(cfg.method.name)
    return method_cls.pipeline(cfg.method, cfg.optim, data.info, cfg.evaluation)


def checkpoint_dir(run_dir: Path, stages: Sequence[Stage], stage: Stage) -> Path:
    return run_dir / "checkpoints" if len(stages) == 1 else run_dir / "stages" / stage.name


def train(cfg: DictConfig) -> Path:
    """Run every stage, evaluate the last one on test, and return the run folder."""
    L.seed_everything(cfg.seed, workers=True)
    configure_threads(cfg)
    run_dir = resolve_run_dir(cfg)
    save_config(cfg, run_dir)
    data = build_datamodule(cfg)
    stages = stages_of(cfg, data)
    started = time.perf_counter()
    throughput = Throughput()
    previous: Path | None = None
    steps = 0
    resumed_from = None
    for stage in stages:
        folder = checkpoint_dir(run_dir, stages, stage)
        module = stage.build(previous)
        done = folder / DONE
        if done.exists():  # finished before an interruption: reuse it, do not retrain
            module.load_state_dict(torch.load(done, map_location="cpu", weights_only=False)["state_dict"])
            previous = done
            continue
        trainer = build_trainer(cfg, run_dir, folder, stage.max_steps, callbacks=[throughput])
        resume = resume_checkpoint(folder, cfg.ckpt_path)
        if resume is not None and resumed_from is None:
            resumed_from = torch.load(resume, map_location="cpu", weights_only=False)["global_step"]
        trainer.fit(module, datamodule=StageData(data, stage), ckpt_path=resume)
        trainer.save_checkpoint(done)
        steps += trainer.global_step
        previous = done
    trainer = build_trainer(cfg, run_dir, run_dir / "eval", callbacks=[])
    trainer.test(module, datamodule=StageData(data, stages[-1]), verbose=False)
    if trainer.is_global_zero:
        write_metrics(
            run_dir / "metrics.json", cfg, module.last_report,
            split="test", run_id=run_dir.name, checkpoint=str(previous),
            wall_time_s=round(time.perf_counter() - started, 1),
            train_samples_per_s=round(throughput.samples_per_second, 1),
            train_steps=steps,
            resumed_from_step=resumed_from,
        )
        print(f"metrics: {run_dir / 'metrics.json'}  mR={module.last_report['mR']:.2f}")
    return run_dir


def main(argv: Sequence[str] | None = None) -> None:
    try:
        cfg = compose(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    train(cfg)


if __name__ == "__main__":
    main()
