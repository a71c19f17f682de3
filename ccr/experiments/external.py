"""Score a pretrained dual encoder zero-shot with the suite's own evaluation and metrics.

    python -m ccr.experiments.external model=open_clip:xlm-roberta-large-ViT-H-14 \
        pretrained=frozen_laion5b_s13b_b90k data=xflickrco
    python -m ccr.experiments.external model=hf:BAAI/AltCLIP-m18 data=xflickrco

``model`` is ``zoo:<name>`` (an entry of ccr/experiments/configs/zoo/, see ccr/experiments/zoo.py),
``open_clip:<arch>`` (with ``pretrained=<tag or weights file>``),
``open_clip:local-dir:<folder>`` / ``open_clip:hf-hub:<repo>`` (weights come with the config), or
``hf:<name or folder>`` for a Hugging Face model with ``get_image_features`` /
``get_text_features`` (CLIP, SigLIP, AltCLIP, Chinese-CLIP, MetaCLIP 2); ``revision=<commit>``
pins a hub model, and ``remote_code=true`` (only with a revision) runs modelling code the model
ships (jina-clip-v2). Images go through the model's own
preprocessing and captions through its own tokenizer; the embeddings are scored by
``metrics.RetrievalEvaluation`` exactly as a trained method's are. The run folder
``<run_dir>/<data>/<model slug>/<run_id>/`` gets ``metrics.json`` (a leaderboard row marked
external, recording library, model, tag, revision, whether remote code ran and the batch-size
check of :func:`batch_invariance`) and ``embeddings.pt`` (what ``ccr.experiments.report``
reads). Every other ``key=value`` is a run-config override (``data.root=...``,
``data.eval_batch_size=...``, ``evaluation.chunk_size=...``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader

from ccr import metrics
from ccr.datamodules.datamodule import CCRDataModule
from ccr.experiments import cli, zoo
from ccr.experiments.config import ConfigError, compose
from ccr.experiments.report.evaluated import EMBEDDINGS, EvaluatedSet
from ccr.experiments.runs import claim_run_dir, run_record, strict_json, write_atomic
from ccr.experiments.zoo import ZooEntry
from ccr.methods.layers import pretrained_dual
from ccr.methods.layers.pretrained_dual import DualSpec, PretrainedModelError

PROTOCOL = "zero-shot"
SCORER = "itc"
# The batch-size check: this many images and captions are encoded again one at a time, and their
# embeddings must equal the full-batch ones to this absolute tolerance (unit vectors, float32).
INVARIANCE_SUBSET = 16
INVARIANCE_BATCH = 1
INVARIANCE_ATOL = 1e-4


@dataclass(frozen=True)
class ModelSpec:
    """Which pretrained model: ``library`` (open_clip | hf), its ``name``, the open_clip weights
    ``pretrained``, the hub ``revision``, whether its own modelling code runs (``remote_code``),
    and the ``zoo`` entry it came from, if any."""

    library: str
    name: str
    pretrained: str | None
    revision: str | None = None
    remote_code: bool = False
    text_length: int | None = None
    zoo: str | None = None
    image_model: str | None = None

    @classmethod
    def parse(
        cls,
        model: str,
        pretrained: str | None,
        revision: str | None = None,
        remote_code: bool = False,
    ) -> ModelSpec:
        pretrained, revision = pretrained or None, revision or None
        if model.startswith(zoo.PREFIX):
            if pretrained is not None or remote_code:
                raise ConfigError(
                    f"model={model!r}: a zoo entry sets its own weights and loader; "
                    "leave pretrained= and remote_code= out"
                )
            return cls.from_zoo(zoo.entry(model.removeprefix(zoo.PREFIX)), revision)
        library, sep, name = model.partition(":")
        if not sep or library not in ("open_clip", "hf") or not name:
            raise ConfigError(
                f"model={model!r}: expected open_clip:<arch>, hf:<name or path> or zoo:<name>"
            )
        schema = name.startswith(("local-dir:", "hf-hub:"))
        if library == "open_clip" and not schema and pretrained is None:
            raise ConfigError(
                f"model={model!r} needs pretrained=<tag or weights file>; without it "
                "open_clip builds random weights"
            )
        if (library == "hf" or schema) and pretrained is not None:
            raise ConfigError(
                f"model={model!r} brings its own weights; pretrained={pretrained!r} "
                "would be ignored: leave it out"
            )
        if library == "open_clip" and revision is not None:
            raise ConfigError(
                f"model={model!r}: revision= pins a Hugging Face model; open_clip "
                "resolves its tags itself"
            )
        spec = cls(library, name, pretrained, revision, remote_code)
        spec.to_dual()  # the remote-code rule: a one-line error before anything loads
        return spec

    @classmethod
    def from_zoo(cls, entry: ZooEntry, revision: str | None = None) -> ModelSpec:
        dual = entry.spec(revision)
        return cls(
            dual.library,
            dual.model,
            dual.pretrained,
            dual.revision,
            dual.remote_code,
            dual.text_length,
            zoo=entry.name,
            image_model=dual.image_model,
        )

    def to_dual(self) -> DualSpec:
        """The loading settings (a one-line error for remote code without a revision)."""
        try:
            return DualSpec(
                self.library,
                self.name,
                self.pretrained,
                self.revision,
                self.remote_code,
                self.text_length,
                self.image_model,
            )
        except PretrainedModelError as err:
            raise ConfigError(str(err)) from None

    @property
    def label(self) -> str:
        """The leaderboard's method name."""
        return f"{zoo.PREFIX}{self.zoo}" if self.zoo else f"{self.library}:{self.name}"

    @property
    def slug(self) -> str:
        """A folder name for the model and its weights."""
        if self.zoo:
            return re.sub(r"[^A-Za-z0-9._-]+", "-", f"zoo-{self.zoo}").strip("-")
        parts = [
            self.library,
            Path(self.name.split(":")[-1]).name or self.name,
            self.pretrained or "",
        ]
        text = "-".join(
            Path(p).name if p.endswith((".pt", ".bin", ".safetensors")) else p for p in parts if p
        )
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


