"""Where a run lives on disk and what it records: ``runs/<data>/<method>/<run_id>/``.

A run folder holds the resolved ``config.yaml``, the TensorBoard and CSV logs, checkpoints (one
folder per stage for staged methods) and ``metrics.json``, the only file the leaderboard reads.

One run per folder: a new run creates its folder (an existing one with a checkpoint or a result
is an error; one left by a failed start, with neither, is replaced), ``ckpt_path=last`` resumes
only a folder that holds a checkpoint and the same configuration, and an exclusive lock refuses a
second process while the first writes. A new run that fails before its first checkpoint removes
its folder, so a failed start never blocks its ``run_id``. Files are replaced atomically, so an
interruption or a full disk never leaves a truncated ``config.yaml``, ``metrics.json`` or
checkpoint behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ccr import metrics
from ccr.experiments.config import ConfigError, as_mapping, method_label

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK = ".lock"
ATTACHED_RUN_DIR = "CCR_RUN_DIR"  # set for the processes Lightning spawns (DDP ranks > 0)
CHECKPOINT_GLOBS = ("checkpoints/*.ckpt", "stages/*/*.ckpt")

# Keys that say where or how verbosely a run executes, not what it computes: two runs that differ
# only here (and in the seed) are the same experiment, and a resume may change them.
EXECUTION_ONLY = (
    "seed",
    "run_id",
    "run_dir",
    "ckpt_path",
    "trainer.progress_refresh_rate",
    "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps",
    "trainer.cpu_threads",
    "method.cpu_threads",
    "data.num_workers",
    "data.root",
    "data.image_root",
    "data.cache_dir",
    "data.tokenizer.download",
    "trainer.logger",
    "data.roi_allow_pickle",
    "evaluation.pair_batch_size",
    "evaluation.caption_chunk",
    "method.rerank_batch_size",  # where pair_batch_size lived before evaluation.* had it
)
# Keys added after results were published, at the value that reproduces the earlier behaviour: at
# that value they are left out of a run's settings, so its fingerprint equals that of the earlier
# runs of the same experiment.
LATER_DEFAULTS = {
    "data.pretrained_io": None,
    "method.projection": "linear",
    "method.lit": False,
    "evaluation.max_images": None,
    "method.teacher.clip.projection": "linear",  # mCLIP's clip teacher, typed as clip's section
    "method.teacher.clip.lit": False,
    "method.teacher.clip": None,  # mCLIP without a teacher stage (mclip_paper), typed
    "method.teacher.languages": None,
    "method.teacher.max_steps": None,
    "method.check_val_every_n_epoch": 1,  # RC3's cadence under trainer=cpu, that preset's own
}
# mCLIP's and RC3's configs recorded a copy of ``protocol`` as ``method.run_protocol`` until the
# methods were handed the protocol at build time (``ccr.experiments.config.RETIRED``): their settings
# still list it, at the run's ``protocol``, so fingerprints equal those of the runs that recorded it.
RECORDED_PROTOCOL = ("mclip", "rc3")


# ---- configuration identity -------------------------------------------------------------------


def plain(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` resolved into plain dicts and lists (a ``DictConfig`` always gives a dict)."""
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def experiment_settings(config: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """The flattened settings that decide a run's result (everything but ``EXECUTION_ONLY``)."""
    settings = flatten(plain(config) if isinstance(config, DictConfig) else config)
    if settings.get("method.name") in RECORDED_PROTOCOL:
        settings.setdefault("method.run_protocol", settings.get("protocol"))
    return {
        k: v
        for k, v in settings.items()
        if k not in EXECUTION_ONLY and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])
    }


