"""Score a pretrained dual encoder zero-shot with the suite's own evaluation and metrics.

    python -m experiments.external model=open_clip:xlm-roberta-large-ViT-H-14 \
        pretrained=frozen_laion5b_s13b_b90k data=xflickrco
    python -m experiments.external model=hf:BAAI/AltCLIP-m18 data=xflickrco

``model`` is ``open_clip:<arch>`` (with ``pretrained=<tag or weights file>``),
``open_clip:local-dir:<folder>`` / ``open_clip:hf-hub:<repo>`` (weights come with the config), or
``hf:<name or folder>`` for a Hugging Face model with ``get_image_features`` /
``get_text_features`` (CLIP, SigLIP, AltCLIP, Chinese-CLIP). Images go through the model's own
preprocessing and captions through its own tokenizer; the embeddings are scored by
``metrics.RetrievalEvaluation`` exactly as a trained method's are. The run folder
``<run_dir>/<data>/<model slug>/<run_id>/`` gets ``metrics.json`` (a leaderboard row marked
external, recording library, model and tag) and ``embeddings.pt`` (what ``experiments.report``
reads). Every other ``key=value`` is a run-config override (``data.root=...``,
``data.eval_batch_size=...``, ``evaluation.chunk_size=...``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader

import metrics
from datamodules.datamodule import CCRDataModule
from datamodules.synthetic import Scene, relevance_matrix
from experiments import cli
from experiments.config import ConfigError, compose
from experiments.report.evaluated import EMBEDDINGS, EvaluatedSet
from experiments.runs import claim_run_dir, run_record, strict_json, write_atomic
from methods.layers.encoders import load_state_dict_file

LIBRARIES = ("open_clip", "hf")
PROTOCOL = "zero-shot"
SCORER = "itc"
# NLLB tokenizers (open_clip's nllb-clip-*) mark the source language with a FLORES-200 code.
NLLB_CODES = {
    "en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn", "cs": "ces_Latn", "es": "spa_Latn",
    "id": "ind_Latn", "ja": "jpn_Jpan", "ru": "rus_Cyrl", "tr": "tur_Latn", "zh": "zho_Hans",
    "ko": "kor_Hang", "it": "ita_Latn", "pl": "pol_Latn", "vi": "vie_Latn", "th": "tha_Thai",
}


@dataclass(frozen=True)
class ModelSpec:
    """Which pretrained model: ``library`` (open_clip | hf), its ``name`` and weights ``pretrained``."""

    library: str
    name: str
    pretrained: str | None

    @classmethod
    def parse(cls, model: str, pretrained: str | None) -> "ModelSpec":
        library, sep, name = model.partition(":")
        if not sep or library not in LIBRARIES or not name:
            raise ConfigError(f"model={model!r}: expected open_clip:<arch> or hf:<name or path>")
        pretrained = pretrained or None
        schema = name.startswith(("local-dir:", "hf-hub:"))
        if library == "open_clip" and not schema and pretrained is None:
            raise ConfigError(f"model={model!r} needs pretrained=<tag or weights file>; without it "
                              "open_clip builds random weights")
        if (library == "hf" or schema) and pretrained is not None:
            raise ConfigError(f"model={model!r} brings its own weights; pretrained={pretrained!r} "
                              "would be ignored: leave it out")
        return cls(library, name, pretrained)

    @property
    def label(self) -> str:
        """The leaderboard's method name."""
        return f"{self.library}:{self.name}"

    @property
    def slug(self) -> str:
        """A folder name for the model and its weights."""
        parts = [self.library, Path(self.name.split(":")[-1]).name or self.name, self.pretrained or ""]
        text = "-".join(Path(p).name if p.endswith((".pt", ".bin", ".safetensors")) else p
                        for p in parts if p)
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


class DualEncoder(Protocol):
    """What scoring needs from a pretrained model; embeddings are float32 and L2-normalised."""

    def preprocess(self, images: list[Image.Image]) -> Tensor: ...
    def encode_images(self, pixels: Tensor) -> Tensor: ...
    def encode_texts(self, texts: list[str], language: str) -> Tensor: ...


