"""Pretrained dual encoders (open_clip and Hugging Face CLIP-style models) split into their image and
text towers, with the model's own image preprocessing and tokenizer.

One loading path serves both zero-shot scoring (``ccr/experiments/external.py``) and fine-tuning (the
``pretrained`` encoder backend of ``ccr/methods/layers/encoders.py``), so a fine-tuned run starts from
exactly the model its external row scored: the same weights, the same preprocessing, the same
tokenisation, the same projection.

A :class:`DualSpec` names the model: ``library`` (open_clip | hf | mclip), ``model`` (an open_clip
arch, ``local-dir:``/``hf-hub:`` folder, or a Hugging Face name or folder; for mclip the M-CLIP text
encoder), the open_clip ``pretrained`` tag or weights file (for mclip: of its open_clip
``image_model``), the hub ``revision`` (a commit), ``remote_code`` (run the modelling code the
model ships: only with a 40-hex ``revision``) and ``text_length`` (the caption length; default: the
model's own).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

LIBRARIES = ("open_clip", "hf", "mclip")
COMMIT = re.compile(r"[0-9a-f]{40}")
# NLLB tokenizers (open_clip's nllb-clip-*) mark the source language with a FLORES-200 code.
NLLB_CODES = {
    "en": "eng_Latn",
    "de": "deu_Latn",
    "fr": "fra_Latn",
    "cs": "ces_Latn",
    "es": "spa_Latn",
    "id": "ind_Latn",
    "ja": "jpn_Jpan",
    "ru": "rus_Cyrl",
    "tr": "tur_Latn",
    "zh": "zho_Hans",
    "ko": "kor_Hang",
    "it": "ita_Latn",
    "pl": "pol_Latn",
    "vi": "vie_Latn",
    "th": "tha_Thai",
}
# Which top-level children and parameters a tower keeps (the rest is dropped, so no parameter goes
# unused under DDP): HF CLIP-style models name theirs vision_model / visual_projection /
# text_model / text_projection, open_clip keeps its image tower in ``visual``.
IMAGE_PARTS = ("vision", "visual", "image")
TEXT_PARTS = ("text",)
OPEN_CLIP_SHARED = ("logit_scale", "logit_bias")


class PretrainedModelError(ValueError):
    """A pretrained model that cannot be used as asked (one line, naming the model)."""


@dataclass(frozen=True)
class DualSpec:
    library: str
    model: str
    pretrained: str | None = None
    revision: str | None = None
    remote_code: bool = False
    text_length: int | None = None
    image_model: str | None = None

    def __post_init__(self):
        if self.library not in LIBRARIES:
            raise PretrainedModelError(f"library {self.library!r}: expected one of {LIBRARIES}")
        if self.revision is not None and not COMMIT.fullmatch(self.revision):
            raise PretrainedModelError(
                f"{self.label}: revision {self.revision!r} is not a commit "
                "hash (40 lower-case hex digits)"
            )
        if self.library == "open_clip" and self.revision is not None:
            raise PretrainedModelError(
                f"{self.label}: revision= pins a Hugging Face model; open_clip downloads "
                "its tag's weights itself, unpinned (a revision would be recorded, not applied)"
            )
        if (self.library == "mclip") != (self.image_model is not None):
            raise PretrainedModelError(
                f"{self.label}: image_model names the open_clip image tower "
                "of an M-CLIP text encoder, and only of one"
            )
        if self.remote_code and self.library != "hf":
            raise PretrainedModelError(f"{self.label}: remote code is a Hugging Face option")
        if self.remote_code and self.revision is None:
            raise PretrainedModelError(
                f"{self.label} runs modelling code from its repository: pin it with "
                "revision=<40-hex commit> (the code that runs is then the code of that commit)"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DualSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise PretrainedModelError(
                f"pretrained model settings: unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(
            **{
                k: (
                    str(v)
                    if k in ("model", "pretrained", "revision", "image_model") and v is not None
                    else v
                )
                for k, v in values.items()
            }
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def label(self) -> str:
        return f"{self.library}:{self.model}"


@dataclass
class PretrainedIO:
    """The model's own image preprocessing (PIL images -> pixels) and tokenizer."""

    spec: DualSpec
    transform: Any  # open_clip: a torchvision transform per image; hf: an image processor
    tokenizer: Any
    text_length: int

    def preprocess(self, images: list[Image.Image]) -> Tensor:
        if self.spec.library in (
            "open_clip",
            "mclip",
        ):  # open_clip's transform, one image at a time
            return torch.stack([self.transform(image) for image in images])
        return self.transform(images=images, return_tensors="pt")["pixel_values"]

    def tokenize(self, texts: list[str], language: str | None) -> dict[str, Tensor]:
        """``{"input_ids", "attention_mask"}`` of ``texts``, every caption padded to the model's
        full text length: an embedding then does not depend on the batch it lands in."""
        if self.spec.library == "open_clip":
            if hasattr(self.tokenizer, "set_lang_fn"):  # NLLB: the language is part of the input
                if language is None:
                    raise PretrainedModelError(
                        f"{self.spec.label} needs each caption's language (an NLLB tokenizer); "
                        "training batches mix languages, so it can be scored but not fine-tuned"
                    )
                if language not in NLLB_CODES:
                    raise PretrainedModelError(
                        f"no NLLB language code known for '{language}' "
                        f"(known: {', '.join(sorted(NLLB_CODES))})"
                    )
                self.tokenizer.set_language(NLLB_CODES[language])
            ids = self.tokenizer(texts).long()
            return {"input_ids": ids, "attention_mask": (ids != self.pad_token_id).long()}
        batch = self.tokenizer(
            list(texts),
            padding="max_length",
            truncation=True,
            max_length=self.text_length,
            return_tensors="pt",
        )
        ids = batch["input_ids"].long()
        mask = batch.get("attention_mask")
        return {
            "input_ids": ids,
            "attention_mask": (ids != self.pad_token_id).long() if mask is None else mask.long(),
        }

    @property
    def uses_mask(self) -> bool:
        """Whether the model reads an attention mask (SigLIP's tokenizer gives none: it was
        trained attending to its padding, so none is passed)."""
        return self.spec.library != "open_clip" and _reads_mask(self.tokenizer)

    @property
    def pad_token_id(self) -> int:
        inner = getattr(self.tokenizer, "tokenizer", self.tokenizer)  # open_clip's HFTokenizer
        pad = getattr(inner, "pad_token_id", None)
        return 0 if pad is None else int(pad)  # open_clip's own BPE pads with 0


