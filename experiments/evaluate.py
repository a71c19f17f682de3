"""Re-evaluate a checkpoint with its run's stored configuration.

    python -m experiments.evaluate ckpt=runs/synthetic/ccrk/<run>/checkpoints/last.ckpt evaluation.rerank_k=16

Overrides change evaluation settings (re-ranking depth, split, data root); the result goes to
``<run>/eval/<split>[-first<N>]-<scorer>/metrics.json`` (``-first<N>`` for a sliced split,
``data.splits.test=test[:N]``, or an image budget, ``evaluation.max_images=N``: the same images), so the leaderboard shows it as its own row when its scorer or split
differs, and no evaluation overwrites another's record. The checkpoint is loaded weights-only and checked before any data is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from datamodules.datamodule import parse_split
from experiments import cli
from experiments.config import ConfigError, apply_overrides, typed
from experiments.runs import check_checkpoint_method, load_checkpoint, scorer_label, write_metrics
from experiments.train import StageData, build_datamodule, last_report, stages_of
from experiments.trainer import (
    build_trainer,
    check_accelerator,
    configure_matmul_precision,
    configure_threads,
)


def find_run_dir(ckpt: Path) -> Path:
    """The run folder of a checkpoint: the nearest parent holding ``config.yaml``."""
    for parent in ckpt.resolve().parents:
        if (parent / "config.yaml").exists():
            return parent
    raise ConfigError(
        f"no config.yaml above checkpoint {ckpt}; was it written by experiments.train?"
    )


def evaluate(ckpt: Path, overrides: Sequence[str] = (), split: str = "test") -> dict[str, float]:
    if split not in ("val", "test"):
        raise ConfigError(f"split must be val or test, got '{split}'")
    checkpoint = load_checkpoint(ckpt)
    run_dir = find_run_dir(ckpt)
    stored = typed(OmegaConf.load(run_dir / "config.yaml"), str(run_dir / "config.yaml"))
    cfg: DictConfig = apply_overrides(stored, overrides)
    check_checkpoint_method(checkpoint, ckpt, cfg.method.name)
    check_accelerator(cfg)
    state = checkpoint["state_dict"]
    configure_threads(cfg)
    configure_matmul_precision(cfg)
    data = build_datamodule(cfg, roles=(split,))
    stage = stages_of(cfg, data)[-1]
    module = stage.build(None)
    module.load_state_dict(state)
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
            "usage: python -m experiments.evaluate ckpt=PATH [split=val|test] [key=value ...]"
        )
    report = evaluate(Path(ckpt), rest, split)
    print(f"mR={report['mR']:.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
