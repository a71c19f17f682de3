"""Sharded training data streamed from webdataset tar shards, with equal batches on every rank and
exact resume; and the writer of such shards from any reader's records (its command:
``python -m ccr.experiments.shards write``).

Layout of one split (``<root>/<split>/``), as img2dataset writes it plus an index:

- ``shard-000000.tar`` ...: per sample ``<key>.jpg`` (or ``.png``, the encoded image) and
  ``<key>.json`` = ``{"id": ..., "captions": {"<lang>": [texts]}, "extras": {...}}``;
- ``shards.json``: ``{"shards": [{"file", "samples"}], "languages", "captions_parallel", "labels",
  "alignment"}`` (sample counts, so nothing is read to size an epoch; whether caption i of every
  language is a translation of caption i of the others, as the source reader declared; object
  labels; whether the records mark their alignment, ``extras.alignment`` "strict" | "weak", so
  that batches carry ``alignment_weak`` as map-style ones do; an index without the field, written
  before it existed, is read as true: the flag is then false wherever a sample is not marked);
- ``captions.jsonl``: every sample's captions, one line per sample, for the offline tokenizer.

img2dataset's own output (``<shard>.tar`` with ``<key>.jpg``, ``<key>.txt`` = the caption and
``<key>.json`` = download metadata; ``<shard>_stats.json``; no ``shards.json``) is read as it is:
each shard's sample count is its stats file's ``successes`` (or, without one, the number of keys in
its tar headers, read without the images), the captions are the ``.txt`` members in the one
configured language (``data.languages``; a caption file says nothing of its language, so several
configured languages are an error), not parallel, without labels or alignment marks. A sample whose
``.json`` holds ``captions`` (this suite's layout) uses those instead. Samples without caption or
image are dropped and counted like any bad sample.

How a training epoch streams (``ShardStream``): the shards are shuffled by (seed, epoch) and dealt
round-robin to S *slots* (``data.stream_slots``, a multiple of the W processes); process r owns S/W
of them. Each slot reads its shards in turn through a seeded shuffle buffer of raw (undecoded)
samples, cycling through them again when they run out. A global batch of W·B samples takes W·B/S
consecutive samples from every slot, in slot order, so process r's batch is its slots' chunks:
every rank streams ``floor(total samples / (W·B))`` batches per epoch whatever the shard sizes
(equal counts keep DDP from hanging on a collective one rank never reaches), and the global batch,
its row order and every sample's random draws are the same for any W and any number of loader
workers: a 2-node run sees the batches a 1-process run of the same global batch sees. A slot whose
shards hold more samples than the epoch needs stops early; its tail comes in other epochs, whose
deal differs. A loader worker decodes only its own batches (the loader takes them from its
workers in turn) and reads past the others' raw samples, so N workers read every byte N times.

A sample that fails to decode, or has no caption in the requested languages, is dropped from its
batch (one row short; every loss here takes unequal rows per process) and counted. So the raw
position after ``b`` batches is exactly ``b × chunk`` in every slot: a resumed run replays the
buffers over the raw samples without decoding them and continues at the same sample on every
rank; per-sample draws (which caption) are seeded by (seed, epoch, slot, position).

Shards must be at least S.

A view that makes several training items of one sample (CL2CM's triples,
``ccr/datamodules/triples.py``) subclasses ``ShardStream``: it expands each raw sample into its
units before the shuffle buffer (``units``) and says how many each shard holds (``unit_counts``);
everything above then holds with units for samples.

We chose webdataset (its tar reader and writer) over LitData: the format is the one img2dataset
writes for CC3M-scale data, so existing shards work as they are; the shard-to-slot deal, equal
epochs and exact resume are done here because webdataset's own (``split_by_node``,
``with_epoch``, resampling) neither equalise batches exactly nor resume at a sample.
"""

from __future__ import annotations

import functools
import io
import json
import random
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import group_by_keys, tar_file_expander
from webdataset.writer import TarWriter

from .datasets import ImageTransform, TrainCollate, training_item
from .records import Record