def _reads_mask(tokenizer) -> bool:
    return "attention_mask" in getattr(tokenizer, "model_input_names", ())


def _hf_kwargs(spec: DualSpec) -> dict[str, Any]:
    if spec.remote_code:
        reason = unpinned_code(spec)
        if reason:
            raise PretrainedModelError(reason)
    return {"revision": spec.revision, "trust_remote_code": spec.remote_code}


CODE_FILES = ("config.json", "preprocessor_config.json", "tokenizer_config.json")


def unpinned_code(spec: DualSpec) -> str | None:
    """Why the remote code of ``spec`` is not pinned by its revision, or None. An ``auto_map``
    class written ``<other repo>--<module.Class>`` (jina-clip-v2's is) makes transformers fetch
    that other repository's latest code: ``revision`` pins only the model's own repository."""
    from transformers.utils import cached_file

    others = set()
    for name in CODE_FILES:
        path = cached_file(
            spec.model, name, revision=spec.revision, _raise_exceptions_for_missing_entries=False
        )
        auto_map = json.loads(Path(path).read_text()).get("auto_map") if path else None
        for value in (auto_map or {}).values():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "--" in ref:
                    others.add(ref.split("--")[0])
    others.discard(spec.model)
    if not others:
        return None
    return (
        f"{spec.label}: its auto_map takes its modelling code from {', '.join(sorted(others))}, "
        "which revision= does not pin (transformers would run that repository's latest code)"
    )


def _open_clip_model(spec: DualSpec):
    import open_clip

    from ccr.methods.layers.weights import load_state_dict_file

    local = Path(spec.pretrained) if spec.pretrained else None
    weights = [local] if local is not None and local.is_file() else []
    if spec.model.startswith("local-dir:"):
        folder = Path(spec.model.removeprefix("local-dir:"))
        weights = sorted(f for p in ("*.safetensors", "*.bin", "*.pth") for f in folder.glob(p))
        if not weights:
            raise PretrainedModelError(
                f"{folder} holds no open_clip weights (*.safetensors, "
                "*.bin, *.pth); open_clip would build random weights"
            )
    for (
        path
    ) in weights:  # open_clip reads them unchecked: a foreign or truncated file is named here
        load_state_dict_file(path)
    model, _, transform = open_clip.create_model_and_transforms(
        spec.model, pretrained=spec.pretrained
    )
    return model, transform, open_clip.get_tokenizer(spec.model)


def _open_clip_io(spec: DualSpec, transform, tokenizer) -> PretrainedIO:
    length = int(getattr(tokenizer, "context_length", 0) or 0)
    if spec.text_length is not None and spec.text_length != length:
        raise PretrainedModelError(
            f"{spec.label}: text_length {spec.text_length} differs from "
            f"the tokenizer's context length {length}"
        )
    return PretrainedIO(spec, transform, tokenizer, length)


