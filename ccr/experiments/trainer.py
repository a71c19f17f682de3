"""Build the Lightning ``Trainer`` of a run from its ``trainer`` preset, and the callbacks that make
a run trustworthy: atomic checkpoints, an exact training position for resuming, a stop at the
first non-finite loss, and throughput."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, ListConfig

from ccr.experiments.config import ConfigError


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stops and writes no result."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file and renamed into place: an interrupted save (a
    kill, a full disk) leaves the previous checkpoint intact instead of a truncated one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            super().save_checkpoint(checkpoint, staging, storage_options)
            with open(staging, "rb") as f:
                os.fsync(f.fileno())
            os.replace(staging, path)
        except OSError as err:  # a full disk: name the checkpoint, not the staging file
            raise OSError(err.errno, err.strerror, str(path)) from None
        finally:
            staging.unlink(missing_ok=True)


def rng_states() -> dict[str, Any]:
    """The global torch / numpy / python RNG states, as plain tensors and tuples (weights_only)."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    kind, keys, position, has_gauss, cached = (
        legacy  # legacy=True: the tuple (the stub says either)
    )
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["cached"])
    )
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class TrainingPosition(Callback):
    """Where training stands, saved in every checkpoint: the epoch, the batches already trained in
    it (the training sampler skips them on resume), the RNG states (restored just before the
    first resumed batch) and the seconds the stage has trained so far. With per-item seeded data
    this makes a resumed run continue exactly as the uninterrupted one would have, and its wall
    time count the earlier processes' training up to the checkpoint.

    Lightning runs checkpoint callbacks after all others, so a checkpoint saved at a batch end
    already counts that batch.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0
        self.resumed: tuple[int, int] | None = None
        self.seconds_before = 0.0  # trained by earlier processes, up to the resumed checkpoint
        self._started: float | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._between_epochs = False

    def seconds(self) -> float:
        """Seconds this stage has trained: earlier processes' plus this one's since fit began."""
        running = 0.0 if self._started is None else time.perf_counter() - self._started
        return self.seconds_before + running

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch != self.epoch:
            self.epoch, self.batches = trainer.current_epoch, 0
        self.batches += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending_rng is not None:
            set_rng_states(self._pending_rng)
            self._pending_rng = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "rng": rng_states(),
            "seconds": self.seconds(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
        self.resumed = (self.epoch, self.batches)
        self._pending_rng = state["rng"]
        self.seconds_before = float(state.get("seconds", 0.0))  # 0: a checkpoint from before

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """A checkpoint saved after an epoch's last batch resumes at the next epoch's start.

        Lightning (2.6) restores such a checkpoint as "mid-epoch, last batch done": it counts the
        epoch as finished, then finishes the next one with no batch, so the resumed run skips an
        epoch (its data order and epoch-based schedule drift from the uninterrupted run). The
        fit loop's progress is rewritten here, before Lightning restores it, to what it is
        between the two epochs; the sampler then resumes at batch 0 of the next epoch.
        """
        loop = checkpoint.get("loops", {}).get("fit_loop")
        if loop is None or not _ended_an_epoch(loop):
            return
        _start_next_epoch(loop)
        self._between_epochs = True
        own = checkpoint["callbacks"][self.state_key]  # restored into this callback next
        own["epoch"], own["batches"] = int(own["epoch"]) + 1, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = time.perf_counter()
        # Between epochs nothing is left to restart: the next epoch starts as in an unbroken run
        # (Lightning keeps a step-bounded run "restarting", which would replay the saved batch's
        # end-of-batch bookkeeping, a scheduler step included, before the epoch's first batch).
        if self._between_epochs:
            trainer.fit_loop.epoch_loop.restarting = False
            self._between_epochs = False


def _ended_an_epoch(fit_loop: dict[str, Any]) -> bool:
    """The fit loop's state was saved at the end of an epoch's last training batch (a step
    checkpoint on the epoch boundary)."""
    batches = fit_loop["epoch_loop.batch_progress"]
    total = batches["total"]
    return bool(batches["is_last_batch"]) and total["completed"] == total["processed"] - 1


def _start_next_epoch(fit_loop: dict[str, Any]) -> None:
    """Rewrite the fit loop's progress counters in place to "epoch finished, the next one not
    started": the finished batch counted complete, the per-epoch counters at zero."""
    batches = fit_loop["epoch_loop.batch_progress"]
    batches["total"]["completed"] = batches["total"]["processed"]
    batches["is_last_batch"] = False

    def zero_current(progress: dict[str, Any]) -> None:
        for key, value in progress.items():
            if key == "current":
                for counter in value:
                    value[counter] = 0
            elif isinstance(value, dict):
                zero_current(value)

    for name in ("batch_progress", "scheduler_progress", "automatic_optimization.optim_progress"):
        zero_current(fit_loop[f"epoch_loop.{name}"])
    # Lightning counts the saved batch as stepped on a mid-epoch restart only
    fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
    for counters in fit_loop["epoch_progress"].values():
        counters["processed"] = counters["completed"] = counters["started"]


