"""Re-evaluate a checkpoint with its run's stored configuration.

    python -m experiments.evaluate ckpt=runs/synthetic/ccrk/<run>/checkpoints/last.ckpt evaluation.rerank_k=16

Overrides change evaluation settings (re-ranking depth, split, data root); the result goes to
``<run>/eval/<name>/metrics.json`` so the leaderboard shows it as its own row when its scorer
differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.config import ConfigError, apply_overrides
from experiments.runs import scorer_label, write_metrics
from experiments.train import StageData, build_datamodule, stages_of
from experiments.trainer import build_trainer, configure_threads


def find_run_dir(ckpt: Path) -> Path:
    """The run folder of a checkpoint: the nearest parent holding ``config.yaml``."""
    for parent in ckpt.resolve().parents:
        if (parent / "config.yaml").exists():
            return parent
    raise ConfigError(f"no config.yaml above checkpoint {ckpt}; was it written by experiments.train?")


def evaluate(ckpt: Path, overrides: Sequence[str] = (), split: str = "test") -> dict[str, float]:
    if not ckpt.exists():
        raise ConfigError(f"checkpoint {ckpt} does not exist")
    run_dir = find_run_dir(ckpt)
    cfg: DictConfig = apply_overrides(OmegaConf.load(run_dir / "config.yaml"), overrides)
    configure_threads(cfg)
    data = build_datamodule(cfg)
    stage = stages_of(cfg, data)[-1]
    module = stage.build(None)
    module.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
    name = f"{split}-{scorer_label(cfg)}"
    trainer = build_trainer(cfg, run_dir, run_dir / "eval" / name)
    loaders = StageData(data, stage)
    if split == "test":
        trainer.test(module, datamodule=loaders, verbose=False)
    else:
        trainer.validate(module, datamodule=loaders, verbose=False)
    if trainer.is_global_zero:
        write_metrics(run_dir / "eval" / name / "metrics.json", cfg, module.last_report,
                      split=split, run_id=run_dir.name, checkpoint=str(ckpt))
    return module.last_report


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    ckpt = next((a.split("=", 1)[1] for a in args if a.startswith("ckpt=")), None)
    split = next((a.split("=", 1)[1] for a in args if a.startswith("split=")), "test")
    rest = [a for a in args if not a.startswith(("ckpt=", "split="))]
    try:
        if ckpt is None:
            raise ConfigError("usage: python -m experiments.evaluate ckpt=PATH [split=val|test] [key=value ...]")
        report = evaluate(Path(ckpt), rest, split)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    print(f"mR={report['mR']:.2f}")


if __name__ == "__main__":
    main()