def _hf_io(spec: DualSpec, processor=None, text_config=None) -> PretrainedIO:
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    if processor is None:
        processor = AutoImageProcessor.from_pretrained(spec.model, **_hf_kwargs(spec))
    tokenizer = AutoTokenizer.from_pretrained(spec.model, **_hf_kwargs(spec))
    length = spec.text_length
    if length is None:
        if text_config is None:
            config = AutoConfig.from_pretrained(spec.model, **_hf_kwargs(spec))
            text_config = getattr(config, "text_config", config)
        limits = [tokenizer.model_max_length, getattr(text_config, "max_position_embeddings", None)]
        known = [n for n in limits if isinstance(n, int) and 0 < n < 100_000]
        if not known:
            raise PretrainedModelError(
                f"{spec.label}: no text length known from its tokenizer or config; set text_length"
            )
        length = min(known)
    return PretrainedIO(spec, processor, tokenizer, length)


def load_io(spec: DualSpec) -> PretrainedIO:
    """The model's preprocessing and tokenizer (open_clip builds them with the model)."""
    if spec.library == "mclip":
        return load_dual(spec)[1]
    if spec.library == "open_clip":
        _, transform, tokenizer = _open_clip_model(spec)
        return _open_clip_io(spec, transform, tokenizer)
    return _hf_io(spec)


def load_dual(spec: DualSpec) -> tuple[nn.Module, PretrainedIO]:
    """The whole model (eval mode, CPU) with its preprocessing and tokenizer, loaded once."""
    if spec.library == "open_clip":
        model, transform, tokenizer = _open_clip_model(spec)
        return model.eval(), _open_clip_io(spec, transform, tokenizer)
    if spec.library == "mclip":
        model, transform = _mclip_model(spec)
        return model.eval(), _hf_io(spec, transform, model.text_transformer.config)
    return load_model(spec), _hf_io(spec)


class MClipDual(nn.Module):
    """M-CLIP (Carlsson et al. 2022): a multilingual text encoder (XLM-R, mean-pooled over the
    attention mask, then a linear map) trained into the text space of an open_clip image tower.
    It answers ``get_image_features`` / ``get_text_features`` as a Hugging Face CLIP does."""

    def __init__(self, visual: nn.Module, text_transformer: nn.Module, text_projection: nn.Linear):
        super().__init__()
        self.visual, self.text_transformer, self.text_projection = (
            visual,
            text_transformer,
            text_projection,
        )

    def get_image_features(self, pixel_values: Tensor) -> Tensor:
        return self.visual(pixel_values)

    def get_text_features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        states = self.text_transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return self.text_projection((states * mask).sum(1) / mask.sum(1))


MCLIP_KEYS = {"transformer.": "text_transformer.", "LinearTransformation.": "text_projection."}


def _mclip_model(spec: DualSpec) -> tuple[MClipDual, Any]:
    """The M-CLIP text encoder (its config names the XLM-R ``modelBase`` and the widths; its
    weights hold ``transformer.*`` and ``LinearTransformation.*``) with its open_clip image tower."""
    import open_clip
    from transformers import AutoConfig, AutoModel
    from transformers.utils import cached_file

    config_path = cached_file(spec.model, "config.json", revision=spec.revision)
    mclip = json.loads(Path(config_path).read_text())
    try:
        base, width, dims = mclip["modelBase"], mclip["transformerDimensions"], mclip["numDims"]
    except KeyError as err:
        raise PretrainedModelError(
            f"{spec.label}: {config_path} lacks the M-CLIP field {err}"
        ) from None
    text = AutoModel.from_config(AutoConfig.from_pretrained(base))
    projection = nn.Linear(int(width), int(dims))
    weights = None
    for name in ("model.safetensors", "pytorch_model.bin"):
        weights = cached_file(
            spec.model, name, revision=spec.revision, _raise_exceptions_for_missing_entries=False
        )
        if weights:
            break
    if not weights:
        raise PretrainedModelError(f"{spec.label}: no model.safetensors or pytorch_model.bin")
    from ccr.methods.layers.weights import load_state_dict_file

    state = {}
    for key, value in load_state_dict_file(weights).items():
        prefix = next((p for p in MCLIP_KEYS if key.startswith(p)), None)
        if prefix is not None:
            state[MCLIP_KEYS[prefix] + key.removeprefix(prefix)] = value
    image, _, transform = open_clip.create_model_and_transforms(
        spec.image_model, pretrained=spec.pretrained
    )
    model = MClipDual(image.visual, text, projection)
    own = {k: v for k, v in model.state_dict().items() if not k.startswith("visual.")}
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise PretrainedModelError(
            f"{spec.label}: {weights} does not match its M-CLIP config "
            f"(missing {missing[:3]}, unexpected {extra[:3]})"
        )
    model.load_state_dict(state, strict=False)
    return model, transform


