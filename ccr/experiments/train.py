"""Train a registered method and evaluate it on the test split.

    python -m ccr.experiments.train method=ccrk data=synthetic trainer=cpu seed=1 optim.lr=5e-4

Runs the method's stages in order (one, for most methods), resumes an interrupted run exactly with
``run_id=<id> ckpt_path=last``, and writes ``runs/<data>/<method>/<run_id>/metrics.json``.
Every split the run uses is read and validated before the first step (a streamed one,
``data=shards``, on a sample of its shards); a run that would train
zero steps, or whose loss becomes non-finite, stops with an error and writes no result.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence, Sized
from pathlib import Path
from typing import Any, cast

import lightning as L
from omegaconf import DictConfig

from ccr import methods
from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.shards import SkippedSamples
from ccr.experiments import cli
from ccr.experiments.config import ConfigError, compose
from ccr.experiments.curves import ValidationCurve, run_curve
from ccr.experiments.encoder_checks import check_encoders
from ccr.experiments.loggers import check_loggers
from ccr.experiments.pretrain.backbones import with_backbones
from ccr.experiments.runs import (
    checkpoints_in,
    claim_run_dir,
    load_checkpoint,
    resume_checkpoint,
    save_config,
    write_atomic,
    write_metrics,
)
from ccr.experiments.selection import (
    check_selection,
    keep_selected,
    recorded_selection,
    selection_checkpoint,
)
from ccr.experiments.trainer import (
    StopOnNonFiniteLoss,
    Throughput,
    TrainingPosition,
    build_trainer,
    check_accelerator,
    configure_matmul_precision,
    configure_threads,
    free_log_version,
    loader_settings,
)
from ccr.methods.base import RetrievalModule, Stage
from ccr.methods.layers.pretrained_dual import DualSpec, PretrainedIO, load_io

DONE = "done.ckpt"
STAGE_SECONDS = "seconds.json"  # beside done.ckpt: the finished stage's training seconds
ROLES = ("train", "val", "test")


class StageData(L.LightningDataModule):
    """The run's datamodule, with the training loader a stage asks for (e.g. parallel text),
    positioned where a resumed checkpoint left off."""

    def __init__(
        self, data: CCRDataModule, stage: Stage, position: TrainingPosition | None = None
    ) -> None:
        super().__init__()
        self.data, self.stage, self.position = data, stage, position

    def train_dataloader(self):
        loader = self.stage.dataloader(self.data)
        if self.position is not None and self.position.resumed is not None:
            epoch, batches = self.position.resumed
            resumable = (
                loader if hasattr(loader, "resume") else loader.sampler
            )  # a stream, or a sampler
            resumable.resume(epoch, batches * (loader.batch_size or 1))
        return loader

    def val_dataloader(self):
        return self.data.val_dataloader() if self.data.cfg.splits.get("val") is not None else []

    def test_dataloader(self):
        return self.data.test_dataloader()

    def eval_view(self, split: str):
        return self.data.eval_view(split)


def build_datamodule(cfg: DictConfig, roles: Sequence[str] = ROLES) -> CCRDataModule:
    """The datamodule with the train split (tokenizer, labels) and every split in ``roles`` that
    the data defines read and validated now, before anything trains."""
    data = CCRDataModule(
        cfg.data,
        seed=cfg.seed,
        loader=loader_settings(cfg),
        eval_max_images=cfg.evaluation.max_images,
        load_pretrained_io=load_pretrained_io,
    )
    data.prepare_data()
    data.setup("fit")
    for role in roles:
        if role == "test" or cfg.data.splits.get(role) is not None:
            data.check_split(role)
    return data


def load_pretrained_io(spec: Mapping[str, Any]) -> PretrainedIO:
    """``data.pretrained_io``: the pretrained model's own preprocessing and tokenizer."""
    return load_io(DualSpec.from_mapping(dict(spec)))


def stages_of(cfg: DictConfig, data: CCRDataModule) -> list[Stage]:
    method_cls = methods.get(cfg.method.name)
    return method_cls.pipeline(
        cfg.method, cfg.optim, with_backbones(data), cfg.evaluation, protocol=cfg.protocol
    )


