"""Build the synthetic world's own pretrained backbones once and cache them, in the formats the
real loaders read: a Hugging Face folder (``text/``, loaded by ``hf:<path>``) holding a tiny XLM-R
and the data tokenizer, and a timm state dict (``image/model.pth``) of a tiny ViT.

Method presets name them ``world`` (``image_encoder.name: world``, ``text_encoder.name: world``);
RC3 names the world's tiny mBART (``method.backbone.pretrained: world``), built only when asked
for into its own folder ``<root>/seq2seq-<digest>/``. The data gives a handle
(``CCRDataModule.backbones``: what they learn from); :func:`with_backbones` turns it into the
``DataInfo.backbones`` a method reads, the settings each name resolves to (see
``ccr.methods.layers.encoders.resolve_world``), built on first look. The cache folder is
``<root>/backbones-<digest>/``, the digest covering the world, the tokenizer, the image settings
and the recipe; a finished build is moved into place atomically, like the world itself.

``make pretrain`` (``python -m ccr.experiments.pretrain [overrides]``) builds them ahead of a run; a
run builds them when they are missing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.seed import isolate_rng

from ccr.datamodules.datamodule import CCRDataModule, DataInfo
from ccr.datamodules.datasets import ImageTransform
from ccr.datamodules.records import Record
from ccr.datamodules.synthetic.source import WorldBackbones
from ccr.datamodules.tokenization import Tokenizer
from ccr.experiments.config import ConfigError, compose
from ccr.experiments.pretrain.image import ImageRecipe, pretrain_image
from ccr.experiments.pretrain.seq2seq import Seq2SeqRecipe, pretrain_seq2seq
from ccr.experiments.pretrain.text import TextRecipe, pretrain_text

BACKBONES_VERSION = 1
TEXT_DIR, IMAGE_FILE, SUMMARY, SEQ2SEQ_DIR = "text", "image/model.pth", "backbones.json", "seq2seq"
SEQ2SEQ_VERSION = 1
# torch's intra-op threads while building: a float sum splits over threads, so the weights depend
# on their count. One thread is what a run's lazy build has always used (the CPU preset's
# cpu_threads=1), so every build path and machine builds the same weights (docs/reproducibility.md).
BUILD_THREADS = 1


@dataclass(frozen=True)
class BackboneRecipe:
    """``data.backbones``: how the backbones are built (architecture, steps, seed)."""

    seed: int = 0
    text: TextRecipe = TextRecipe()
    image: ImageRecipe = ImageRecipe()
    seq2seq: Seq2SeqRecipe = Seq2SeqRecipe()  # optional in the config: RC3's world mBART

    def encoders(self) -> dict:
        """The part of the recipe the text and image encoders' build depends on."""
        return {k: v for k, v in asdict(self).items() if k != "seq2seq"}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> BackboneRecipe:
        def build(kind, values: Mapping[str, Any], where: str):
            known = {f.name for f in fields(kind)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise KeyError(f"unknown key(s) {unknown} in {where}; known: {sorted(known)}")
            return kind(**values)

        values = dict(cfg)
        text = build(TextRecipe, values.pop("text", {}) or {}, "data.backbones.text")
        image = build(ImageRecipe, values.pop("image", {}) or {}, "data.backbones.image")
        seq2seq = build(Seq2SeqRecipe, values.pop("seq2seq", {}) or {}, "data.backbones.seq2seq")
        return build(
            cls, {**values, "text": text, "image": image, "seq2seq": seq2seq}, "data.backbones"
        )


class LazyBackbones(Mapping):
    """``DataInfo.backbones``: the settings per backbone (``text``, ``image``, ``seq2seq``), each
    built (or read from the cache) on first look, so a run that never names ``world`` never pays
    for a build, and one that names only the world mBART never builds the encoders. A copy (as a
    checkpoint's hyper-parameters take) is a plain dict of what was built, and never builds."""

    def __init__(self, builders: Mapping[str, Callable[[], dict]]):
        self._builders = dict(builders)
        self._specs: dict[str, dict] = {}

    def __getitem__(self, key: str) -> dict:
        if key not in self._specs:
            self._specs[key] = self._builders[key]()
        return self._specs[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)

    def __deepcopy__(self, memo) -> dict[str, dict]:
        return json.loads(json.dumps(self._specs))


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """Identity of the tokenizer the text backbone's vocabulary follows: its serialised form
    without the padding and truncation settings, which tokenising a batch changes in place."""
    raw = getattr(tokenizer, "raw", None)
    if raw is None:
        text = str(cast(Any, tokenizer).hf.name_or_path)  # a Hugging Face tokenizer
    else:
        state = {
            k: v for k, v in json.loads(raw.to_str()).items() if k not in ("padding", "truncation")
        }
        text = json.dumps(state, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def backbone_dir(
    root: str | Path,
    world: Path,
    tokenizer: Tokenizer,
    settings: Mapping[str, Any],
    recipe: BackboneRecipe,
) -> Path:
    """Where the backbones for this world, tokenizer, data settings (languages, image size and
    normalisation, max length) and recipe live."""
    key = json.dumps(
        {
            "world": Path(world).name,
            "tokenizer": tokenizer_digest(tokenizer),
            "settings": dict(settings),
            "recipe": recipe.encoders(),
            "version": BACKBONES_VERSION,
        },
        sort_keys=True,
    )
    return Path(root) / f"backbones-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def seq2seq_dir(
    root: str | Path,
    world: Path,
    tokenizer: Tokenizer,
    settings: Mapping[str, Any],
    recipe: BackboneRecipe,
) -> Path:
    """Where the world mBART for this world, tokenizer, languages, max length and recipe lives."""
    key = json.dumps(
        {
            "world": Path(world).name,
            "tokenizer": tokenizer_digest(tokenizer),
            "settings": dict(settings),
            "recipe": asdict(recipe.seq2seq),
            "seed": recipe.seed,
            "version": SEQ2SEQ_VERSION,
        },
        sort_keys=True,
    )
    return Path(root) / f"seq2seq-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def seq2seq_spec(folder: Path) -> dict:
    """What ``method.backbone.pretrained: world`` resolves to (RC3)."""
    return {"pretrained": str((folder / SEQ2SEQ_DIR).resolve())}


def build_seq2seq(
    target: Path,
    records: list[Record],
    languages: list[str],
    tokenizer: Tokenizer,
    max_length: int,
    recipe: BackboneRecipe,
) -> Path:
    """Pretrain the world mBART on ``records`` unless ``target`` holds it (like
    :func:`build_backbones`, through :func:`build_once`)."""

    def build(staging: Path) -> dict:
        model, loss = pretrain_seq2seq(
            records, languages, tokenizer, max_length, recipe.seq2seq, recipe.seed
        )
        model.save_pretrained(staging / SEQ2SEQ_DIR)
        save_tokenizer(tokenizer, staging / SEQ2SEQ_DIR)
        return {
            "recipe": asdict(recipe.seq2seq),
            "seed": recipe.seed,
            "languages": languages,
            "pretrain_records": len(records),
            "denoising_loss": round(loss, 4),
        }

    return build_once(target, build)


def build_once(target: Path, build: Callable[[Path], dict]) -> Path:
    """``target`` as a finished build: ``build(staging)`` writes a fresh staging folder and returns
    its summary, which lands in ``SUMMARY`` (with the build's seconds) before the folder is moved
    into place atomically; a folder that already has its summary is a cache hit. The build runs
    on its own seed and leaves the global random state as it found it: a run builds lazily after
    seeding, and the run that builds must train exactly as every run that hits the cache. It
    builds on ``BUILD_THREADS`` threads whatever the caller's count (``make pretrain`` or a run's
    preset), so the cache holds the same weights whoever built it."""
    if (target / SUMMARY).exists():
        return target
    with isolate_rng(), threads(BUILD_THREADS):
        started = time.perf_counter()
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        summary = {
            **build(staging),
            "threads": BUILD_THREADS,
            "total_seconds": round(time.perf_counter() - started, 1),
        }
        (staging / SUMMARY).write_text(json.dumps(summary, indent=1, sort_keys=True))
        try:
            os.replace(staging, target)
        except OSError:  # another process finished the same build first
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` within, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def encoder_specs(folder: Path, recipe: BackboneRecipe, image_size: int) -> dict[str, dict]:
    """The encoder settings ``name: world`` resolves to (``DataInfo.backbones``)."""
    return {
        "text": {"name": f"hf:{(folder / TEXT_DIR).resolve()}", "pretrained": True},
        "image": {
            "name": f"timm:{recipe.image.model}",
            "pretrained": str((folder / IMAGE_FILE).resolve()),
            "options": recipe.image.timm_options(image_size),
        },
    }


def build_backbones(
    target: Path,
    records: list[Record],
    languages: list[str],
    tokenizer: Tokenizer,
    max_length: int,
    image_root: Path,
    transform: ImageTransform,
    recipe: BackboneRecipe,
    check: list[Record] | None = None,
) -> Path:
    """Pretrain both backbones on ``records`` (the world's pretrain split) unless ``target`` holds
    them (:func:`build_once`); ``check`` (e.g. the val split) measures the text encoder's
    translation preference."""

    def build(staging: Path) -> dict:
        started = time.perf_counter()
        (staging / "image").mkdir()
        text_model, mlm_loss = pretrain_text(
            records, languages, tokenizer, max_length, recipe.text, recipe.seed
        )
        text_seconds = time.perf_counter() - started
        text_model.roberta.save_pretrained(staging / TEXT_DIR)
        save_tokenizer(tokenizer, staging / TEXT_DIR)
        image_model, f1 = pretrain_image(records, image_root, transform, recipe.image, recipe.seed)
        torch.save(image_model.state_dict(), staging / IMAGE_FILE)
        summary = {
            "recipe": recipe.encoders(),
            "languages": languages,
            "pretrain_records": len(records),
            "text_mlm_loss": round(mlm_loss, 4),
            "image_label_f1": round(f1, 4),
            "text_seconds": round(text_seconds, 1),
        }
        if check and "en" in languages and len(languages) > 1:
            summary["translation_preference"] = round(
                translation_preference(text_model.roberta, tokenizer, check, languages, max_length),
                4,
            )
        return summary

    return build_once(target, build)


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """Save the offline tokenizer beside the model, so the folder is a complete HF checkpoint."""
    raw = getattr(tokenizer, "raw", None)
    if raw is None:
        return
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        cls_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    ).save_pretrained(folder)


def mean_states(
    model: torch.nn.Module, tokenizer: Tokenizer, texts: list[str], max_length: int
) -> torch.Tensor:
    """L2-normalised mean of the last hidden states over each text's tokens."""
    tokens = tokenizer(texts, max_length)
    with torch.no_grad():
        states = model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
        ).last_hidden_state
    mask = tokens["attention_mask"].unsqueeze(-1).float()
    return F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)


def translation_preference(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    records: list[Record],
    languages: list[str],
    max_length: int,
    seed: int = 0,
) -> float:
    """Share of (English caption, other language) cases where the caption's own translation is
    nearer (cosine of mean states) than a random caption of another scene in that language.
    0.5 is chance; a model that ignores the text cannot beat it."""
    rng = random.Random(seed)
    anchors = [r.captions["en"][0] for r in records]
    query = mean_states(model, tokenizer, anchors, max_length)
    wins, total = 0, 0
    for lang in languages:
        if lang == "en":
            continue
        own = mean_states(model, tokenizer, [r.captions[lang][0] for r in records], max_length)
        others = [
            rng.choice([j for j in range(len(records)) if j != i]) for i in range(len(records))
        ]
        wins += int(((query * own).sum(1) > (query * own[others]).sum(1)).sum())
        total += len(records)
    return wins / max(total, 1)


def world_encoders(world: WorldBackbones) -> dict[str, dict]:
    """The world's tiny XLM-R and ViT (``name: world``), built unless cached."""
    recipe = BackboneRecipe.from_config(world.recipe)
    target = backbone_dir(
        world.root, world.world, world.tokenizer, world.encoder_settings(), recipe
    )
    if not (target / SUMMARY).exists():
        rank_zero_info(f"building the world's pretrained backbones in {target}")
        build_backbones(
            target,
            world.pretrain_records(),
            world.languages,
            world.tokenizer,
            world.max_length,
            world.pretrain_split() / "images",
            world.image_transform(),
            recipe,
            check=world.check_records(),
        )
    return encoder_specs(target, recipe, world.image_size)


def world_seq2seq(world: WorldBackbones) -> dict:
    """The world's tiny mBART (RC3's ``backbone.pretrained: world``), on the encoders' seed,
    built unless cached."""
    recipe = BackboneRecipe.from_config(world.recipe)
    target = seq2seq_dir(world.root, world.world, world.tokenizer, world.seq2seq_settings(), recipe)
    if not (target / SUMMARY).exists():
        rank_zero_info(f"building the world's pretrained mBART in {target}")
        build_seq2seq(
            target,
            world.pretrain_records(),
            world.languages,
            world.tokenizer,
            world.max_length,
            recipe,
        )
    return seq2seq_spec(target)


def world_backbones(world: WorldBackbones | None) -> Mapping[str, dict]:
    """``DataInfo.backbones`` for this handle: each backbone's settings, built (or read from the
    cache) on first look; empty without a handle (real data, ``data.backbones: null``)."""
    if world is None:
        return {}
    encoders = functools.cache(lambda: world_encoders(world))
    return LazyBackbones(
        {
            "text": lambda: encoders()["text"],
            "image": lambda: encoders()["image"],
            "seq2seq": lambda: world_seq2seq(world),
        }
    )


def with_backbones(data: CCRDataModule) -> DataInfo:
    """What a method is built from: the data's ``info`` with the backbones its handle names."""
    return replace(data.info, backbones=world_backbones(data.backbones))


def main(argv: Sequence[str] | None = None) -> None:
    """``make pretrain``: build the default world, its tokenizer and its backbones."""
    try:
        cfg = compose(["data=synthetic", *(sys.argv[1:] if argv is None else argv)])
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    data = CCRDataModule(cfg.data, seed=cfg.seed)
    data.prepare_data()
    data.setup("fit")
    for kind, spec in world_backbones(data.backbones).items():
        print(
            f"{kind}: {spec.get('name', 'mBART')}"
            + (f" (weights {spec['pretrained']})" if isinstance(spec["pretrained"], str) else "")
        )