INDEX = "shards.json"
CAPTIONS = "captions.jsonl"
STATS = "_stats.json"  # img2dataset's per-shard statistics: <shard>_stats.json
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
SAMPLED_CHECK = 4  # shards whose first sample is decoded before training (not the whole data)


@dataclass(frozen=True)
class ShardIndex:
    """The ``shards.json`` of one split: shard files and sample counts, languages, parallelism."""

    folder: Path
    files: tuple[str, ...]
    samples: tuple[int, ...]
    languages: tuple[str, ...]
    captions_parallel: bool
    labels: tuple[str, ...]
    alignment: bool = True
    caption_language: str | None = None  # img2dataset output: the language of its .txt captions

    @classmethod
    def load(cls, folder: str | Path, languages: Sequence[str] | None = None) -> ShardIndex:
        """The split's ``shards.json``, or, without one, its img2dataset shards read as they are
        (their captions in the one language of ``languages``, see the module docstring)."""
        folder = Path(folder)
        path = folder / INDEX
        if not path.is_file() and any(folder.glob("*.tar")):
            return img2dataset_index(folder, languages)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no shard index and no .tar shards (write shards with "
                "`python -m ccr.experiments.shards write`, or point at img2dataset output; "
                "docs/scale.md)"
            )
        raw = json.loads(path.read_text())
        for key in ("shards", "languages", "captions_parallel"):
            if key not in raw:
                raise ValueError(f"{path}: field '{key}' missing")
        for i, shard in enumerate(raw["shards"]):
            if not isinstance(shard.get("samples"), int) or "file" not in shard:
                raise ValueError(f"{path}: shards[{i}] needs 'file' and an integer 'samples'")
        return cls(
            folder,
            tuple(s["file"] for s in raw["shards"]),
            tuple(s["samples"] for s in raw["shards"]),
            tuple(raw["languages"]),
            bool(raw["captions_parallel"]),
            tuple(raw.get("labels", [])),
            bool(raw.get("alignment", True)),
        )

    @property
    def total(self) -> int:
        return sum(self.samples)

    def caption_rows(self) -> Iterator[dict[str, list[str]]]:
        """Every sample's captions in shard order (``captions.jsonl``, or an img2dataset split's
        caption members), for the tokenizer."""
        if self.caption_language is not None:
            for name in self.files:
                yield from caption_members(self.folder / name, self.caption_language)
            return
        with (self.folder / CAPTIONS).open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def img2dataset_index(folder: Path, languages: Sequence[str] | None) -> ShardIndex:
    """The index of an img2dataset split (no ``shards.json``), its captions in the one language
    of ``languages``."""
    if languages is None or len(languages) != 1:
        raise ValueError(
            f"{folder}: img2dataset shards (no {INDEX}) hold one .txt caption per sample and do "
            f"not say its language; set data.languages to that one language (got {languages})"
        )
    tars = sorted(folder.glob("*.tar"))
    listing = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in tars)
    return _img2dataset_index(str(folder), listing, languages[0])


@functools.cache
def _img2dataset_index(folder: str, listing: tuple, language: str) -> ShardIndex:
    """``img2dataset_index`` for one state of the folder (``listing``: tar names, sizes and
    modification times), built once per process."""
    root, counts, counted = Path(folder), [], 0
    for name, _, _ in listing:
        declared = stats_successes(root / name)
        if declared is None:
            declared, counted = len(tar_keys(root / name)), counted + 1
        counts.append(declared)
    index = ShardIndex(
        root,
        tuple(n for n, _, _ in listing),
        tuple(counts),
        (language,),
        False,
        (),
        False,
        language,
    )
    rank_zero_info(
        f"{root}: img2dataset shards without {INDEX}: {len(counts)} shards, {index.total} samples"
        f" ({counted} shards counted from their tar headers for want of a {STATS}); .txt captions"
        f" read as {language!r}"
    )
    return index


