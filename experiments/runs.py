"""Where a run lives on disk and what it records: ``runs/<data>/<method>/<run_id>/``.

A run folder holds the resolved ``config.yaml``, the TensorBoard and CSV logs, checkpoints (one
folder per stage for staged methods) and ``metrics.json``, the only file the leaderboard reads.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.config import ConfigError, method_label

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_root(cfg: DictConfig) -> Path:
    """The folder that holds every run of this (data, method) pair."""
    return Path(cfg.run_dir) / cfg.preset.data / method_label(cfg)


def resolve_run_dir(cfg: DictConfig) -> Path:
    """This run's folder. ``ckpt_path=last`` without a run id resumes the newest run."""
    root = run_root(cfg)
    if cfg.run_id is None and cfg.ckpt_path == "last":
        previous = sorted((p for p in root.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
        if not previous:
            raise ConfigError(f"ckpt_path=last but {root} holds no run to resume")
        return previous[-1]
    run_id = cfg.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-seed{cfg.seed}"
    return root / run_id


def resume_checkpoint(checkpoint_dir: Path, ckpt_path: str | None) -> str | None:
    """The checkpoint a stage resumes from: an explicit path, its ``last.ckpt``, or none."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        last = checkpoint_dir / "last.ckpt"
        return str(last) if last.exists() else None
    if not Path(ckpt_path).exists():
        raise ConfigError(f"ckpt_path '{ckpt_path}' does not exist")
    return ckpt_path


def git_commit() -> str:
    """The commit of the code that produced a result (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, check=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save_config(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")


def scorer_label(cfg: DictConfig) -> str:
    """How the ranked scores were made: dual-encoder similarity, or re-ranked top-k."""
    return f"itm@{cfg.evaluation.rerank_k}" if cfg.evaluation.rerank_k else "itc"


def write_metrics(path: Path, cfg: DictConfig, report: dict[str, float], **facts: Any) -> None:
    """``metrics.json``: every metric plus what is needed to reproduce and group the row."""
    record = {
        "method": method_label(cfg),
        "data": cfg.preset.data,
        "languages": list(cfg.data.languages),
        "protocol": cfg.protocol,
        "scorer": scorer_label(cfg),
        "seed": cfg.seed,
        "git_commit": git_commit(),
        **facts,
        "metrics": report,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