class StopOnNonFiniteLoss(Callback):
    """Stops training at the first NaN / inf loss, before its backward pass, naming the step and
    the loss terms the method logged as non-finite in that step; and at the first update that
    leaves a trainable weight non-finite (a finite loss with an exploding step), before the next
    step's forward pass or a checkpoint could use those weights."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if not bool(torch.isfinite(loss).all()):
            self._stop(trainer, f"loss {float(loss.detach().float().mean())}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        weights = [p.detach() for p in pl_module.parameters() if p.requires_grad]
        if weights and not bool(torch.isfinite(torch.nn.utils.get_total_norm(weights))):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self._stop(
                trainer,
                f"the update made trainable weights non-finite (step loss "
                f"{float(loss.detach().float().mean()):.4g})",
                step=trainer.global_step,
            )

    def _stop(self, trainer, what: str, step: int | None = None) -> None:
        logs = _step_logs(trainer)
        bad = [f"{name}={value}" for name, value in logs.items() if not np.isfinite(value)]
        terms = (
            f"non-finite terms: {', '.join(bad)}"
            if bad
            else (
                "logged terms: " + ", ".join(f"{k}={v:.4g}" for k, v in logs.items())
                if logs
                else ""
            )
        )
        raise TrainingDiverged(
            f"training diverged at step {trainer.global_step + 1 if step is None else step} of "
            f"stage '{self.stage}': {what}" + (f"; {terms}" if terms else "")
        )


def _step_logs(trainer) -> dict[str, float]:
    """The values the method's ``self.log`` recorded in the current training step (``train/loss``,
    the base module's progress-bar copy of the total, is logged after the step and left out)."""
    results = getattr(trainer, "_results", None) or {}
    logs = {}
    for metric in results.values():
        value = getattr(metric, "_forward_cache", None)
        name = getattr(getattr(metric, "meta", None), "name", None)
        if (
            name not in (None, "train/loss")
            and isinstance(value, torch.Tensor)
            and value.numel() == 1
        ):
            logs[name] = float(value)
    return logs


class Throughput(Callback):
    """Training samples per second, timed over the optimisation steps only (no validation)."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds += time.perf_counter() - self._start
        first_tensor = next(v for v in batch.values() if hasattr(v, "shape"))
        self.samples += first_tensor.shape[0]

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


GPU_ACCELERATORS = ("gpu", "cuda", "mps")


def check_accelerator(cfg: DictConfig) -> None:
    """A GPU preset on a machine without a usable GPU, or more GPUs than it has, is a one-line
    error naming the key, before any data is read (Lightning would fail later, in a traceback)."""
    t = cfg.trainer
    accelerator = str(t.accelerator)
    if accelerator not in GPU_ACCELERATORS:
        return
    cuda = CUDAAccelerator.is_available() and accelerator != "mps"
    if not cuda and not (MPSAccelerator.is_available() and accelerator != "cuda"):
        preset = (cfg.get("preset") or {}).get("trainer", "?")
        raise ConfigError(
            f"trainer.accelerator={accelerator} (TRAINER={preset}) but this machine has "
            "no GPU that torch can use; use TRAINER=cpu (trainer=cpu)"
        )
    have = CUDAAccelerator.auto_device_count() if cuda else 1
    wanted = len(t.devices) if isinstance(t.devices, ListConfig) else t.devices
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > have:
        raise ConfigError(
            f"trainer.devices={t.devices} asks for {wanted} GPUs but this machine has {have}"
        )


def process_count(cfg: DictConfig) -> int:
    """How many training processes the run starts: devices per node times ``trainer.num_nodes``
    (``auto`` or -1 devices: every visible GPU on a GPU accelerator, one process on a CPU)."""
    t = cfg.trainer
    devices = t.devices
    if isinstance(devices, ListConfig):
        per_node = len(devices)
    elif str(devices).isdigit() and int(devices) > 0:
        per_node = int(devices)
    elif str(t.accelerator) in GPU_ACCELERATORS and CUDAAccelerator.is_available():
        per_node = CUDAAccelerator.auto_device_count()
    else:
        per_node = 1
    return per_node * int(t.num_nodes)


def configure_threads(cfg: DictConfig) -> None:
    """Apply the preset's torch intra-op thread count (CPU runs), if it sets one."""
    if cfg.trainer.cpu_threads:
        torch.set_num_threads(int(cfg.trainer.cpu_threads))


