"""A pretrained dual encoder's own image preprocessing and tokenizer as the data's loaders use them
(``data.pretrained_io``, set by ``method.encoders=zoo:<name>``): a run that fine-tunes the model
reads images and captions exactly as ``ccr/experiments/external.py`` scored it. The harness loads the
model's preprocessing (``ccr.methods.layers.pretrained_dual.load_io``) and hands it to the datamodule,
which reads data and loads no model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image


class PretrainedIO(Protocol):
    """What the loaders use of a pretrained model's preprocessing and tokenizer."""

    spec: Any  # names the model (``spec.label``)
    tokenizer: Any
    text_length: int

    @property
    def pad_token_id(self) -> int: ...

    def preprocess(self, images: list[Image.Image]) -> torch.Tensor: ...

    def tokenize(self, texts: list[str], language: str | None) -> dict[str, torch.Tensor]: ...


# ``data.pretrained_io`` (the model's settings) -> its preprocessing and tokenizer
LoadPretrainedIO = Callable[[Mapping[str, Any]], PretrainedIO]


class PretrainedImageTransform:
    """Open an image file and run the model's own evaluation preprocessing on it."""

    def __init__(self, io: PretrainedIO):
        self.io = io

    def __call__(self, path: Path) -> torch.Tensor:
        with Image.open(path) as image:
            return self.io.preprocess([image.convert("RGB")])[0]


class PretrainedTokenizer:
    """The model's tokenizer behind the suite's ``Tokenizer`` interface. Every caption is padded to
    the model's own text length (``text_length``; the run's ``max_length`` must equal it). A model
    without a mask token masks with its eos token (no method that fine-tunes a dual encoder here
    masks tokens); one without a pad token pads with 0, as open_clip's own BPE does."""

    def __init__(self, io: PretrainedIO):
        self.io = io
        inner = getattr(io.tokenizer, "tokenizer", io.tokenizer)  # open_clip wraps HF tokenizers
        self.text_length = io.text_length
        self.pad_token_id = io.pad_token_id
        self.cls_token_id = _first(inner, "cls_token_id", "bos_token_id", "sot_token_id")
        self.eos_token_id = _first(inner, "eos_token_id", "sep_token_id", "eot_token_id")
        self.mask_token_id = _first(inner, "mask_token_id", "eos_token_id", "eot_token_id")
        self.vocab_size = int(getattr(inner, "vocab_size", None) or len(inner.encoder))

    def __call__(self, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
        if max_length != self.text_length:
            raise ValueError(
                f"{self.io.spec.label} encodes captions of {self.text_length} tokens, "
                f"not {max_length}"
            )
        return self.io.tokenize(list(texts), None)


def _first(tokenizer: Any, *names: str) -> int:
    for name in names:
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0