def stats_successes(shard: Path) -> int | None:
    """The sample count img2dataset wrote beside ``shard`` (``successes`` of its stats file), or
    None without a stats file."""
    path = shard.with_name(shard.stem + STATS)
    if not path.is_file():
        return None
    try:
        successes = json.loads(path.read_text()).get("successes")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ValueError(f"{path}: not an img2dataset stats object ({error})") from None
    if not isinstance(successes, int) or successes < 0:
        raise ValueError(f"{path}: field 'successes' must be a count, got {successes!r}")
    return successes


def member_key(name: str) -> tuple[str, str]:
    """A tar member's sample key and suffix, as webdataset groups them: the path up to the first
    dot of its last component (``a/b.c.jpg`` -> ``a/b``, ``c.jpg``)."""
    folder, slash, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    return folder + slash + stem, suffix


def tar_keys(shard: Path) -> list[str]:
    """The sample keys of a tar shard in order, from its member headers (contents not read)."""
    keys: list[str] = []
    with tarfile.open(shard) as tar:
        for member in tar:
            key = member_key(member.name)[0]
            if member.isfile() and (not keys or keys[-1] != key):
                keys.append(key)
    return keys


def caption_members(shard: Path, language: str) -> Iterator[dict[str, list[str]]]:
    """Per sample of an img2dataset shard: its captions (``.json`` ``captions`` when present, else
    the ``.txt`` caption as ``language``), reading only the text members."""
    with tarfile.open(shard) as tar:
        samples: dict[str, dict[str, bytes]] = {}
        for member in tar:
            key, suffix = member_key(member.name)
            if member.isfile() and suffix in ("txt", "json"):
                samples.setdefault(key, {})[suffix] = tar.extractfile(member).read()
    for key, members in samples.items():
        captions = sample_captions(members, language, f"{shard}: sample {key}")
        if captions:
            yield captions


def sample_captions(sample: dict, language: str | None, where: str) -> dict[str, list[str]]:
    """A raw sample's captions by language: its ``.json`` ``captions``, or (img2dataset output,
    ``language`` set) its ``.txt`` caption; a bad ``.json`` raises ``ValueError`` naming it."""
    meta = {}
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{where}: .json is not valid JSON ({error})") from None
    captions = meta.get("captions") if isinstance(meta, dict) else None
    if captions is None and language is not None:
        text = sample["txt"].decode("utf-8") if "txt" in sample else meta.get("caption")
        captions = {language: [text]} if isinstance(text, str) and text.strip() else {}
    if not isinstance(captions, dict):
        raise ValueError(f"{where}: .json field 'captions' must map language -> list of texts")
    return {
        lang: [texts] if isinstance(texts, str) else list(texts) for lang, texts in captions.items()
    }


def raw_samples(paths: Sequence[Path]) -> Iterator[dict]:
    """The samples of the tar files in order, undecoded: ``{"__key__", "__url__", suffix: bytes}``."""

    def streams():
        for path in paths:
            with open(path, "rb") as stream:
                yield {"url": str(path), "stream": stream}

    return group_by_keys(tar_file_expander(streams()))


def metadata_samples(path: Path) -> Iterator[dict]:
    """The samples of one tar shard as ``raw_samples`` groups them, with only their ``.json``
    members read: every other member (the image) is ``b""``, its bytes skipped by seeking, so a
    view can count what each sample holds without reading images."""

    def members():
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isreg():
                    json_member = member_key(member.name)[1].lower() == "json"
                    data = tar.extractfile(member).read() if json_member else b""
                    yield {"fname": member.name, "data": data, "__url__": str(path)}

    return group_by_keys(members())


def decode_record(sample: dict, caption_language: str | None = None) -> tuple[Record, bytes]:
    """A raw sample's record and encoded image; a bad sample raises ``ValueError`` naming it.
    ``caption_language``: an img2dataset split's, whose captions are ``.txt`` members."""
    where = f"{sample.get('__url__')}: sample {sample.get('__key__')}"
    if "json" not in sample and caption_language is None:
        raise ValueError(f"{where}: no .json member")
    image = next((sample[s] for s in IMAGE_SUFFIXES if s in sample), None)
    if image is None:
        raise ValueError(f"{where}: no image member ({', '.join(IMAGE_SUFFIXES)})")
    captions = sample_captions(sample, caption_language, where)
    meta = json.loads(sample["json"]) if "json" in sample else {}
    meta = meta if isinstance(meta, dict) else {}
    extras = (meta.get("extras") if caption_language is None else None) or {}
    return Record(str(meta.get("id", sample["__key__"])), None, captions, extras), image


