"""Tokenizers behind one small interface (see docs/interfaces.md).

Two kinds: the suite's offline tokenizer, a byte-level BPE trained with the ``tokenizers``
library on the training captions (Chinese/Japanese characters are kept as single pre-tokens, so
scripts without spaces split per character; bytes back every symbol, so nothing is ever <unk>;
text is NFKC-normalised, so e.g. a fullwidth comma decodes as ","),
cached beside the data; and any Hugging Face tokenizer by hub name or local path.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from tokenizers import (
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import (
    Tokenizer as RawTokenizer,
)

OFFLINE = "offline"
OFFLINE_VERSION = 1
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4
CJK_CHARACTER = r"[\p{Han}\p{Hiragana}\p{Katakana}]"


class Tokenizer(Protocol):
    vocab_size: int
    pad_token_id: int
    cls_token_id: int
    eos_token_id: int
    mask_token_id: int

    def __call__(self, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
        """{"input_ids", "attention_mask"}: LongTensor [N, max_length], right-padded, <cls> first
        and <eos> at the last non-pad position."""


class OfflineTokenizer:
    """The suite's own byte-level BPE (special tokens <s>=cls, <pad>, </s>=eos, <unk>, <mask>)."""

    def __init__(self, raw: RawTokenizer):
        self.raw = raw
        self.vocab_size = raw.get_vocab_size()
        self.cls_token_id, self.pad_token_id, self.eos_token_id, _, self.mask_token_id = (
            raw.token_to_id(token) for token in SPECIAL_TOKENS
        )
        self._length: int | None = None

    def __call__(self, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
        if self._length != max_length:
            self.raw.enable_truncation(max_length)
            self.raw.enable_padding(pad_id=self.pad_token_id, pad_token="<pad>", length=max_length)
            self._length = max_length
        encodings = self.raw.encode_batch_fast(list(texts))  # ids only: no character offsets
        return {
            "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.long),
        }

    def decode(self, ids: Iterable[int]) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer JSON atomically (concurrent processes may write the same file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        self.raw.save(str(staging))
        os.replace(staging, path)

    @classmethod
    def load(cls, path: str | Path) -> OfflineTokenizer:
        return cls(RawTokenizer.from_file(str(path)))


def train_offline_tokenizer(corpus: Iterable[str], vocab_size: int) -> OfflineTokenizer:
    """Train the byte-level BPE on ``corpus`` (the training captions)."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.NFKC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CJK_CHARACTER), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus, trainer=trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[("<s>", raw.token_to_id("<s>")), ("</s>", raw.token_to_id("</s>"))],
    )
    return OfflineTokenizer(raw)


class PretrainedTokenizer:
    """A Hugging Face tokenizer by local folder, or by hub name from the local cache; it is
    downloaded only with ``download=True`` (nothing is fetched unless the user asks).

    Tokenizers without a pad or mask token (e.g. CLIP's) pad with their eos token and mask with
    their unk token; cls falls back to bos, eos to sep.
    """

    def __init__(self, name_or_path: str, download: bool = False):
        from transformers import AutoTokenizer

        local = Path(name_or_path).exists()
        try:
            self.hf = AutoTokenizer.from_pretrained(
                name_or_path, local_files_only=not (download or local)
            )
        except OSError as err:
            if download or local:
                raise ValueError(
                    f"tokenizer '{name_or_path}' could not be loaded: "
                    f"{' '.join(str(err).split())[:200]}"
                ) from None
            raise ValueError(
                f"tokenizer '{name_or_path}' is a Hugging Face hub name that is not in the local "
                "cache, and downloads are off: set data.tokenizer.name=offline (the suite's own "
                "tokenizer, trained on the training captions) or a local tokenizer folder, or "
                "data.tokenizer.download=true to fetch it"
            ) from None
        self.cls_token_id = _first_id(self.hf, name_or_path, "cls_token_id", "bos_token_id")
        self.eos_token_id = _first_id(self.hf, name_or_path, "eos_token_id", "sep_token_id")
        self.pad_token_id = _first_id(self.hf, name_or_path, "pad_token_id", "eos_token_id")
        self.mask_token_id = _first_id(self.hf, name_or_path, "mask_token_id", "unk_token_id")
        if self.hf.pad_token_id is None:
            self.hf.pad_token_id = self.pad_token_id
        self.vocab_size = len(self.hf)

    def __call__(self, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
        out = self.hf(
            list(texts),
            max_length=max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        return {
            "input_ids": out["input_ids"].long(),
            "attention_mask": out["attention_mask"].long(),
        }

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def _first_id(hf: Any, name: str, *attributes: str) -> int:
    for attribute in attributes:
        value = getattr(hf, attribute, None)
        if value is not None:
            return int(value)
    raise ValueError(
        f"tokenizer '{name}' has none of {attributes}; the suite needs cls/eos/pad/mask ids"
    )


def offline_cache_path(cache_dir: str | Path, corpus: list[str], vocab_size: int) -> Path:
    """Cache file named by a digest of the corpus and settings: new captions, new tokenizer."""
    digest = hashlib.sha256(f"{OFFLINE_VERSION}/{vocab_size}\n".encode())
    for text in corpus:
        digest.update(text.encode("utf-8") + b"\n")
    return Path(cache_dir) / f"tokenizer-{digest.hexdigest()[:12]}.json"


def build_tokenizer(
    cfg_tokenizer: Mapping[str, Any],
    corpus: Iterable[str] | None = None,
    cache_dir: str | Path | None = None,
) -> Tokenizer:
    """``cfg_tokenizer.name``: "offline" (trained on ``corpus``, cached in ``cache_dir`` when given)
    or a local path / Hugging Face hub name (downloaded only if ``cfg_tokenizer.download``)."""
    name = str(cfg_tokenizer["name"])
    if name != OFFLINE:
        return PretrainedTokenizer(name, download=bool(cfg_tokenizer.get("download", False)))
    if corpus is None:
        raise ValueError("the offline tokenizer is trained on the training captions: pass corpus")
    corpus = list(corpus)
    vocab_size = int(cfg_tokenizer["vocab_size"])
    if cache_dir is None:
        return train_offline_tokenizer(corpus, vocab_size)
    path = offline_cache_path(cache_dir, corpus, vocab_size)
    if path.exists():
        return OfflineTokenizer.load(path)
    tokenizer = train_offline_tokenizer(corpus, vocab_size)
    tokenizer.save(path)
    return tokenizer