class DualEncoder(Protocol):
    """What scoring needs from a pretrained model; embeddings are float32 and L2-normalised."""

    def preprocess(self, images: list[Image.Image]) -> Tensor: ...
    def encode_images(self, pixels: Tensor) -> Tensor: ...
    def encode_texts(self, texts: list[str], language: str | None) -> Tensor: ...


class PretrainedEncoder:
    """A pretrained dual encoder with its own preprocessing and tokenizer, through the same towers
    a fine-tuning run starts from (``ccr.methods.layers.pretrained_dual``)."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        model, self.io = pretrained_dual.load_dual(spec.to_dual())
        self.model = model.to(device)
        self.revision = pretrained_dual.resolved_revision(model) or spec.revision
        self.image = pretrained_dual.ImageTower(self.model, spec.library)
        self.text = pretrained_dual.TextTower(self.model, spec.library, self.io.uses_mask)
        self.device = device

    def preprocess(self, images: list[Image.Image]) -> Tensor:
        return self.io.preprocess(images)

    def encode_images(self, pixels: Tensor) -> Tensor:
        return F.normalize(self.image(pixels.to(self.device)).float(), dim=-1)

    def encode_texts(self, texts: list[str], language: str | None) -> Tensor:
        tokens = self.io.tokenize(texts, language)
        return F.normalize(
            self.text(
                tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
            ).float(),
            dim=-1,
        )


def load_encoder(spec: ModelSpec, device: torch.device) -> PretrainedEncoder:
    """The model with its own preprocessing; a missing model or weights file is a one-line error."""
    try:
        return PretrainedEncoder(spec, device)
    except PretrainedModelError as err:
        raise ConfigError(str(err)) from None
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"cannot load {spec.label}"
            + (f" pretrained={spec.pretrained}" if spec.pretrained else "")
            + f": {type(err).__name__}: {reason}"
        ) from None


class _OpenedImages:
    """Collate: open a batch of image files and run the model's preprocessing."""

    def __init__(self, encoder: DualEncoder):
        self.encoder = encoder

    def __call__(self, items: list[tuple[int, str]]) -> dict[str, Tensor]:
        images = []
        for _, path in items:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        return {
            "pixels": self.encoder.preprocess(images),
            "index": torch.tensor([i for i, _ in items], dtype=torch.long),
        }


