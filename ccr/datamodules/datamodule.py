"""``CCRDataModule``: any configured dataset (a reader's, or the synthetic world) as training
batches, evaluation views and parallel text, with the tokenizer and ``DataInfo`` methods need.

The ``data`` config node (ccr/experiments/configs/data/*.yaml) names the dataset, where it lives,
which of its splits play train/val/test, the languages, and loader/tokenizer settings.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from . import pretrained_io, shards, synthetic
from .datasets import (
    CaptionCollate,
    CaptionDataset,
    ImageDataset,
    ImageTransform,
    ParallelCollate,
    TrainCollate,
    TrainDataset,
    collate_images,
)
from .eval_split import caption_table, graded_relevance
from .image_cache import CachedImages, cached_images
from .parallel_batches import parallel_batches
from .readers import captions_parallel, read_dataset
from .readers.parallel_text import ParallelText, read_parallel_text
from .records import Record
from .roi_features import ImageRois, RoiStore
from .synthetic.source import WorldBackbones, WorldSource
from .tokenization import OFFLINE, Tokenizer, build_tokenizer
from .validation import validate

SYNTHETIC = "synthetic"
SHARDS = (
    "shards"  # webdataset shards (ccr/datamodules/shards.py): training streams, val/test extracted
)


@dataclass
class DataInfo:
    """What a method needs to know about the data to build itself."""

    languages: list[str]
    vocab_size: int
    pad_token_id: int
    cls_token_id: int
    eos_token_id: int
    mask_token_id: int
    max_length: int
    image_size: int
    num_objects: int
    # the category of each object label, in label order (the world: the shape of a colour-shape
    # label; other data: the label itself, as COCO's labels are categories)
    object_categories: list[str] = field(default_factory=list)
    # encoder settings that a method config's ``name: world`` resolves to ({"text": {...},
    # "image": {...}, "seq2seq": {...}}); the datamodule leaves it empty: the harness fills it
    # from ``CCRDataModule.backbones`` (ccr.experiments.pretrain.with_backbones) for the world
    backbones: Mapping[str, dict] = field(default_factory=dict)
    # width of the precomputed ROI features the data ships (data.roi_features) and where it was
    # read (store, image, field); None when it ships none
    roi_dim: int | None = None
    roi_store: str | None = None
    # data.pad_to_multiple: training captions padded to the batch's longest, rounded up to a
    # multiple of this (None: to max_length); methods whose training depends on it refuse it
    pad_to_multiple: int | None = None


class SeededItems(Dataset):
    """A dataset whose item ``(epoch, index)`` is drawn with torch's RNG seeded by (seed, epoch,
    index): the random choices inside an item (e.g. which caption) depend on nothing else, not
    on the worker that loads it nor on what ran before, so a resumed run sees the same batches."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed would also (lazily) reseed every
            # accelerator's RNG, which fork_rng(devices=[]) does not restore, and costs ~1 ms.
            torch.default_generator.manual_seed((self.seed * 1_000_003 + epoch) * 1_000_033 + index)
            return self.dataset[index]


class EpochSampler(DistributedSampler):
    """Training order: a permutation seeded by (seed, epoch), sharded over processes as
    ``DistributedSampler`` does (Lightning keeps it and calls ``set_epoch``), yielding
    ``(epoch, index)`` keys for :class:`SeededItems`. ``resume`` skips the items a checkpointed
    run had already trained on in that epoch."""

    def __init__(self, dataset: Dataset, seed: int):
        distributed = dist.is_available() and dist.is_initialized()
        super().__init__(
            dataset,
            num_replicas=dist.get_world_size() if distributed else 1,
            rank=dist.get_rank() if distributed else 0,
            shuffle=True,
            seed=seed,
        )
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, items_done: int) -> None:
        # Lightning does not call ``set_epoch`` before the first iteration of a run restarted
        # mid-epoch, so the epoch it resumes in is set here: its permutation, not epoch 0's.
        self.set_epoch(epoch)
        self._resume = (epoch, items_done)

    def __iter__(self):
        indices = list(super().__iter__())
        if self._resume is not None:
            epoch, done = self._resume
            self._resume = None
            if epoch == self.epoch:
                indices = indices[done:]
        return iter([(self.epoch, index) for index in indices])