class OpenClipEncoder:
    """An open_clip model with its evaluation transform and tokenizer."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        import open_clip

        weights = [Path(spec.pretrained)] if spec.pretrained and Path(spec.pretrained).is_file() else []
        if spec.name.startswith("local-dir:"):
            folder = Path(spec.name.removeprefix("local-dir:"))
            weights = sorted(f for p in ("*.safetensors", "*.bin", "*.pth") for f in folder.glob(p))
            if not weights:
                raise ConfigError(f"{folder} holds no open_clip weights (*.safetensors, *.bin, "
                                  "*.pth); open_clip would build random weights")
        for path in weights:  # open_clip reads them unchecked: a foreign or truncated file is named
            load_state_dict_file(path)
        self.model, _, self.transform = open_clip.create_model_and_transforms(
            spec.name, pretrained=spec.pretrained, device=device)
        self.model.eval()
        self.tokenizer = open_clip.get_tokenizer(spec.name)
        self.device = device

    def preprocess(self, images: list[Image.Image]) -> Tensor:
        return torch.stack([self.transform(image) for image in images])

    def encode_images(self, pixels: Tensor) -> Tensor:
        return F.normalize(self.model.encode_image(pixels.to(self.device)).float(), dim=-1)

    def encode_texts(self, texts: list[str], language: str) -> Tensor:
        if hasattr(self.tokenizer, "set_lang_fn"):  # NLLB: the language is part of the input
            if language not in NLLB_CODES:
                raise ConfigError(f"no NLLB language code known for '{language}' "
                                  f"(known: {', '.join(sorted(NLLB_CODES))})")
            self.tokenizer.set_language(NLLB_CODES[language])
        tokens = self.tokenizer(texts).to(self.device)
        return F.normalize(self.model.encode_text(tokens).float(), dim=-1)


class HfEncoder:
    """A Hugging Face model with ``get_image_features`` / ``get_text_features``, its image
    processor and tokenizer."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(spec.name).to(device).eval()
        if not all(hasattr(self.model, f) for f in ("get_image_features", "get_text_features")):
            raise ConfigError(f"hf:{spec.name} ({type(self.model).__name__}) is not a CLIP-style "
                              "dual encoder (no get_image_features / get_text_features)")
        self.processor = AutoImageProcessor.from_pretrained(spec.name)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.name)
        # Every caption is padded to the full length: its embedding then does not depend on the
        # batch it lands in (equal captions get equal embeddings, so their ties stay ties), and
        # SigLIP was trained that way.
        text_config = getattr(self.model.config, "text_config", self.model.config)
        limits = [self.tokenizer.model_max_length, getattr(text_config, "max_position_embeddings", None)]
        self.max_length = min(n for n in limits if isinstance(n, int) and 0 < n < 100_000)
        self.device = device

    def preprocess(self, images: list[Image.Image]) -> Tensor:
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def encode_images(self, pixels: Tensor) -> Tensor:
        return F.normalize(_features(self.model.get_image_features(pixel_values=pixels.to(self.device))), dim=-1)

    def encode_texts(self, texts: list[str], language: str) -> Tensor:
        batch = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length,
                               return_tensors="pt")
        inputs = {k: batch[k].to(self.device) for k in ("input_ids", "attention_mask") if k in batch}
        return F.normalize(_features(self.model.get_text_features(**inputs)), dim=-1)


def _features(output) -> Tensor:
    """Projected features: a tensor, or (transformers >= 5) the output's ``pooler_output``."""
    return (output if isinstance(output, Tensor) else output.pooler_output).float()


def load_encoder(spec: ModelSpec, device: torch.device) -> DualEncoder:
    """The model with its own preprocessing; a missing model or weights file is a one-line error."""
    try:
        return (OpenClipEncoder if spec.library == "open_clip" else HfEncoder)(spec, device)
    except (OSError, RuntimeError, KeyError) as err:
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(f"cannot load {spec.label}"
                          + (f" pretrained={spec.pretrained}" if spec.pretrained else "")
                          + f": {type(err).__name__}: {reason}") from None


class _OpenedImages:
    """Collate: open a batch of image files and run the model's preprocessing."""

    def __init__(self, encoder: DualEncoder):
        self.encoder = encoder

    def __call__(self, items: list[tuple[int, str]]) -> dict[str, Tensor]:
        images = []
        for _, path in items:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        return {"pixels": self.encoder.preprocess(images),
                "index": torch.tensor([i for i, _ in items], dtype=torch.long)}