@torch.no_grad()
def encode(
    encoder: DualEncoder,
    evaluated: EvaluatedSet,
    batch_size: int,
    num_workers: int,
    evaluation: metrics.RetrievalEvaluation,
) -> None:
    """Encode every image and caption into ``evaluation`` (by index) and into ``evaluated``."""
    # torch's stub asks for a Dataset; a list is the map-style dataset DataLoader documents.
    items = list(enumerate(evaluated.image_paths))
    loader: DataLoader[tuple[int, str]] = DataLoader(
        items,  # type: ignore[arg-type]
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=_OpenedImages(encoder),
    )
    image_rows = []
    for batch in loader:
        emb = encoder.encode_images(batch["pixels"]).cpu()
        evaluation.update("images", batch["index"], emb)
        image_rows.append(emb)
    text_rows = []
    for lang in evaluated.languages:  # one language per batch: NLLB tokenizers need to know it
        rows = [
            i for i, caption_lang in enumerate(evaluated.caption_language) if caption_lang == lang
        ]
        for start in range(0, len(rows), batch_size):
            index = rows[start : start + batch_size]
            emb = encoder.encode_texts([evaluated.captions[i] for i in index], lang).cpu()
            evaluation.update("captions", torch.tensor(index, dtype=torch.long), emb)
            text_rows.append((index, emb))
    evaluated.image_emb = torch.cat(image_rows)
    text_emb = torch.empty(len(evaluated.captions), evaluated.image_emb.shape[1])
    for index, emb in text_rows:
        text_emb[index] = emb
    evaluated.text_emb = text_emb


@torch.no_grad()
def batch_invariance(encoder: DualEncoder, evaluated: EvaluatedSet, batch_size: int) -> dict:
    """Encode the first images and captions again ``INVARIANCE_BATCH`` at a time and compare them
    with their full-batch embeddings: a model whose embedding of an item depends on the batch it
    lands in (batch statistics, padding to the longest caption) fails, and its row says so."""
    images = list(range(min(INVARIANCE_SUBSET, len(evaluated.image_paths))))
    language = evaluated.languages[0] if evaluated.languages else None
    captions = [i for i, lang in enumerate(evaluated.caption_language) if lang == language]
    captions = captions[:INVARIANCE_SUBSET]
    opened = _OpenedImages(encoder)
    image_emb, text_emb = evaluated.embeddings()
    diffs = []
    for start in range(0, len(images), INVARIANCE_BATCH):
        chunk = images[start : start + INVARIANCE_BATCH]
        pixels = opened([(i, evaluated.image_paths[i]) for i in chunk])["pixels"]
        diffs.append((encoder.encode_images(pixels).cpu() - image_emb[chunk]).abs().max())
    for start in range(0, len(captions), INVARIANCE_BATCH):
        chunk = captions[start : start + INVARIANCE_BATCH]
        emb = encoder.encode_texts([evaluated.captions[i] for i in chunk], language).cpu()
        diffs.append((emb - text_emb[chunk]).abs().max())
    worst = torch.stack(diffs).max().item() if diffs else 0.0
    invariant = bool(worst <= INVARIANCE_ATOL)  # NaN (a batch of one under batch statistics) fails
    return {
        "batch_sizes": [batch_size, INVARIANCE_BATCH],
        "images": len(images),
        "captions": len(captions),
        "max_abs_diff": None if math.isnan(worst) else worst,
        "tolerance": INVARIANCE_ATOL,
        "invariant": invariant,
    }


def read_test_set(cfg: DictConfig) -> tuple[EvaluatedSet, Tensor | None]:
    """The test split's records (read and validated as for training) and, for the synthetic world,
    its graded image relevance."""
    data = CCRDataModule(cfg.data, seed=cfg.seed, eval_max_images=cfg.evaluation.max_images)
    records = data.records("test")
    mrv = None if cfg.data.mrv_languages is None else [str(x) for x in cfg.data.mrv_languages]
    evaluated = EvaluatedSet.from_records(
        records, [str(x) for x in cfg.data.languages], data.image_root, mrv
    )
    return evaluated, data.relevance("test")