def requested(record: Record, languages: Sequence[str]) -> Record:
    """``record`` with only the requested languages' non-empty captions (as validation keeps)."""
    captions = {lang: [t for t in record.captions.get(lang, []) if t.strip()] for lang in languages}
    return Record(record.id, record.image, {k: v for k, v in captions.items() if v}, record.extras)


class SeededBuffer:
    """A shuffle buffer over a stream, drawn with its own seeded generator (so a replay of the
    same stream gives the same order)."""

    def __init__(self, size: int, seed: int):
        self.size, self.rng = size, random.Random(seed)

    def __call__(self, stream: Iterator) -> Iterator:
        buffer = []
        for item in stream:
            if len(buffer) < self.size:
                buffer.append(item)
                continue
            slot = self.rng.randrange(self.size)
            yield buffer[slot]
            buffer[slot] = item
        self.rng.shuffle(buffer)
        yield from buffer


class ShardStream(IterableDataset):
    """Training batches streamed from a shard split (see the module docstring), one collated batch
    per item. ``start(epoch, batches_done)`` sets the epoch the next iteration streams and how
    many of its batches to skip. ``world``/``rank`` default to the process group's."""

    unit = "sample"  # what the stream batches, for messages

    def __init__(
        self,
        index: ShardIndex,
        *,
        languages: Sequence[str],
        transform: ImageTransform,
        collate: TrainCollate,
        label_index: dict[str, int],
        batch_size: int,
        seed: int,
        buffer: int,
        slots: int,
        num_workers: int,
        world: int | None = None,
        rank: int | None = None,
    ):
        distributed = dist.is_available() and dist.is_initialized()
        self.world = world if world is not None else dist.get_world_size() if distributed else 1
        self.rank = rank if rank is not None else dist.get_rank() if distributed else 0
        self.index, self.languages, self.transform = index, list(languages), transform
        self.collate, self.label_index = collate, label_index
        self.batch_size, self.seed, self.buffer, self.slots = batch_size, seed, buffer, slots
        self.workers = max(num_workers, 1)
        where = f"{index.folder}: data.stream_slots={slots}"
        if slots % self.world:
            raise ValueError(f"{where} is not a multiple of the {self.world} processes")
        if batch_size % (slots // self.world):
            raise ValueError(
                f"{where}: a process's batch of {batch_size} does not split into equal "
                f"chunks from its {slots // self.world} slots"
            )
        if len(index.files) < slots:
            raise ValueError(
                f"{where}: only {len(index.files)} shards; write at least as many "
                "shards as slots, or lower data.stream_slots"
            )
        self.chunk = batch_size // (slots // self.world)  # units per slot in a batch
        self.counts = self.unit_counts()
        self.batches = sum(self.counts) // (slots * self.chunk)  # per epoch, the same on every rank
        self.epoch, self.skip = 0, 0

    def unit_counts(self) -> tuple[int, ...]:
        """How many units (here samples; a derived view's items, see ``units``) each shard holds,
        known before any is read: they size the epoch."""
        return self.index.samples

    def units(self, samples: Iterator[dict]) -> Iterator:
        """The units a slot shuffles and batches, from its raw samples in order: the samples
        themselves. A view that makes several items of a sample (CL2CM's triples) expands them
        here, deterministically, so that a replay over the same samples gives the same units."""
        return samples

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self.batches

    def start(self, epoch: int, batches_done: int = 0) -> None:
        self.epoch, self.skip = epoch, batches_done

    def slot_shards(self, slot: int) -> list[Path]:
        """The shards dealt to ``slot`` in this epoch (shuffled by seed and epoch, round-robin)."""
        order = list(range(len(self.index.files)))
        random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        return [self.index.folder / self.index.files[i] for i in order[slot :: self.slots]]

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        per_rank = self.slots // self.world
        slots = range(self.rank * per_rank, (self.rank + 1) * per_rank)
        streams = []
        for slot in slots:
            shards = self.slot_shards(slot)
            if not any(self.counts[self.index.files.index(p.name)] for p in shards):
                raise ValueError(
                    f"{self.index.folder}: the shards dealt to slot {slot} hold no {self.unit}"
                )
            shuffle = SeededBuffer(self.buffer, hash_seed(self.seed, self.epoch, slot))
            streams.append(shuffle(self.units(cycle(shards))))
        for batch in range(self.batches):
            # The loader takes batches from its workers in turn, worker 0 first (also when resumed):
            # worker w makes batches skip + w, skip + w + N, ...; the others' samples it reads
            # past without decoding, as it does the batches done before a resume.
            mine = batch >= self.skip and (batch - self.skip) % self.workers == worker
            items, skipped = [], []
            for slot, stream in zip(slots, streams, strict=True):
                for offset in range(self.chunk):
                    unit = next(stream)
                    if mine:
                        item = self.item(unit, slot, batch * self.chunk + offset)
                        (skipped if isinstance(item, str) else items).append(item)
            if not mine:
                continue
            if not items:
                raise ValueError(
                    f"{self.index.folder}: every sample of a batch failed, e.g. {skipped[0]}"
                )
            yield self.collate(items) | {"skipped_samples": skipped}

    def item(self, sample: dict, slot: int, position: int) -> dict | str:
        """A training item, or (for a sample that is dropped) why, naming the sample."""
        try:
            record, image = decode_record(sample, self.index.caption_language)
            record = requested(record, self.languages)
            if not record.captions:
                return f"{sample['__url__']}: sample {sample['__key__']} has no caption in {self.languages}"
            pixels = self.transform(io.BytesIO(image))
        except Exception as error:  # noqa: BLE001 - any undecodable sample is dropped and counted
            return f"{sample.get('__url__')}: sample {sample.get('__key__')}: {error}"
        counts = {len(record.captions[lang]) for lang in record.captions}
        aligned = self.index.captions_parallel and len(counts) == 1
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(hash_seed(self.seed, self.epoch, slot, position))
            return training_item(record, pixels, self.languages, aligned, self.label_index)


def cycle(paths: list[Path]) -> Iterator[dict]:
    """The raw samples of ``paths`` in order, over and over."""
    while True:
        yield from raw_samples(paths)


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike ``hash``)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (2**63 - 1)
    return value