@torch.no_grad()
def encode(encoder: DualEncoder, evaluated: EvaluatedSet, batch_size: int, num_workers: int,
           evaluation: metrics.RetrievalEvaluation) -> None:
    """Encode every image and caption into ``evaluation`` (by index) and into ``evaluated``."""
    loader = DataLoader(list(enumerate(evaluated.image_paths)), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=_OpenedImages(encoder))
    image_rows = []
    for batch in loader:
        emb = encoder.encode_images(batch["pixels"]).cpu()
        evaluation.update("images", batch["index"], emb)
        image_rows.append(emb)
    text_rows = []
    for lang in evaluated.languages:  # one language per batch: NLLB tokenizers need to know it
        rows = [i for i, caption_lang in enumerate(evaluated.caption_language) if caption_lang == lang]
        for start in range(0, len(rows), batch_size):
            index = rows[start:start + batch_size]
            emb = encoder.encode_texts([evaluated.captions[i] for i in index], lang).cpu()
            evaluation.update("captions", torch.tensor(index, dtype=torch.long), emb)
            text_rows.append((index, emb))
    evaluated.image_emb = torch.cat(image_rows)
    text_emb = torch.empty(len(evaluated.captions), evaluated.image_emb.shape[1])
    for index, emb in text_rows:
        text_emb[index] = emb
    evaluated.text_emb = text_emb


def read_test_set(cfg: DictConfig) -> tuple[EvaluatedSet, Tensor | None]:
    """The test split's records (read and validated as for training) and, for the synthetic world,
    its graded image relevance."""
    data = CCRDataModule(cfg.data, seed=cfg.seed)
    records = data.records("test")
    mrv = None if cfg.data.mrv_languages is None else [str(x) for x in cfg.data.mrv_languages]
    evaluated = EvaluatedSet.from_records(records, [str(x) for x in cfg.data.languages],
                                          data.image_root, mrv)
    relevance = None
    if records and all("scene" in r.extras for r in records):
        relevance = relevance_matrix([Scene.from_json(r.extras["scene"]) for r in records])
    return evaluated, relevance


def external_config(spec: ModelSpec, overrides: Sequence[str]) -> DictConfig:
    """The run configuration: the data preset and overrides, the model in the ``method`` section."""
    cfg = compose([*overrides, "method=clip"])  # the method preset is replaced below
    cfg.method = {"name": "external", "library": spec.library, "model": spec.name,
                  "pretrained": spec.pretrained}
    cfg.protocol = PROTOCOL
    cfg.preset.method = spec.slug  # the run folder: <run_dir>/<data>/<slug>/<run_id>
    return cfg


def score_external(spec: ModelSpec, overrides: Sequence[str] = (), device: str = "auto") -> Path:
    """Score ``spec`` on the configured test split; return the run folder it wrote."""
    cfg = external_config(spec, overrides)
    started = time.perf_counter()
    target = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    with claim_run_dir(cfg) as run_dir:
        evaluated, relevance = read_test_set(cfg)
        encoder = load_encoder(spec, target)
        evaluation = metrics.RetrievalEvaluation.from_config(cfg.evaluation, rerank_k=0)
        encode(encoder, evaluated, int(cfg.data.eval_batch_size), int(cfg.data.num_workers), evaluation)
        report = evaluation.compute(
            caption_image=evaluated.caption_image, caption_language=evaluated.caption_language,
            image_ids=evaluated.image_ids, image_relevance=relevance,
            mrv_languages=evaluated.mrv_languages)
        evaluated.save(run_dir / EMBEDDINGS)
        write_atomic(run_dir / "metrics.json", strict_json(external_record(
            cfg, spec, report, run_id=run_dir.name, device=str(target),
            wall_time_s=round(time.perf_counter() - started, 1))))
    print(f"metrics: {run_dir / 'metrics.json'}  mR={report['mR']:.2f}")
    return run_dir


def external_record(cfg: DictConfig, spec: ModelSpec, report: dict[str, float], **facts) -> dict:
    """``metrics.json`` of an external model: the fields every run records, plus ``external``."""
    return run_record(
        cfg, report, method=spec.label, protocol=PROTOCOL, scorer=SCORER, split="test",
        external={"library": spec.library, "model": spec.name, "pretrained": spec.pretrained},
        **facts,
    )


def _main(args: list[str]) -> None:
    options = {"model": None, "pretrained": None, "device": "auto"}
    rest = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in options:
            options[key] = value
        else:
            rest.append(arg)
    if not options["model"]:
        raise ConfigError("usage: python -m experiments.external model=open_clip:<arch> "
                          "pretrained=<tag> | model=hf:<name or path> [data=...] [key=value ...]")
    spec = ModelSpec.parse(options["model"], options["pretrained"])
    score_external(spec, rest, options["device"])


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