def external_config(spec: ModelSpec, overrides: Sequence[str]) -> DictConfig:
    """The run configuration: the data preset and overrides, the model in the ``method`` section."""
    cfg = compose([*overrides, "method=clip"])  # the method preset is replaced below
    cfg.method = {
        "name": "external",
        "library": spec.library,
        "model": spec.name,
        "pretrained": spec.pretrained,
        "revision": spec.revision,
        "remote_code": spec.remote_code,
        "text_length": spec.text_length,
        "zoo": spec.zoo,
        "image_model": spec.image_model,
    }
    cfg.protocol = PROTOCOL
    cfg.preset.method = spec.slug  # the run folder: <run_dir>/<data>/<slug>/<run_id>
    return cfg


def score_external(spec: ModelSpec, overrides: Sequence[str] = (), device: str = "auto") -> Path:
    """Score ``spec`` on the configured test split; return the run folder it wrote."""
    cfg = external_config(spec, overrides)
    started = time.perf_counter()
    target = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    with claim_run_dir(cfg) as run_dir:
        evaluated, relevance = read_test_set(cfg)
        encoder = load_encoder(spec, target)
        truth = metrics.GroundTruth(
            caption_image=evaluated.caption_image,
            caption_language=evaluated.caption_language,
            image_ids=evaluated.image_ids,
            image_relevance=relevance,
            mrv_languages=evaluated.mrv_languages,
        )
        evaluation = metrics.RetrievalEvaluation.from_config(cfg.evaluation, truth, rerank_k=0)
        batch_size = int(cfg.data.eval_batch_size)
        encode(encoder, evaluated, batch_size, int(cfg.data.num_workers), evaluation)
        report = evaluation.compute()
        invariance = batch_invariance(encoder, evaluated, batch_size)
        evaluated.save(run_dir / EMBEDDINGS)
        write_atomic(
            run_dir / "metrics.json",
            strict_json(
                external_record(
                    cfg,
                    spec,
                    report,
                    revision=encoder.revision,
                    batch_invariance=invariance,
                    run_id=run_dir.name,
                    device=str(target),
                    wall_time_s=round(time.perf_counter() - started, 1),
                )
            ),
        )
    print(f"metrics: {run_dir / 'metrics.json'}  mR={report['mR']:.2f}")
    if not invariance["invariant"]:
        print(
            f"warning: {spec.label} embeds an item differently in a batch of {batch_size} and "
            f"alone (max difference {invariance['max_abs_diff']}); its row is marked batch-dependent"
        )
    return run_dir


def external_record(
    cfg: DictConfig,
    spec: ModelSpec,
    report: dict[str, float],
    *,
    revision: str | None,
    batch_invariance: dict,
    **facts,
) -> dict:
    """``metrics.json`` of an external model: the fields every run records, plus ``external``
    (library, model, weights tag, the hub commit loaded, whether its own code ran, the zoo entry,
    the evaluation batch sizes and the batch-size check)."""
    return run_record(
        cfg,
        report,
        method=spec.label,
        protocol=PROTOCOL,
        scorer=SCORER,
        split="test",
        external={
            "library": spec.library,
            "model": spec.name,
            "pretrained": spec.pretrained,
            "revision": revision,
            "remote_code": spec.remote_code,
            "zoo": spec.zoo,
            "image_model": spec.image_model,
            "batch_invariance": batch_invariance,
        },
        **facts,
    )


def _main(args: list[str]) -> None:
    options: dict[str, str | None] = {
        "model": None,
        "pretrained": None,
        "revision": None,
        "remote_code": "false",
        "device": "auto",
    }
    rest = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in options:
            options[key] = value
        else:
            rest.append(arg)
    model = options["model"]
    if not model:
        raise ConfigError(
            "usage: python -m ccr.experiments.external model=open_clip:<arch> "
            "pretrained=<tag> | model=hf:<name or path> [revision=<commit> "
            "remote_code=true] | model=zoo:<name> [data=...] [key=value ...]"
        )
    if options["remote_code"] not in ("true", "false"):
        raise ConfigError(f"remote_code={options['remote_code']!r}: expected true or false")
    spec = ModelSpec.parse(
        model,
        options["pretrained"],
        options["revision"],
        options["remote_code"] == "true",
    )
    score_external(spec, rest, options["device"] or "auto")


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