def training_loader(dataset: Dataset, seed: int, **kwargs) -> DataLoader:
    """A loader over ``dataset`` in :class:`EpochSampler` order with seeded items; its own
    generator keeps worker seeding from drawing on the global RNG."""
    items = SeededItems(dataset, seed)
    return DataLoader(
        items,
        sampler=EpochSampler(items, seed),
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )


@dataclass
class EvalView:
    """Unique images and every caption (with its image index and language) of one split."""

    image_ids: list[str]
    caption_image: torch.Tensor
    caption_language: list[str]
    languages: list[str]
    relevance: torch.Tensor | None
    image_paths: list[Path] = field(repr=False)
    captions: list[str] = field(repr=False)
    transform: ImageTransform | CachedImages = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)
    max_length: int = field(repr=False)
    num_workers: int = field(repr=False)
    mrv_languages: list[str] | None = None  # data.mrv_languages: MRV's languages (None: all)
    rois: ImageRois | None = field(default=None, repr=False)  # the images' shipped ROI features

    def image_loader(self, batch_size: int) -> DataLoader:
        """Batches ``{"images": [b,3,H,W], "index": [b]}`` in order, plus ``roi_features``
        [b,R,D] / ``roi_mask`` [b,R] when the data ships ROI features."""
        return self._loader(
            ImageDataset(self.image_paths, self.transform, self.rois), batch_size, collate_images
        )

    def caption_loader(self, batch_size: int) -> DataLoader:
        """Batches ``{"input_ids", "attention_mask": [b,L], "index": [b], "language": [b] str}``
        in order."""
        collate = CaptionCollate(self.tokenizer, self.max_length)
        dataset = CaptionDataset(self.captions, self.caption_language)
        return self._loader(dataset, batch_size, collate)

    def _loader(self, dataset, batch_size: int, collate) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=collate,
            generator=torch.Generator(),  # leaves the global RNG (training's dropout) untouched
        )


SPLIT_SLICE = re.compile(r"(?P<name>[^\[\]]+?)(?:\[:(?P<limit>\d+)\])?")


def parse_split(spec: str, key: str) -> tuple[str, int | None]:
    """``"test"`` -> ("test", None); ``"test[:100]"`` -> ("test", 100): the first 100 records, for
    a scorer too slow for the whole split (its leaderboard row then names the setting)."""
    match = SPLIT_SLICE.fullmatch(str(spec))
    if match is None or (match["limit"] is not None and int(match["limit"]) < 1):
        raise ValueError(f"{key}={spec}: expected a split name, optionally with [:N] (N >= 1)")
    return match["name"], None if match["limit"] is None else int(match["limit"])