def checkpoint_dir(run_dir: Path, stages: Sequence[Stage], stage: Stage) -> Path:
    return run_dir / "checkpoints" if len(stages) == 1 else run_dir / "stages" / stage.name


def stage_seconds(folder: Path) -> float:
    """The training seconds a finished stage recorded (0 for a stage finished by older code)."""
    path = folder / STAGE_SECONDS
    return float(json.loads(path.read_text())["seconds"]) if path.exists() else 0.0


def budget_notice(cfg: DictConfig, stages: Sequence[Stage]) -> str | None:
    """For a method whose stages carry their own step budgets, which keys bound each stage."""
    if not any(stage.max_steps is not None for stage in stages):
        return None
    parts = [
        f"{s.name}: {s.budget_key or 'its own budget'}={s.max_steps}"
        if s.max_steps is not None
        else f"{s.name}: trainer.max_steps={cfg.trainer.max_steps}"
        for s in stages
    ]
    unused = all(s.max_steps is not None for s in stages)
    return (
        f"{cfg.method.name} trains in stages with their own step budgets ({'; '.join(parts)})"
        + (f"; trainer.max_steps={cfg.trainer.max_steps} bounds none of them" if unused else "")
    )


def check_trainable(cfg: DictConfig, data: CCRDataModule, stages: Sequence[Stage]) -> None:
    """A stage whose training loader yields no batch would train zero steps: an error."""
    for stage in stages:
        loader = stage.dataloader(data)
        if len(loader) == 0:
            items = len(cast(Sized, loader.dataset))  # len(loader) has just measured it
            raise ValueError(
                f"stage '{stage.name}' would train zero steps: its training loader has no batch "
                f"({items} items, data.batch_size={cfg.data.batch_size}; incomplete "
                "batches are dropped)"
            )