class StreamLoader(DataLoader):
    """The loader of a ``ShardStream``: each ``iter`` streams the next epoch (Lightning calls it
    once per epoch); ``resume(epoch, batches)`` makes the next one continue a checkpointed epoch."""

    def __init__(self, stream: ShardStream, num_workers: int):
        super().__init__(stream, batch_size=None, num_workers=num_workers, collate_fn=keep)
        self._next_epoch = 0

    def resume(self, epoch: int, batches_done: int) -> None:
        self._next_epoch = epoch
        self.dataset.start(epoch, batches_done)

    def __iter__(self):
        if self.dataset.epoch != self._next_epoch:
            self.dataset.start(self._next_epoch)
        self._next_epoch += 1
        return super().__iter__()


class SkippedSamples(Callback):
    """Counts the samples a streamed split dropped (``batch["skipped_samples"]``: undecodable or
    without a requested caption) on each rank; at each epoch end logs the sum over ranks
    (``train/skipped_samples``) and prints it with each rank's count and a first example."""

    def __init__(self) -> None:
        self.count, self.example = 0, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        skipped = batch.get("skipped_samples", ()) if isinstance(batch, dict) else ()
        self.count += len(skipped)
        if skipped and self.example is None:
            self.example = skipped[0]

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        counts = trainer.strategy.all_gather(torch.tensor(self.count, device=pl_module.device))
        counts = counts.reshape(-1).tolist()
        pl_module.log("train/skipped_samples", float(sum(counts)), rank_zero_only=True)
        if sum(counts):
            example = f", e.g. {self.example}" if self.example is not None else ""
            rank_zero_info(
                f"streamed training data: {sum(counts)} samples skipped so far "
                f"(per rank {counts}){example}"
            )
            if self.example is not None and trainer.global_rank != 0:
                print(f"rank {trainer.global_rank}: skipped e.g. {self.example}", flush=True)