def config_fingerprint(config: Mapping[str, Any] | DictConfig) -> str:
    """A short digest of :func:`experiment_settings`: equal for runs that differ only in seed."""
    text = json.dumps(experiment_settings(config), sort_keys=True, allow_nan=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """``key: a -> b`` for every setting (seed included) in which two configs differ."""
    left = {**experiment_settings(a), "seed": a.get("seed")}
    right = {**experiment_settings(b), "seed": b.get("seed")}
    return [
        f"{k}: {left.get(k)!r} -> {right.get(k)!r}"
        for k in sorted(left.keys() | right.keys())
        if left.get(k) != right.get(k)
    ]


# ---- the run folder ---------------------------------------------------------------------------


def run_root(cfg: DictConfig) -> Path:
    """The folder that holds every run of this (data, method) pair."""
    return Path(cfg.run_dir) / cfg.preset.data / method_label(cfg)


def checkpoints_in(run_dir: Path) -> list[Path]:
    return sorted(p for pattern in CHECKPOINT_GLOBS for p in run_dir.glob(pattern))


def _is_spawned_rank() -> bool:
    """True in a process that joins a run another process owns (DDP rank > 0, node > 0)."""
    ranks = (os.environ.get(name, "0") for name in ("LOCAL_RANK", "NODE_RANK", "RANK"))
    return any(rank != "0" for rank in ranks)


def _new_run_dir(cfg: DictConfig) -> tuple[Path, bool]:
    """A fresh folder: the named ``run_id`` or a timestamped one; and whether it is the folder
    of a failed start (it exists with no checkpoint and no result), which the new run replaces."""
    root = run_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    if cfg.run_id is not None:
        folder = root / str(cfg.run_id)
        try:
            folder.mkdir()
        except FileExistsError:
            if (folder / "metrics.json").exists():
                raise ConfigError(
                    f"run {folder} has finished (metrics.json exists); choose another run_id"
                ) from None
            if checkpoints_in(folder):
                raise ConfigError(
                    f"run folder {folder} already exists with checkpoints; resume it "
                    "with ckpt_path=last, or choose another run_id"
                ) from None
            return folder, True
        return folder, False
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-seed{cfg.seed}"
    for attempt in range(1, 1000):
        folder = root / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            folder.mkdir()
            return folder, False
        except FileExistsError:
            continue
    raise ConfigError(f"could not create a new run folder under {root}")


def _resumable_run_dir(cfg: DictConfig) -> Path:
    """The folder ``ckpt_path=last`` resumes: the named run, or the newest one."""
    root = run_root(cfg)
    if cfg.run_id is None:
        previous = sorted(
            (p for p in root.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        if not previous:
            raise ConfigError(f"ckpt_path=last but {root} holds no run to resume")
        return previous[-1]
    folder = root / str(cfg.run_id)
    if not folder.is_dir():
        raise ConfigError(f"ckpt_path=last but there is no run folder {folder} (check run_id)")
    return folder


def _check_resumable(cfg: DictConfig, folder: Path) -> None:
    if (folder / "metrics.json").exists():
        raise ConfigError(f"run {folder} has finished (metrics.json exists); start a new run_id")
    if not checkpoints_in(folder):
        raise ConfigError(f"ckpt_path=last but run folder {folder} holds no checkpoint")
    stored = folder / "config.yaml"
    if not stored.exists():
        raise ConfigError(
            f"run folder {folder} has no config.yaml; it was not written by ccr.experiments.train"
        )
    before = plain(as_mapping(OmegaConf.load(stored), str(stored)))
    differences = config_differences(before, plain(cfg))
    if differences:
        raise ConfigError(
            f"resuming {folder} needs its own configuration; differs in " + "; ".join(differences)
        )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (released when the process ends, even on SIGKILL)."""
    handle = open(folder / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise ConfigError(
            f"run folder {folder} is in use by another process (pid {owner})"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()


@contextlib.contextmanager
def claim_run_dir(cfg: DictConfig) -> Iterator[Path]:
    """This run's folder, held exclusively while the ``with`` block runs.

    A new run gets a new folder; ``ckpt_path=last`` resumes an unfinished run with the same
    configuration. Processes Lightning spawns for the other DDP ranks join the folder of the
    process that claimed it.
    """
    if _is_spawned_rank():
        attached = os.environ.get(ATTACHED_RUN_DIR)
        if attached is None and cfg.run_id is None:
            raise ConfigError("multi-node runs need an explicit run_id shared by every node")
        yield Path(attached) if attached else run_root(cfg) / str(cfg.run_id)
        return
    resuming = cfg.ckpt_path == "last"
    folder, failed_start = (_resumable_run_dir(cfg), False) if resuming else _new_run_dir(cfg)
    with _locked(folder):
        if resuming:
            _check_resumable(cfg, folder)
        if failed_start:
            print(
                f"note: {folder} holds no checkpoint and no result (a failed start); "
                "this run replaces it",
                flush=True,
            )
            _empty(folder)
        os.environ[ATTACHED_RUN_DIR] = str(folder)
        try:
            yield folder
        except BaseException:
            if not resuming and not checkpoints_in(folder):  # nothing to resume: leave no stub
                shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            os.environ.pop(ATTACHED_RUN_DIR, None)


def _empty(folder: Path) -> None:
    """Remove everything in ``folder`` but its lock file."""
    for entry in folder.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def resume_checkpoint(checkpoint_dir: Path, ckpt_path: str | None) -> str | None:
    """The checkpoint a stage resumes from: an explicit path, its newest of ``last.ckpt`` and the
    ``hpc_ckpt_*.ckpt`` Lightning saves on a SLURM requeue signal (by step; docs/scale.md), or
    none (a stage of a resumed run that had not started yet)."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        found = [
            p
            for p in (checkpoint_dir / "last.ckpt", *sorted(checkpoint_dir.glob("hpc_ckpt_*.ckpt")))
            if p.exists()
        ]
        if not found:
            return None
        return str(max(found, key=lambda path: int(load_checkpoint(path)["global_step"])))
    load_checkpoint(ckpt_path)  # a one-line error for a missing or foreign file
    return ckpt_path


# ---- files ------------------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old file
    or the whole new one, never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(staging, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)
    except OSError as err:
        raise naming(err, path) from None
    finally:
        staging.unlink(missing_ok=True)


def naming(err: OSError, path: Path) -> OSError:
    """``err`` with ``path`` as its file when it names none (a write that fails on a full disk)."""
    if err.filename is not None:
        return err
    return type(err)(err.errno, err.strerror, str(path))


def load_checkpoint(path: str | Path, method: str | None = None) -> dict[str, Any]:
    """A suite checkpoint, loaded with ``weights_only=True`` (no pickled code ever runs); with
    ``method``, one written by that method (``hyper_parameters.method.name``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    from ccr.methods.layers.weights import (
        load_torch_file,  # here: the leaderboard imports no models
    )

    try:
        checkpoint = load_torch_file(path)
    except ValueError as err:
        raise ConfigError(f"{path} is not a suite checkpoint ({err})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ConfigError(f"{path} is not a suite checkpoint (it has no state_dict)")
    if method is not None:
        check_checkpoint_method(checkpoint, path, method)
    return checkpoint


def check_checkpoint_method(checkpoint: dict[str, Any], path: str | Path, method: str) -> None:
    """The checkpoint's recorded method (``hyper_parameters.method.name``) must be ``method``."""
    recorded = ((checkpoint.get("hyper_parameters") or {}).get("method") or {}).get("name")
    if recorded is not None and recorded != method:
        raise ConfigError(
            f"{path} is a checkpoint of method '{recorded}', not of this run's "
            f"method '{method}' (method.name)"
        )


def git_commit() -> str:
    """The commit of the code that produced a result (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save_config(cfg: DictConfig, run_dir: Path) -> None:
    """Write the run's config, from the process that claimed the folder only: another node's
    process, started at the same time, must not create the folder before that claim."""
    if not _is_spawned_rank():
        write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))


def scorer_label(cfg: DictConfig | Mapping) -> str:
    """How the ranked scores were made: ``itm@all``, the method's cross-encoder over every pair;
    else the method's embeddings (``itc``, or the method's own name for them: RC3's are a probe,
    ``probe``), with ``itm@k`` (``probe+itm@k``) when the cross-encoder re-ranks each top k."""
    evaluation = cfg["evaluation"]
    if evaluation.get("scorer", "embeddings") == "cross_encoder":
        return "itm@all"
    from ccr import (
        methods,  # here, not at the top: the leaderboard reads labels without building models
    )

    try:
        first = methods.get(str((cfg.get("method") or {}).get("name"))).embedding_scorer
    except KeyError:  # not a trained method of the suite (an external model's row)
        first = "itc"
    rerank_k = evaluation["rerank_k"]
    if not rerank_k:
        return first
    return f"itm@{rerank_k}" if first == "itc" else f"{first}+itm@{rerank_k}"


def strict_json(record: Any) -> str:
    """JSON text with no bare NaN / Infinity: a non-finite number is an error naming its key."""

    def check(value: Any, key: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"refusing to write non-finite value {value} at '{key}'")
        if isinstance(value, Mapping):
            for k, v in value.items():
                check(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{key}[{i}]")

    check(record, "")
    return json.dumps(record, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def run_record(
    cfg: DictConfig,
    report: dict[str, float],
    *,
    method: str,
    protocol: str,
    scorer: str,
    **facts: Any,
) -> dict[str, Any]:
    """What every ``metrics.json`` holds: the row's identity, what reproduces and groups it (config,
    fingerprint, metric protocol, commit), the run's own ``facts`` and every metric."""
    config = plain(cfg)
    return {
        "method": method,
        "data": cfg.preset.data,
        "languages": list(cfg.data.languages),
        "protocol": protocol,
        "scorer": scorer,
        "seed": cfg.seed,
        "config_fingerprint": config_fingerprint(config),
        "metric_protocol": dict(metrics.METRIC_PROTOCOL),
        "git_commit": git_commit(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **facts,
        "metrics": report,
        "config": config,
    }


def write_metrics(path: Path, cfg: DictConfig, report: dict[str, float], **facts: Any) -> None:
    """``metrics.json`` of a trained method's run."""
    record = run_record(
        cfg,
        report,
        method=method_label(cfg),
        protocol=cfg.protocol,
        scorer=scorer_label(cfg),
        **facts,
    )
    write_atomic(path, strict_json(record))
