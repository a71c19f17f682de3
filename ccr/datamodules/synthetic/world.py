"""Generate the synthetic world (images + JSONL records per split) once, and cache it on disk.

Every image draws from its own random stream seeded by (seed, split, index), so the world is
byte-for-byte reproducible. The cache folder name is a digest of the knobs, the languages and
``GENERATOR_VERSION``; a finished world is moved into place atomically.

Besides the retrieval splits the world holds a ``pretrain`` split: clean, fully parallel scenes
that share no scene (described objects and background) with train/val/test. The world's
pretrained backbones learn from it, and its captions are written as line-aligned parallel text
(``parallel/<lang>.txt``), the corpus mCLIP's Stage 1 reads instead of the retrieval captions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import asdict, astuple, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..records import Record, read_records, write_records
from . import languages as grammars
from .plans import garble, mistranslate, sample_plans
from .render import render_scene
from .scene import COLOURS, POSITIONS, SHAPES, Scene, sample_scene

GENERATOR_VERSION = 2
SPLITS = ("train", "val", "test")  # the retrieval splits
PRETRAIN = "pretrain"
PARALLEL_DIR = "parallel"  # <world>/parallel/<lang>.txt, line i of every file: one translation
MAX_SCENE_DRAWS = 1000  # a pretrain scene is redrawn while it repeats a retrieval scene
ENGLISH = "en"


@dataclass(frozen=True)
class WorldKnobs:
    """The generator's knobs (the ``synthetic:`` block of the data config)."""

    # Every knob is documented in docs/synthetic.md and ccr/experiments/configs/data/synthetic.yaml.
    seed: int = 0
    num_train: int = 10000
    num_val: int = 500
    num_test: int = 1000
    num_pretrain: int = 10000
    captions_per_image: int = 5
    render_size: int = 64
    num_shapes: int = 8
    num_colours: int = 8
    max_objects: int = 3
    distractors: int = 0
    background_prob: float = 0.5
    mention_prob: float = 0.7
    mt_noise: float = 0.0
    weak_fraction: float = 0.0
    coverage: dict[str, float] = field(default_factory=dict)  # missing language: 1.0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> WorldKnobs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise KeyError(f"unknown synthetic knob(s) {unknown}; known: {sorted(known)}")
        values = dict(cfg)
        values["coverage"] = {
            str(k): float(v) for k, v in dict(values.get("coverage") or {}).items()
        }
        knobs = cls(**values)
        if not 1 <= knobs.num_shapes <= len(SHAPES) or not 1 <= knobs.num_colours <= len(COLOURS):
            raise ValueError(
                f"synthetic.num_shapes must be 1..{len(SHAPES)} and num_colours 1..{len(COLOURS)}"
            )
        if not 1 <= knobs.max_objects <= min(len(POSITIONS), knobs.num_shapes * knobs.num_colours):
            raise ValueError(
                f"synthetic.max_objects must be 1..{len(POSITIONS)} (one object per region)"
            )
        return knobs

    def clean(self) -> WorldKnobs:
        """The same world without its training-caption corruptions (translation noise, weak
        alignment). Its train captions are what the offline tokenizer learns, and so what the
        backbones are built on: those two knobs then change the training captions and nothing else."""
        return replace(self, mt_noise=0.0, weak_fraction=0.0)

    def size(self, split: str) -> int:
        return {
            "train": self.num_train,
            "val": self.num_val,
            "test": self.num_test,
            PRETRAIN: self.num_pretrain,
        }[split]