MATMUL_HINT = "torch.set_float32_matmul_precision"  # Lightning's tip on GPUs with tensor cores


class _DropMatmulHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return MATMUL_HINT not in record.getMessage()


def configure_matmul_precision(cfg: DictConfig) -> None:
    """Apply ``trainer.float32_matmul_precision`` when the preset sets it; a deliberate choice,
    so Lightning's tip to set it is dropped."""
    precision = cfg.trainer.get("float32_matmul_precision")
    if precision is None:
        return
    torch.set_float32_matmul_precision(precision)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatmulHint) for f in logger.filters):
            logger.addFilter(_DropMatmulHint())


def loader_settings(cfg: DictConfig, cores: int | None = None) -> dict[str, Any]:
    """The training loader's worker count, pinning and prefetch from the trainer preset:
    ``trainer.loader_workers`` (None: ``data.num_workers``; -1: this process's share of the
    machine's cores, one left for the training loop), ``pin_memory``, ``prefetch_factor``."""
    t = cfg.trainer
    workers = t.get("loader_workers")
    if workers is None:
        workers = int(cfg.data.num_workers)
    elif workers == -1:
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        workers = max(1, cores // local_processes(cfg) - 1)
    settings: dict[str, Any] = {
        "num_workers": int(workers),
        "pin_memory": bool(t.get("pin_memory")),
    }
    if t.get("prefetch_factor") is not None and workers > 0:
        settings["prefetch_factor"] = int(t.prefetch_factor)
    return settings


def local_processes(cfg: DictConfig) -> int:
    """Training processes on this machine: one per local device under DDP, else one."""
    t = cfg.trainer
    if "ddp" not in str(t.strategy):
        return 1
    if isinstance(t.devices, int) and t.devices > 0:
        return t.devices
    if not isinstance(t.devices, (int, str)):
        return len(t.devices)
    return max(1, torch.cuda.device_count())


def free_log_version(run_dir: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... : a log folder no earlier attempt has used, so a
    resumed run keeps the logs written before its interruption."""
    version, n = name, 1
    while (run_dir / "csv" / version).exists() or (run_dir / "tensorboard" / version).exists():
        n += 1
        version = f"{name}-{n}"
    return version


def build_trainer(
    cfg: DictConfig,
    run_dir: Path,
    checkpoint_dir: Path,
    max_steps: int | None = None,
    callbacks: Sequence[Callback] = (),
    log_version: str | None = None,
) -> L.Trainer:
    """A Trainer that logs to ``trainer.logger`` (default TensorBoard and CSV in ``run_dir``, folder
    ``log_version``, default the checkpoint folder's name) and checkpoints atomically to
    ``checkpoint_dir``."""
    from ccr.experiments.loggers import build_loggers

    t = cfg.trainer
    version = log_version or checkpoint_dir.name
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=t.checkpoint_every_n_steps,
    )
    loggers = build_loggers(cfg, run_dir, version, t.log_every_n_steps)
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=t.strategy,
        precision=t.precision,
        max_steps=max_steps if max_steps is not None else t.max_steps,
        max_epochs=t.max_epochs,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches,
        num_sanity_val_steps=0,
        logger=loggers,
        callbacks=[checkpoint, TQDMProgressBar(refresh_rate=t.progress_refresh_rate), *callbacks],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(checkpoint_dir),  # where a SLURM requeue signal saves hpc_ckpt_N.ckpt
        deterministic=False,
        enable_model_summary=False,
    )