class CCRDataModule(L.LightningDataModule):
    """Records -> validated splits -> batches. ``seed`` drives caption sampling choices made here
    (parallel-batch grouping); the synthetic world has its own ``synthetic.seed``. ``loader``
    (``ccr.experiments.trainer.loader_settings``: the machine's ``num_workers``, ``pin_memory``,
    ``prefetch_factor``) sets up the training loaders; default: ``data.num_workers`` workers.
    ``eval_max_images`` (``evaluation.max_images``) keeps the first N images of the val and test
    splits, as ``name[:N]`` split specs do, or the whole split when it has fewer.
    ``load_pretrained_io`` loads a pretrained model's own preprocessing and tokenizer when
    ``data.pretrained_io`` names one (the harness passes it: the data package loads no model)."""

    def __init__(
        self,
        cfg: DictConfig,
        seed: int = 0,
        loader: Mapping | None = None,
        eval_max_images: int | None = None,
        load_pretrained_io: pretrained_io.LoadPretrainedIO | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.eval_max_images = eval_max_images
        self.loader = {"num_workers": int(cfg.num_workers), **(loader or {})}
        self.languages = [str(lang) for lang in cfg.languages]
        self._records: dict[str, list[Record]] = {}
        self._views: dict[str, EvalView] = {}
        self._tokenizer: Tokenizer | None = None
        self._info: DataInfo | None = None
        self._labels: dict[str, int] = {}
        self._parallel: ParallelText | None = None
        self._token_counts: dict[str, int] = {}  # sentence -> tokens, for token-counted batches
        self._roi_store: RoiStore | None = None
        self._roi_keys: dict[str, dict[str, str]] = {}  # role -> record id -> ROI store key
        self._load_pretrained_io = load_pretrained_io
        self._pretrained_io: pretrained_io.PretrainedIO | None = None

    # ---- where the data is --------------------------------------------------------------------
    @property
    def is_synthetic(self) -> bool:
        return self.cfg.name == SYNTHETIC

    @functools.cached_property
    def world(self) -> WorldSource | None:
        """The synthetic world this config describes (``data.synthetic``), or None."""
        if not self.is_synthetic:
            return None
        knobs = OmegaConf.to_container(self.cfg.synthetic, resolve=True)
        return WorldSource(self.cfg.root, synthetic.WorldKnobs.from_config(knobs))

    @property
    def captions_parallel(self) -> bool:
        """Whether caption i of every language is a translation of caption i of the others, as
        the dataset declares it (its reader, or the synthetic world)."""
        if self.is_sharded:
            return self.shard_index("train").captions_parallel
        return (
            synthetic.CAPTIONS_PARALLEL if self.is_synthetic else captions_parallel(self.cfg.name)
        )

    @property
    def is_sharded(self) -> bool:
        return self.cfg.name == SHARDS

    def shard_index(self, role: str) -> shards.ShardIndex:
        """The shard index of the split playing ``role`` (``<root>/<split>/shards.json``)."""
        split, _ = parse_split(self.cfg.splits[role], f"data.splits.{role}")
        return shards.ShardIndex.load(Path(self.cfg.root) / split, self.languages)

    def check_split(self, role: str) -> None:
        """Read and validate the split playing ``role`` before training: every record, or for a
        streamed training split the languages and a sample of its shards."""
        if self.is_sharded and role == "train":
            shards.sampled_check(self.shard_index(role), self.languages)
        else:
            self.records(role)

    @property
    def image_root(self) -> Path:
        """Folder that ``Record.image`` paths are relative to."""
        if self.world is not None:
            return self.world.image_root
        if self.is_sharded:
            return Path(self.cfg.cache_dir) / "extracted"
        return Path(self.cfg.image_root or self.cfg.root)

    def records(self, role: str) -> list[Record]:
        """Validated records of the split playing ``role`` (train / val / test), read once; a
        ``name[:N]`` split keeps the first N of them."""
        if role not in self._records:
            spec = self.cfg.splits.get(role)
            if spec is None:
                raise ValueError(
                    f"data '{self.cfg.name}' has no {role} split (data.splits.{role} is null)"
                )
            split, limit = parse_split(spec, f"data.splits.{role}")
            if self.is_sharded and role == "train":
                raise ValueError(f"data '{SHARDS}' streams its train split: it has no record list")
            if self.world is not None:
                raw, images = self.world.split(split)
                records = self._validated(raw, split, images)
            elif self.is_sharded:  # a small evaluation split: its images extracted, then validated
                records = self._validated(
                    shards.extract(self.shard_index(role), self.image_root / split),
                    split,
                    self.image_root,
                )
            else:
                records = self._validated(
                    read_dataset(self.cfg.name, self.cfg.root, split), split, self.image_root
                )
            if limit is not None:
                if limit > len(records):
                    raise ValueError(
                        f"data.splits.{role}={spec}: the split has only {len(records)} records"
                    )
                rank_zero_info(
                    f"{self.cfg.name}/{split}: data.splits.{role}={spec} keeps the first "
                    f"{limit} of {len(records)} records"
                )
                records = records[:limit]
            if (
                role != "train"
                and self.eval_max_images is not None
                and len(records) > self.eval_max_images
            ):
                rank_zero_info(
                    f"{self.cfg.name}/{split}: evaluation.max_images={self.eval_max_images} "
                    f"keeps the first {self.eval_max_images} of {len(records)} records"
                )
                records = records[: self.eval_max_images]
            if self.roi_store is not None:
                records = self._with_rois(records, role, split)
            self._records[role] = records
        return self._records[role]

    @property
    def roi_store(self) -> RoiStore | None:
        """The precomputed ROI features of ``data.roi_features`` (opened once), or None."""
        path = self.cfg.get("roi_features")
        if path is not None and self._roi_store is None:
            self._roi_store = RoiStore(
                path, allow_pickle=bool(self.cfg.get("roi_allow_pickle", False))
            )
            rank_zero_info(
                f"ROI features: {self._roi_store.dim}-wide regions from {path}, "
                f"{self.cfg.roi_regions} per image in a batch"
            )
        return self._roi_store

    def _with_rois(self, records: list[Record], role: str, split: str) -> list[Record]:
        """The records that have ROI features (the others fail or are skipped and counted, by
        ``data.on_missing_roi``); their store keys are kept for the loaders."""
        source = f"{self.cfg.name}/{split}"
        kept, self._roi_keys[role], skipped = self.roi_store.match(
            records, source, self.cfg.on_missing_roi
        )
        if skipped:
            rank_zero_info(
                f"{source}: skipped {len(skipped)} of {len(records)} records without "
                f"ROI features in {self.roi_store.source}, e.g. {skipped[:3]}"
            )
        return kept

    def _image_rois(self, role: str, records: list[Record]) -> ImageRois | None:
        """The shipped ROI features of ``records`` (of the split playing ``role``), or None."""
        if self.roi_store is None:
            return None
        keys = self._roi_keys[role]
        return ImageRois(self.roi_store, [keys[r.id] for r in records], int(self.cfg.roi_regions))

    def _validated(self, raw: list[Record], split: str, image_root: Path) -> list[Record]:
        kept, report = validate(
            raw,
            languages=self.languages,
            source=f"{self.cfg.name}/{split}",
            image_root=image_root,
            on_missing_image=self.cfg.on_missing_image,
        )
        rank_zero_info(report.summary())
        return kept

    def _tokenizer_records(self) -> list[Record]:
        """Whose captions the offline tokenizer learns: the train split's, for a synthetic world its
        clean twin's (``WorldKnobs.clean``), so that translation noise or weak alignment changes
        the training captions but not the vocabulary, nor the backbones pretrained with it."""
        if self.world is None or self.world.is_clean:
            return self.records("train")
        split, limit = parse_split(self.cfg.splits.train, "data.splits.train")
        raw, images = self.world.split(split, clean=True)
        return self._validated(raw, split, images)[:limit]

    # ---- Lightning hooks ----------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Generate the synthetic world and train the offline tokenizer once (cached on disk)."""
        if self.world is not None:
            self.world.prepare()
        if self.cfg.tokenizer.name == OFFLINE:
            self._build_tokenizer()

    def setup(self, stage: str | None = None) -> None:
        """Build the tokenizer, read the train split (its object labels) and fill ``info``; the
        val / test splits are read when their loaders are first asked for."""
        if self._info is not None:
            return
        tokenizer = self._build_tokenizer()
        train: list[Record] = []  # a stream's records are not read here: its index names the labels
        if self.is_sharded:
            labels = list(self.shard_index("train").labels)
        else:
            train = self.records("train") if self.cfg.splits.get("train") is not None else []
            labels = sorted(
                {label for record in train for label in record.extras.get("objects", [])}
            )
        self._labels = {label: i for i, label in enumerate(labels)}
        self._info = DataInfo(
            languages=list(self.languages),
            vocab_size=tokenizer.vocab_size,
            pad_token_id=tokenizer.pad_token_id,
            cls_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.eos_token_id,
            mask_token_id=tokenizer.mask_token_id,
            max_length=getattr(tokenizer, "text_length", None) or int(self.cfg.max_length),
            image_size=int(self.cfg.image_size),
            num_objects=len(labels),
            object_categories=self._label_categories(train, labels),
            roi_dim=None if self.roi_store is None else self.roi_store.dim,
            roi_store=None if self.roi_store is None else self.roi_store.describe(),
            pad_to_multiple=self.cfg.get("pad_to_multiple"),
        )

    def _label_categories(self, train: list[Record], labels: list[str]) -> list[str]:
        """Each object label's category: from the world's scenes, else the label itself."""
        if self.world is None:
            return list(labels)
        return self.world.label_categories(train, labels)

    @property
    def backbones(self) -> WorldBackbones | None:
        """The handle to the synthetic world's pretrained backbones (what they are built from;
        ``ccr.experiments.pretrain`` builds them), or None: real data, or ``data.backbones: null``."""
        if self.world is None or self.cfg.get("backbones") is None:
            return None
        return WorldBackbones(
            self.world.root,
            self.world.knobs.clean(),
            self._build_tokenizer(),
            self.languages,
            int(self.cfg.max_length),
            int(self.cfg.image_size),
            list(self.cfg.image_mean),
            list(self.cfg.image_std),
            OmegaConf.to_container(self.cfg.backbones, resolve=True),
        )

    @property
    def pretrained(self) -> pretrained_io.PretrainedIO | None:
        """The pretrained model's own preprocessing and tokenizer (``data.pretrained_io``), or None."""
        spec = self.cfg.get("pretrained_io")
        if spec is not None and self._pretrained_io is None:
            if self._load_pretrained_io is None:
                raise ValueError(
                    "data.pretrained_io is set, but this datamodule was given no loader for a "
                    "pretrained model's preprocessing (CCRDataModule(load_pretrained_io=...), "
                    "as ccr.experiments.train.build_datamodule passes)"
                )
            self._pretrained_io = self._load_pretrained_io(
                OmegaConf.to_container(spec, resolve=True)
            )
        return self._pretrained_io

    def _build_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None and self.pretrained is not None:
            self._tokenizer = pretrained_io.PretrainedTokenizer(self.pretrained)
        if self._tokenizer is None:
            corpus = None
            if self.cfg.tokenizer.name == OFFLINE and self.is_sharded:
                corpus = [
                    t
                    for row in self.shard_index("train").caption_rows()
                    for lang in self.languages
                    for t in row.get(lang, [])
                ]
            elif self.cfg.tokenizer.name == OFFLINE:
                corpus = [
                    t
                    for r in self._tokenizer_records()
                    for lang in self.languages
                    for t in r.captions.get(lang, [])
                ]
            self._tokenizer = build_tokenizer(
                self.cfg.tokenizer, corpus=corpus, cache_dir=self.cfg.cache_dir
            )
        return self._tokenizer

    @property
    def info(self) -> DataInfo:
        if self._info is None:
            raise RuntimeError("CCRDataModule.info is available after setup()")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        if self._info is None:
            raise RuntimeError("CCRDataModule.tokenizer is available after setup()")
        return self._build_tokenizer()

    # ---- loaders ------------------------------------------------------------------------------
    def image_transform(self) -> ImageTransform:
        """Pixels of one image as the suite reads them (size, mean, std)."""
        return ImageTransform(int(self.cfg.image_size), self.cfg.image_mean, self.cfg.image_std)

    def loader_transform(self):
        """Pixels of one image as the loaders read them: the suite's transform, or the pretrained
        model's own preprocessing when ``data.pretrained_io`` is set."""
        if self.pretrained is not None:
            return pretrained_io.PretrainedImageTransform(self.pretrained)
        return self.image_transform()

    def images(self, paths: list[Path]) -> ImageTransform | CachedImages:
        """How the loaders read these image files: decoded and transformed per item, or with
        ``data.image_cache`` from their pre-sized cache in ``<data.cache_dir>/image-cache``
        (built on first use; the same pixels). The cache stores the suite's own transform, so a
        pretrained model's preprocessing (``data.pretrained_io``) is never cached."""
        if not self.cfg.get("image_cache"):
            return self.loader_transform()
        if self.pretrained is not None:
            raise ValueError(
                "data.image_cache=true: the cache holds the suite's own image transform, "
                "not a pretrained model's preprocessing (data.pretrained_io); set it false"
            )
        return cached_images(
            paths,
            self.image_transform(),
            Path(self.cfg.cache_dir) / "image-cache",
            self.loader["num_workers"],
        )

    def _check_languages(self, languages: list[str]) -> None:
        unknown = [lang for lang in languages if lang not in self.languages]
        if unknown or not languages:
            raise ValueError(
                f"languages {unknown or '[]'} not configured; configured languages: {self.languages}"
            )

    def train_dataloader(
        self, languages: list[str] | None = None, batch_size: int | None = None
    ) -> DataLoader:
        """Shuffled training batches with K = len(languages) captions per instance (default: all
        configured languages) and ``batch_size`` instances (default: ``data.batch_size``; a
        stage may train with its own, e.g. RC3's fine-tuning). Records with none of the
        requested languages are left out."""
        languages = list(languages) if languages is not None else self.languages
        self._check_languages(languages)
        if self.is_sharded:
            return self._stream_loader(languages, int(batch_size or self.cfg.batch_size))
        records = [
            r for r in self.records("train") if any(lang in r.captions for lang in languages)
        ]
        if len(records) < len(self.records("train")):
            dropped = len(self.records("train")) - len(records)
            rank_zero_info(
                f"train: {dropped} of {len(self.records('train'))} records have no caption in "
                f"{languages} and are left out"
            )
        image_root = self.image_root
        dataset = TrainDataset(
            records,
            languages,
            image_root,
            self.images([image_root / r.image for r in records]),
            self._labels,
            parallel=self.captions_parallel,
            rois=self._image_rois("train", records),
        )
        if dataset.unaligned:
            rank_zero_info(
                f"train: {dataset.unaligned} of {len(records)} records hold different numbers of "
                f"captions per language; their captions are drawn independently, not as translations"
            )
        with_alignment = any("alignment" in r.extras for r in records)
        collate = TrainCollate(
            self.tokenizer,
            self.info.max_length,
            languages,
            len(self._labels),
            with_alignment,
            pad_to_multiple=self.info.pad_to_multiple,
        )
        return training_loader(
            dataset,
            self.seed,
            batch_size=int(batch_size or self.cfg.batch_size),
            drop_last=True,
            persistent_workers=self.loader["num_workers"] > 0,
            collate_fn=collate,
            **self.loader,
        )

    def _stream_loader(self, languages: list[str], batch_size: int) -> shards.StreamLoader:
        """Training batches streamed from the train split's shards (``ccr/datamodules/shards.py``)."""
        index = self.shard_index("train")
        collate = TrainCollate(
            self.tokenizer,
            self.info.max_length,
            languages,
            len(self._labels),
            index.alignment,
            pad_to_multiple=self.info.pad_to_multiple,
        )
        stream = shards.ShardStream(
            index,
            languages=languages,
            transform=self.loader_transform(),  # a pretrained model's own preprocessing, if set
            collate=collate,
            label_index=self._labels,
            batch_size=batch_size,
            seed=self.seed,
            buffer=int(self.cfg.shuffle_buffer),
            slots=int(self.cfg.stream_slots),
            num_workers=int(self.cfg.num_workers),
        )
        return shards.StreamLoader(stream, int(self.cfg.num_workers))

    def eval_view(self, role: str) -> EvalView:
        """The evaluation view of the val or test split (built once)."""
        if role not in self._views:
            records = self.records(role)
            table = caption_table(records, self.languages)
            image_root = self.image_root
            image_paths = [image_root / r.image for r in records]
            self._views[role] = EvalView(
                image_ids=[r.id for r in records],
                caption_image=table.caption_image,
                caption_language=table.caption_language,
                languages=table.languages,
                relevance=self.relevance(role),
                image_paths=image_paths,
                captions=table.captions,
                transform=self.images(image_paths),
                tokenizer=self.tokenizer,
                max_length=self.info.max_length,
                num_workers=self.loader["num_workers"],
                mrv_languages=None
                if self.cfg.get("mrv_languages") is None
                else [str(lang) for lang in self.cfg.mrv_languages],
                rois=self._image_rois(role, records),
            )
        return self._views[role]

    def relevance(self, role: str) -> torch.Tensor | None:
        """Graded image-image relevance of the split playing ``role`` (the world's scenes), or
        None when its records carry no scene."""
        return graded_relevance(self.records(role))

    def val_dataloader(self) -> list[DataLoader]:
        view = self.eval_view("val")
        return [
            view.image_loader(int(self.cfg.eval_batch_size)),
            view.caption_loader(int(self.cfg.eval_batch_size)),
        ]

    def test_dataloader(self) -> list[DataLoader]:
        view = self.eval_view("test")
        return [
            view.image_loader(int(self.cfg.eval_batch_size)),
            view.caption_loader(int(self.cfg.eval_batch_size)),
        ]

    def parallel_text(self) -> ParallelText:
        """The parallel corpus: ``data.parallel_text`` (a folder of line-aligned ``<lang>.txt``
        files or a TSV file), or for the synthetic world its own corpus of scenes outside the
        retrieval splits. Never the retrieval captions: a zero-shot protocol must not train on
        in-domain target-language captions."""
        if self._parallel is None:
            path = self.cfg.get("parallel_text")
            if path is None and self.world is not None:
                path = self.world.parallel_text()
            if path is None:
                raise ValueError(
                    f"data '{self.cfg.name}' has no parallel corpus: set data.parallel_text to a "
                    "folder of line-aligned <lang>.txt files or a TSV file (docs/datasets.md)"
                )
            self._parallel = read_parallel_text(path)
        return self._parallel

    def parallel_dataloader(
        self,
        pairs: list[tuple[str, str]] | None = None,
        *,
        beta: float | None = None,
        max_tokens: int | None = None,
    ) -> DataLoader:
        """Text-only sentence pairs of the parallel corpus (:meth:`parallel_text`), one language
        pair per batch. Default pairs: English to and from every other configured language, or
        every ordered pair when English is not configured. ``beta`` draws each batch's pair with
        temperature smoothing and ``max_tokens`` counts batches in tokens
        (``ccr.datamodules.parallel_batches``); otherwise ``data.batch_size`` pairs per batch."""
        if pairs is None:
            others = [lang for lang in self.languages if lang != "en"]
            if "en" in self.languages:
                pairs = [p for lang in others for p in (("en", lang), (lang, "en"))]
            else:
                pairs = [(a, b) for a in self.languages for b in self.languages if a != b]
        self._check_languages([lang for pair in pairs for lang in pair])
        corpus = self.parallel_text()
        texts = {}
        for src, tgt in pairs:
            texts[src, tgt], blank = corpus.pairs(src, tgt)
            if blank:
                rank_zero_info(
                    f"{corpus.source}: {blank} {src}-{tgt} rows with a blank side left out"
                )
        max_length = self.info.max_length

        def count_tokens(sentences: list[str]) -> list[int]:
            """Token counts, each distinct sentence tokenised once per datamodule: every direction
            shares its English side, and every stage (and the pre-run check) asks again."""
            known = self._token_counts
            new = list(dict.fromkeys(s for s in sentences if s not in known))
            for start in range(0, len(new), 8192):
                chunk = new[start : start + 8192]
                known.update(
                    zip(
                        chunk,
                        self.tokenizer(chunk, max_length)["attention_mask"].sum(1).tolist(),
                        strict=True,
                    )
                )
            return [known[s] for s in sentences]

        dataset = parallel_batches(
            texts,
            batch_size=int(self.cfg.batch_size),
            seed=self.seed,
            beta=beta,
            max_tokens=max_tokens,
            count_tokens=count_tokens,
        )
        return training_loader(
            dataset,
            self.seed,
            batch_size=None,
            collate_fn=ParallelCollate(self.tokenizer, max_length),
            **self.loader,
        )