def world_dir(root: str | Path, knobs: WorldKnobs) -> Path:
    """Where the world for these knobs lives (under ``root``), whether built or not."""
    key = json.dumps(
        {"knobs": asdict(knobs), "languages": grammars.available(), "version": GENERATOR_VERSION},
        sort_keys=True,
    )
    return Path(root) / f"world-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_world(root: str | Path, knobs: WorldKnobs) -> Path:
    """Generate the world unless it is cached; returns its folder (``images/``, ``<split>.jsonl``)."""
    target = world_dir(root, knobs)
    if (target / "world.json").exists():
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "images").mkdir(parents=True)
    for split in SPLITS:
        records = [
            _make_record(knobs, split, i, staging / "images") for i in range(knobs.size(split))
        ]
        write_records(staging / f"{split}.jsonl", records)
    (staging / "world.json").write_text(
        json.dumps(
            {"knobs": asdict(knobs), "languages": grammars.available()},
            indent=1,
            sort_keys=True,
            allow_nan=False,
        )
    )
    try:
        os.replace(staging, target)
    except OSError:  # another process finished the same world first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_pretrain(world: Path, knobs: WorldKnobs) -> Path:
    """Generate the world's ``pretrain`` split unless it is cached, on first need (the backbones
    or the parallel corpus), so a world built only for retrieval never renders it. Returns its
    folder: ``images/``, ``pretrain.jsonl`` and ``parallel/<lang>.txt``."""
    target = Path(world) / PRETRAIN
    if (target / f"{PRETRAIN}.jsonl").exists():
        return target
    staging = target.with_name(f".{PRETRAIN}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "images").mkdir(parents=True)
    taken = {
        scene_key(Scene.from_json(r.extras["scene"]))
        for split in SPLITS
        for r in load_split(world, split)
    }
    pretrain = [
        _make_record(knobs, PRETRAIN, i, staging / "images", avoid=taken)
        for i in range(knobs.num_pretrain)
    ]
    _write_parallel_text(staging / PARALLEL_DIR, pretrain)
    write_records(staging / f"{PRETRAIN}.jsonl", pretrain)  # written last: marks it complete
    try:
        os.replace(staging, target)
    except OSError:  # another process finished it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_split(folder: str | Path, split: str) -> list[Record]:
    return read_records(Path(folder) / f"{split}.jsonl")


def parallel_text_dir(folder: str | Path) -> Path:
    """The world's parallel corpus: one ``<lang>.txt`` per language, line-aligned."""
    return Path(folder) / PARALLEL_DIR


def scene_key(scene: Scene) -> tuple:
    """What captions can say about a scene: its described objects and its background."""
    return (tuple(sorted(astuple(o) for o in scene.objects)), scene.background)


def _write_parallel_text(folder: Path, records: list[Record]) -> None:
    """Caption k of every pretrain record, one language per file (every file the same length)."""
    folder.mkdir()
    for code in grammars.available():
        lines = [text for record in records for text in record.captions[code]]
        (folder / f"{code}.txt").write_text(
            "".join(f"{line}\n" for line in lines), encoding="utf-8"
        )


def _make_record(
    knobs: WorldKnobs, split: str, index: int, image_dir: Path, avoid: set[tuple] = frozenset()
) -> Record:
    rng = random.Random(f"{knobs.seed}/{split}/{index}")
    for _ in range(MAX_SCENE_DRAWS):
        scene = sample_scene(
            rng,
            num_shapes=knobs.num_shapes,
            num_colours=knobs.num_colours,
            max_objects=knobs.max_objects,
            distractors=knobs.distractors,
            background_prob=knobs.background_prob,
        )
        if scene_key(scene) not in avoid:
            break
    else:
        raise ValueError(
            f"synthetic world: no {split} scene outside the retrieval splits after "
            f"{MAX_SCENE_DRAWS} draws; the knobs allow too few distinct scenes"
        )
    record_id = f"{split}-{index:05d}"
    render_scene(scene, knobs.render_size, rng).save(image_dir / f"{record_id}.png")
    training = split == "train"
    weak = training and len(scene.objects) > 1 and rng.random() < knobs.weak_fraction
    captions = _captions(scene, knobs, rng, weak=weak, noisy=training)
    if training:
        captions = _apply_coverage(captions, knobs.coverage, rng)
    extras = {
        "objects": [o.label for o in scene.objects],
        "scene": scene.to_json(),
        "alignment": "weak" if weak else "strict",
    }
    return Record(record_id, f"{record_id}.png", captions, extras)


def _captions(
    scene: Scene, knobs: WorldKnobs, rng: random.Random, *, weak: bool, noisy: bool
) -> dict[str, list[str]]:
    """Captions in every language. Strict scenes realise one shared set of plans in each language
    (translations); weak scenes give each language plans over its own random subset of objects."""
    shared = sample_plans(scene, scene.objects, knobs.captions_per_image, knobs.mention_prob, rng)
    shapes, colours = SHAPES[: knobs.num_shapes], COLOURS[: knobs.num_colours]
    captions = {}
    for code in grammars.available():
        plans = shared
        if weak:
            subset = tuple(rng.sample(scene.objects, rng.randint(1, len(scene.objects) - 1)))
            plans = sample_plans(scene, subset, knobs.captions_per_image, knobs.mention_prob, rng)
        texts = []
        for plan in plans:
            if noisy and code != ENGLISH and rng.random() < knobs.mt_noise:
                if rng.random() < 0.5:
                    plan = mistranslate(plan, shapes, colours, rng)
                texts.append(grammars.join(code, garble(grammars.grammar(code).words(plan), rng)))
            else:
                texts.append(grammars.realise(code, plan))
        captions[code] = texts
    return captions


def _apply_coverage(
    captions: dict[str, list[str]], coverage: dict[str, float], rng: random.Random
) -> dict[str, list[str]]:
    """Drop each language with probability 1 - coverage; a record always keeps its best-covered one."""
    kept = {
        code: texts for code, texts in captions.items() if rng.random() < coverage.get(code, 1.0)
    }
    if not kept:
        best = max(captions, key=lambda code: coverage.get(code, 1.0))
        kept = {best: captions[best]}
    return kept