def keep(batch):
    """The collate of a loader whose dataset yields whole batches."""
    return batch


def sampled_check(index: ShardIndex, languages: Sequence[str]) -> None:
    """Before training: the configured languages are the shards', and the first sample of a few
    shards decodes (not the whole data: that is what streaming avoids)."""
    missing = [lang for lang in languages if lang not in index.languages]
    if missing:
        raise ValueError(
            f"{index.folder / INDEX}: languages {missing} are not in the shards "
            f"(they hold {list(index.languages)}); set data.languages"
        )
    if index.total == 0:
        raise ValueError(f"{index.folder / INDEX}: the shards hold no sample")
    step = max(1, len(index.files) // SAMPLED_CHECK)
    for name in index.files[::step][:SAMPLED_CHECK]:
        sample = next(iter(raw_samples([index.folder / name])), None)
        if sample is None:
            raise ValueError(f"{index.folder / name}: empty shard")
        _, image = decode_record(sample, index.caption_language)
        try:
            ImageTransform(8, (0, 0, 0), (1, 1, 1))(io.BytesIO(image))
        except OSError as error:
            raise ValueError(
                f"{index.folder / name}: sample {sample['__key__']}: image does not "
                f"decode ({error})"
            ) from None


def extract(index: ShardIndex, target: Path) -> list[Record]:
    """Every sample of a (small, evaluation) split as records whose images are files under
    ``target`` (written once): evaluation then uses the map-style path with full validation."""
    records, done = [], target / "records.done"
    for sample in raw_samples([index.folder / f for f in index.files]):
        record, image = decode_record(sample, index.caption_language)
        suffix = next(s for s in IMAGE_SUFFIXES if s in sample)
        record.image = f"{target.name}/{sample['__key__']}.{suffix}"
        if not done.exists():
            target.mkdir(parents=True, exist_ok=True)
            (target / f"{sample['__key__']}.{suffix}").write_bytes(image)
        records.append(record)
    done.touch()
    return records


# ---- writing ---------------------------------------------------------------------------------------


def write_split(
    records: Sequence[Record],
    image_root: Path,
    folder: Path,
    *,
    shard_size: int,
    languages: Sequence[str],
    captions_parallel: bool,
) -> ShardIndex:
    """Write ``records`` (images under ``image_root``) as shards of ``shard_size`` samples in
    record order, with their index and caption list."""
    if shard_size < 1:
        raise ValueError(f"shard size must be >= 1, got {shard_size}")
    folder.mkdir(parents=True, exist_ok=True)
    shards, labels, alignment = [], set(), False
    with (folder / CAPTIONS).open("w", encoding="utf-8") as captions:
        for number, start in enumerate(range(0, len(records), shard_size)):
            name = f"shard-{number:06d}.tar"
            chunk = records[start : start + shard_size]
            with TarWriter(str(folder / name), encoder=False) as writer:
                for position, record in enumerate(chunk, start):
                    suffix = Path(record.image).suffix.lstrip(".").lower() or "jpg"
                    meta = {"id": record.id, "captions": record.captions, "extras": record.extras}
                    writer.write(
                        {
                            "__key__": f"{position:09d}",
                            suffix: (image_root / record.image).read_bytes(),
                            "json": json.dumps(meta, ensure_ascii=False).encode(),
                        }
                    )
                    captions.write(json.dumps(record.captions, ensure_ascii=False) + "\n")
                    labels.update(record.extras.get("objects", []))
                    alignment = alignment or "alignment" in record.extras
            shards.append({"file": name, "samples": len(chunk)})
    (folder / INDEX).write_text(
        json.dumps(
            {
                "shards": shards,
                "languages": list(languages),
                "captions_parallel": captions_parallel,
                "labels": sorted(labels),
                "alignment": alignment,
            },
            indent=1,
        )
    )
    return ShardIndex.load(folder)