def load_model(spec: DualSpec) -> nn.Module:
    """The whole dual encoder, in eval mode, on the CPU."""
    if spec.library == "open_clip":
        model = _open_clip_model(spec)[0]
    else:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(spec.model, **_hf_kwargs(spec))
        if not all(hasattr(model, f) for f in ("get_image_features", "get_text_features")):
            raise PretrainedModelError(
                f"{spec.label} ({type(model).__name__}) is not a CLIP-style dual encoder "
                "(no get_image_features / get_text_features)"
            )
    return model.eval()


def resolved_revision(model: nn.Module) -> str | None:
    """The hub commit a Hugging Face model was loaded from (None for a local folder)."""
    config = getattr(model, "config", None)
    commit = getattr(config, "_commit_hash", None)
    return commit if isinstance(commit, str) and COMMIT.fullmatch(commit) else None


def keep_parts(
    model: nn.Module, prefixes: tuple[str, ...], drop: tuple[str, ...] = ()
) -> nn.Module:
    """Drop the top-level children and parameters whose names do not start with ``prefixes`` (or
    that start with ``drop``): a tower keeps only what it computes with."""
    for name in [n for n, _ in model.named_children()] + [
        n for n, _ in model.named_parameters(recurse=False)
    ]:
        if not name.startswith(prefixes) or name.startswith(drop):
            setattr(model, name, None)
    if not any(True for _ in model.parameters()):
        raise PretrainedModelError(f"{type(model).__name__}: no parameters left under {prefixes}")
    return model


def _features(output) -> Tensor:
    """Projected features: a tensor, or (transformers >= 5) the output's ``pooler_output``."""
    return output if isinstance(output, Tensor) else output.pooler_output


class ImageTower(nn.Module):
    """Pixels -> the model's projected image embedding ``[B, D]`` (not normalised)."""

    def __init__(self, model: nn.Module, library: str):
        super().__init__()
        self.model, self.library = model, library

    def forward(self, pixels: Tensor) -> Tensor:
        if self.library == "open_clip":
            return self.model.encode_image(pixels)
        return _features(self.model.get_image_features(pixel_values=pixels))


class TextTower(nn.Module):
    """Token ids and mask -> the model's projected text embedding ``[N, D]`` (not normalised).
    ``use_mask``: pass the attention mask (a Hugging Face model whose tokenizer gives one)."""

    def __init__(self, model: nn.Module, library: str, use_mask: bool):
        super().__init__()
        self.model, self.library, self.use_mask = model, library, use_mask

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        if self.library == "open_clip":  # builds its own mask (causal / from the pad id)
            return self.model.encode_text(input_ids)
        mask = {"attention_mask": attention_mask} if self.use_mask else {}
        return _features(self.model.get_text_features(input_ids=input_ids, **mask))


def image_tower(spec: DualSpec) -> ImageTower:
    """The image half of a freshly loaded model (the text half is dropped); ``width`` is its
    embedding width, read off a blank image through the model's own preprocessing."""
    model, io = load_dual(spec)
    keep_parts(model, ("visual",) if spec.library == "open_clip" else IMAGE_PARTS)
    tower = ImageTower(model, spec.library)
    tower.width = _output_width(tower, io.preprocess([Image.new("RGB", (64, 64))]))
    return tower


def text_tower(spec: DualSpec) -> TextTower:
    """The text half of a freshly loaded model (the image half and the logit scale are dropped);
    ``width`` is its embedding width, read off one caption through the model's tokenizer."""
    model, io = load_dual(spec)
    if spec.library == "open_clip":
        keep_parts(model, ("",), drop=("visual", *OPEN_CLIP_SHARED))
    else:
        keep_parts(model, TEXT_PARTS)
    tower = TextTower(model, spec.library, io.uses_mask)
    tokens = io.tokenize(["a"], None)
    tower.width = _output_width(tower, tokens["input_ids"], tokens["attention_mask"])
    return tower


@torch.no_grad()
def _output_width(tower: nn.Module, *inputs: Tensor) -> int:
    """The width of a tower's output (models name it differently: projection_dim, output_dim, a
    hidden size when there is no projection), read off one forward pass."""
    return int(tower(*inputs).shape[-1])
