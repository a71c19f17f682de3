"""Re-evaluate a checkpoint with its run's stored configuration.

    python -m ccr.experiments.evaluate ckpt=runs/synthetic/ccrk/<run>/checkpoints/last.ckpt evaluation.rerank_k=16

Overrides change evaluation settings (re-ranking depth, split, data root); the result goes to
``<run>/eval/<split>[-first<N>]-<scorer>/metrics.json`` (``-first<N>`` for a sliced split,
``data.splits.test=test[:N]``, or an image budget, ``evaluation.max_images=N``: the same images), so the leaderboard shows it as its own row when its scorer or split
differs, and no evaluation overwrites another's record. The checkpoint is loaded weights-only and checked before any data is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ccr.datamodules.datamodule import CCRDataModule, parse_split
from ccr.experiments import cli
from ccr.experiments.config import ConfigError, apply_overrides, typed
from ccr.experiments.runs import (
    check_checkpoint_method,
    load_checkpoint,
    scorer_label,
    write_metrics,
)
from ccr.experiments.train import (
    StageData,
    build_datamodule,
    evaluated_module,
    last_report,
    stages_of,
)
from ccr.experiments.trainer import (
    build_trainer,
    check_accelerator,
    configure_matmul_precision,
    configure_threads,
)
from ccr.methods.base import RetrievalModule, Stage

SPLITS = ("val", "test")


def find_run_dir(ckpt: Path) -> Path:
    """The run folder of a checkpoint: the nearest parent holding ``config.yaml``."""
    for parent in ckpt.resolve().parents:
        if (parent / "config.yaml").exists():
            return parent
    raise ConfigError(
        f"no config.yaml above checkpoint {ckpt}; was it written by ccr.experiments.train?"
    )


@dataclass
class LastStage:
    """A run's last-stage module rebuilt from a checkpoint, with the run's configuration (stored,
    plus overrides) and the datamodule that evaluates it."""

    cfg: DictConfig
    run_dir: Path
    data: CCRDataModule
    stage: Stage
    module: RetrievalModule


def load_last_stage(
    ckpt: Path,
    overrides: Sequence[str] = (),
    split: str = "test",
    run_dir: Path | None = None,
    trainer_settings: bool = False,
) -> LastStage:
    """Rebuild the run's last stage from ``ckpt`` (loaded weights-only and checked against the
    run's method before any data is read) with the configuration stored in ``run_dir`` (default:
    the nearest folder above ``ckpt`` holding ``config.yaml``) plus ``overrides``; the datamodule
    has ``split`` read and validated. The module is in eval mode, on the CPU.
    ``trainer_settings``: also check the run's accelerator and set its matmul precision, for a
    caller that evaluates through the run's trainer (``evaluate``); the demo and the report
    encode on the CPU whatever the run trained on."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {'|'.join(SPLITS)}, got '{split}'")
    checkpoint = load_checkpoint(ckpt)
    run_dir = find_run_dir(ckpt) if run_dir is None else run_dir
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no config.yaml")
    cfg: DictConfig = apply_overrides(
        typed(OmegaConf.load(config_path), str(config_path)), overrides
    )
    check_checkpoint_method(checkpoint, ckpt, cfg.method.name)
    if trainer_settings:
        check_accelerator(cfg)
    configure_threads(cfg)
    if trainer_settings:
        configure_matmul_precision(cfg)
    data = build_datamodule(cfg, roles=(split,))
    stage = stages_of(cfg, data)[-1]
    module = evaluated_module(stage.build(None), stage)
    module.load_state_dict(checkpoint["state_dict"])
    return LastStage(cfg, run_dir, data, stage, module.eval())


def evaluate(ckpt: Path, overrides: Sequence[str] = (), split: str = "test") -> dict[str, float]:
    restored = load_last_stage(ckpt, overrides, split, trainer_settings=True)
    cfg, run_dir, data, stage, module = (
        restored.cfg,
        restored.run_dir,
        restored.data,
        restored.stage,
        restored.module,
    )
    _, first = parse_split(cfg.data.splits.get(split), f"data.splits.{split}")
    limits = [
        n for n in (first, cfg.evaluation.max_images) if n is not None
    ]  # both cut as [:N] does
    name = f"{split}{f'-first{min(limits)}' if limits else ''}-{scorer_label(cfg)}"  # never the full split's folder
    trainer = build_trainer(cfg, run_dir, run_dir / "eval" / name)
    loaders = StageData(data, stage)
    if split == "test":
        trainer.test(module, datamodule=loaders, verbose=False)
    else:
        trainer.validate(module, datamodule=loaders, verbose=False)
    report = last_report(module, stage)
    if trainer.is_global_zero:
        write_metrics(
            run_dir / "eval" / name / "metrics.json",
            cfg,
            report,
            split=split,
            run_id=run_dir.name,
            checkpoint=str(ckpt),
        )
    return report


def _main(args: list[str]) -> None:
    ckpt = next((a.split("=", 1)[1] for a in args if a.startswith("ckpt=")), None)
    split = next((a.split("=", 1)[1] for a in args if a.startswith("split=")), "test")
    rest = [a for a in args if not a.startswith(("ckpt=", "split="))]
    if ckpt is None:
        raise ConfigError(
            "usage: python -m ccr.experiments.evaluate ckpt=PATH [split=val|test] [key=value ...]"
        )
    report = evaluate(Path(ckpt), rest, split)
    print(f"mR={report['mR']:.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