def check_config_only(cfg: DictConfig) -> None:
    """The checks that need only the config and were not made at composition (the method's
    ablation and variant names, protocol, stage lists; a val split to select on), run before
    the run folder is made and any data is read."""
    try:
        methods.get(cfg.method.name).check_config(
            cfg.method, list(cfg.data.languages), protocol=cfg.protocol
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.evaluation.select_on is not None and cfg.data.splits.get("val") is None:
        raise ConfigError(
            f"evaluation.select_on={cfg.evaluation.select_on} selects on the val "
            "split, but data.splits.val is null"
        )


def train(cfg: DictConfig) -> Path:
    """Run every stage, evaluate the last one on test, and return the run folder."""
    check_encoders(cfg)
    check_config_only(cfg)
    check_accelerator(cfg)
    configure_threads(cfg)
    configure_matmul_precision(cfg)
    check_loggers(cfg)
    with claim_run_dir(cfg) as run_dir:
        if cfg.ckpt_path == "last":
            for path in checkpoints_in(run_dir):
                load_checkpoint(path)
        else:
            if cfg.ckpt_path is not None:
                load_checkpoint(cfg.ckpt_path, method=cfg.method.name)
            save_config(cfg, run_dir)
        data = build_datamodule(cfg)
        stages = stages_of(cfg, data)
        notice = budget_notice(cfg, stages)
        if notice:
            print(f"note: {notice}", flush=True)
        check_trainable(cfg, data, stages)
        final = stages[-1]
        check_selection(
            cfg,
            final.dataloader(data),
            final.max_steps or cfg.trainer.max_steps,
            data.eval_view("val").languages if cfg.evaluation.select_on else [],
        )
        return _train_stages(cfg, run_dir, data, stages)


def _train_stages(
    cfg: DictConfig, run_dir: Path, data: CCRDataModule, stages: Sequence[Stage]
) -> Path:
    started = time.perf_counter()
    earlier_s = 0.0  # trained by this run's earlier processes: finished stages and resumed ones
    throughput = Throughput()
    previous: Path | None = None
    stage_steps: dict[str, int] = {}
    resumed_from = None
    selected = None
    for index, stage in enumerate(stages):
        folder = checkpoint_dir(run_dir, stages, stage)
        final = index == len(stages) - 1
        # Each stage starts from its own seed: a stage's result depends on the seed and the
        # previous stage's checkpoint only, whether or not that stage ran in this process.
        L.seed_everything(cfg.seed + index, workers=True, verbose=False)
        module = stage.build(previous)
        done = folder / DONE
        if done.exists():  # finished before an interruption: reuse it, do not retrain
            checkpoint = load_checkpoint(done)
            module.load_state_dict(checkpoint["state_dict"])
            stage_steps[stage.name] = int(checkpoint["global_step"])
            selected = recorded_selection(folder) if final else None
            earlier_s += stage_seconds(folder)
            previous = done
            continue
        resume = resume_checkpoint(folder, cfg.ckpt_path)
        name = folder.name
        step = None
        if resume is not None:
            step = int(load_checkpoint(resume)["global_step"])
            resumed_from = step if resumed_from is None else resumed_from
            name = f"{folder.name}-resumed-at-{step}"
        if stage.extra_loaders is not None:
            evaluated_module(module, stage).attach_loaders(stage.extra_loaders(data))
        position = TrainingPosition()
        selection = selection_checkpoint(cfg, folder) if final else None
        callbacks = [
            throughput,
            position,
            StopOnNonFiniteLoss(stage.name),
            ValidationCurve(folder, step),
            *([SkippedSamples()] if data.is_sharded else []),
            *([selection] if selection else []),
        ]
        trainer = build_trainer(
            cfg,
            run_dir,
            folder,
            stage.max_steps,
            callbacks=callbacks,
            log_version=free_log_version(run_dir, name),
        )
        trainer.fit(
            module, datamodule=StageData(data, stage, position), ckpt_path=resume, weights_only=True
        )
        if trainer.global_step == 0:
            raise ValueError(f"stage '{stage.name}' trained zero steps")
        earlier_s += position.seconds_before
        if trainer.is_global_zero:
            write_atomic(folder / STAGE_SECONDS, json.dumps({"seconds": position.seconds()}))
        if selection:  # the test scores the best validation's weights, not the last step's
            selected = keep_selected(selection, module, stage.name)
        trainer.save_checkpoint(
            done, weights_only=True
        )  # the weights and step: all a later stage needs
        stage_steps[stage.name] = trainer.global_step
        previous = done
    trainer = build_trainer(cfg, run_dir, run_dir / "eval", callbacks=[])
    trainer.test(module, datamodule=StageData(data, stages[-1]), verbose=False)
    report = last_report(module, stages[-1])
    if trainer.is_global_zero:
        process_s = time.perf_counter() - started
        write_metrics(
            run_dir / "metrics.json",
            cfg,
            report,
            split="test",
            run_id=run_dir.name,
            checkpoint=str(previous),
            wall_time_s=round(earlier_s + process_s, 1),
            **({"process_wall_time_s": round(process_s, 1)} if earlier_s else {}),
            train_samples_per_s=round(throughput.samples_per_second, 1),
            train_steps=sum(stage_steps.values()),
            stage_steps=stage_steps,
            resumed_from_step=resumed_from,
            learning_curve=run_curve(
                [(s.name, checkpoint_dir(run_dir, stages, s)) for s in stages], stage_steps
            ),
            **({"selected": selected} if selected else {}),
        )
        print(f"metrics: {run_dir / 'metrics.json'}  mR={report['mR']:.2f}")
    return run_dir


def evaluated_module(module: L.LightningModule, stage: Stage) -> RetrievalModule:
    """``module``, built by the run's last ``stage``, as the RetrievalModule evaluation needs."""
    if not isinstance(module, RetrievalModule):
        raise TypeError(
            f"stage '{stage.name}' built a {type(module).__name__}; the last stage "
            "must build a RetrievalModule"
        )
    return module


def last_report(module: L.LightningModule, stage: Stage) -> dict[str, float]:
    """The report of the evaluation that ``module``, built by the last ``stage``, has just run."""
    report = evaluated_module(module, stage).last_report
    if report is None:
        raise RuntimeError(f"stage '{stage.name}' ran no evaluation that reported")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(lambda args: train(compose(args)), argv)


if __name__ == "__main__":
    main()
