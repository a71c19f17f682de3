"""The typed shape of a run's configuration (OmegaConf structured configs).

Composing merges the YAML presets and the command line into ``RunConfig``, so a value of the
wrong type or shape fails at once naming its key (``data.languages=en`` is not a list,
``optim.lr=abc`` not a number). Bounds a type cannot express (a positive batch size) are field
metadata, checked by :func:`check_bounds` after every merge.

``method`` stays an open section: each method declares its own keys in its preset. A new data
key is one field in :class:`DataConfig` (the preset then sets its value); the synthetic world's
knobs (``data.synthetic``) are an open mapping checked by the world itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig


def bounded(
    default: Any, *, minimum: float | None = None, above: float | None = None, allow: tuple = ()
) -> Any:
    """A field with a lower bound (``minimum`` inclusive, ``above`` exclusive); values in
    ``allow`` (e.g. -1 for "no limit") are accepted besides the bound."""
    return field(default=default, metadata={"minimum": minimum, "above": above, "allow": allow})


def bounded_list(default: list, *, minimum: float) -> Any:
    """A non-empty list field whose every value is at least ``minimum``."""
    return field(
        default_factory=lambda: list(default),
        metadata={"minimum": minimum, "above": None, "allow": (), "non_empty": True},
    )


@dataclass
class OptimConfig:
    lr: float = bounded(1.0e-3, above=0)
    weight_decay: float = bounded(0.02, minimum=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = bounded(1.0e-6, above=0)
    warmup_steps: int = bounded(100, minimum=0)
    warmup_ratio: float | None = bounded(None, minimum=0)
    schedule: str = "cosine"
    min_lr_ratio: float = bounded(0.01, minimum=0)
    grad_cache_chunks: int = bounded(1, minimum=1)


@dataclass
class EvaluationConfig:
    ks: list[int] = field(default_factory=lambda: [1, 5, 10])
    ndcg_k: int = bounded(10, minimum=1)
    unimodal_ndcg_ks: list[int] = bounded_list([10, 20, 50], minimum=1)
    chunk_size: int = bounded(1024, minimum=1)
    rerank_k: int = bounded(0, minimum=0)
    scorer: str = "embeddings"  # embeddings | cross_encoder (every pair by the method's ITM head)
    pair_batch_size: int = bounded(512, minimum=1)  # (image, caption) pairs per cross-encoder call
    caption_chunk: int = bounded(
        256, minimum=1
    )  # captions prepared at once for cross-encoder scoring
    select_on: str | None = None  # a val report key (en/mR): test the final stage's best step
    max_images: int | None = bounded(None, minimum=1)  # val/test keep their first N images (budget)


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: Any = 1  # a count, -1 / "auto", or a list of device ids
    num_nodes: int = bounded(1, minimum=1)
    strategy: str = "auto"
    cpu_threads: int | None = bounded(None, minimum=1)
    precision: str = "32-true"
    max_steps: int = bounded(3000, minimum=1)
    max_epochs: int = bounded(-1, minimum=1, allow=(-1,))
    check_val_every_n_epoch: int | None = bounded(5, minimum=1)
    val_check_interval: int | float | None = bounded(None, above=0)
    limit_val_batches: int | float = bounded(1.0, minimum=0)
    log_every_n_steps: int = bounded(25, minimum=1)
    checkpoint_every_n_steps: int = bounded(250, minimum=1)
    progress_refresh_rate: int = bounded(10, minimum=0)
    gradient_clip_val: float | None = bounded(1.0, minimum=0)
    accumulate_grad_batches: int = bounded(1, minimum=1)
    float32_matmul_precision: str | None = None  # highest | high | medium; None: torch's default
    loader_workers: int | None = bounded(None, minimum=0, allow=(-1,))  # None: data.num_workers
    pin_memory: bool = False  # training batches in page-locked memory (fast copies to GPU)
    prefetch_factor: int | None = bounded(None, minimum=1)  # batches each worker loads ahead
    logger: list[str] = field(
        default_factory=lambda: ["tensorboard", "csv"]
    )  # + wandb, mlflow (extras)


@dataclass
class SplitsConfig:
    train: str | None = None
    val: str | None = None
    test: str | None = None


@dataclass
class TokenizerConfig:
    name: str = "offline"
    vocab_size: int = bounded(8000, minimum=16)
    download: bool = False  # True: fetch a hub tokenizer missing from the local cache


@dataclass
class DataConfig:
    name: str = "synthetic"
    root: str = ".cache/data/synthetic"
    image_root: str | None = None
    cache_dir: str = "${.root}"
    splits: SplitsConfig = field(default_factory=SplitsConfig)
    languages: list[str] = field(default_factory=lambda: ["en"])
    mrv_languages: list[str] | None = None
    batch_size: int = bounded(64, minimum=1)
    eval_batch_size: int = bounded(256, minimum=1)
    num_workers: int = bounded(1, minimum=0)
    image_size: int = bounded(32, minimum=1)
    image_mean: list[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    image_std: list[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])
    max_length: int = bounded(48, minimum=3)
    pad_to_multiple: int | None = bounded(
        None, minimum=1
    )  # training captions: batch's longest, rounded up
    on_missing_image: str = "error"
    image_cache: bool = False  # decode + resize every image once into cache_dir/image-cache
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    synthetic: dict[str, Any] | None = None
    backbones: dict[str, Any] | None = None  # the synthetic world's pretrained encoders
    parallel_text: str | None = None  # line-aligned <lang>.txt folder or TSV (parallel corpus)
    roi_features: str | None = None  # precomputed ROI features: an LMDB or a .npy folder
    roi_allow_pickle: bool = (
        False  # read pickled LMDB values (VOLTA's layout; unpickling runs code)
    )
    roi_regions: int = bounded(36, minimum=1)  # regions per image in a batch (padded and masked)
    on_missing_roi: str = "error"
    pretrained_io: dict[str, Any] | None = None  # a pretrained model's own preprocessing and
    # tokenizer (set by method.encoders=zoo:<name>)
    shuffle_buffer: int = bounded(
        1000, minimum=1
    )  # raw samples a streamed (sharded) split shuffles in
    stream_slots: int = bounded(
        8, minimum=1
    )  # a streamed split's reading slots (ccr/datamodules/shards.py)


@dataclass
class RunConfig:
    seed: int = bounded(0, minimum=0)
    protocol: str = "default"
    variant: str | None = None
    run_dir: str = "runs"
    run_id: str | None = None
    ckpt_path: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: Any = None
    preset: dict[str, str] = field(default_factory=dict)


CHOICES = {
    "data.on_missing_image": ("error", "skip"),
    "data.on_missing_roi": ("error", "skip"),
    "optim.schedule": ("cosine", "linear"),
    "evaluation.scorer": ("embeddings", "cross_encoder"),
    "trainer.float32_matmul_precision": (None, "highest", "high", "medium"),
}


def check_bounds(cfg: DictConfig, schema: type = RunConfig, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first key whose value breaks its bound or choice."""
    for spec in fields(schema):
        key = f"{prefix}{spec.name}"
        value = cfg.get(spec.name) if cfg is not None else None
        if isinstance(spec.default_factory, type) and is_dataclass(spec.default_factory):
            check_bounds(value, spec.default_factory, f"{key}.")
            continue
        if key in CHOICES and value not in CHOICES[key]:
            raise ValueError(f"config key '{key}' = {value!r}: must be one of {list(CHOICES[key])}")
        meta = spec.metadata
        if not meta or value is None:
            continue
        if isinstance(value, ListConfig):
            if meta.get("non_empty") and not value:
                raise ValueError(f"config key '{key}' = []: must list at least one value")
            for item in value:
                _check_bound(key, item, meta)
        else:
            _check_bound(key, value, meta)


def _check_bound(key: str, value: Any, meta: Mapping) -> None:
    if value in meta["allow"] or isinstance(value, bool):
        return
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise ValueError(
            f"config key '{key}' = {value}: must be >= {meta['minimum']}"
            + (f" (or {', '.join(map(str, meta['allow']))})" if meta["allow"] else "")
        )
    if meta["above"] is not None and value <= meta["above"]:
        raise ValueError(f"config key '{key}' = {value}: must be > {meta['above']}")
