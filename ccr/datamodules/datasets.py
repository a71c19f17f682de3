"""Torch datasets and collate functions that turn records into the batches of docs/interfaces.md.

Datasets return plain Python items; collate functions tokenize a whole batch at once (faster than
per item) and build the tensors. Everything here is picklable, so it runs in worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .records import Record
from .roi_features import ImageRois
from .tokenization import Tokenizer

ROI_KEYS = ("roi_features", "roi_mask")  # batch keys of a dataset's shipped ROI features


class ImageTransform:
    """Open an image file, resize it to ``size``x``size`` (bicubic) and normalise per channel."""

    def __init__(self, size: int, mean: Sequence[float], std: Sequence[float]):
        self.size = size
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(3, 1, 1)
        # every byte value's normalised float per channel, by the same float32 operations as
        # normalising each pixel: looking them up gives the same bits at about half the cost
        values = torch.arange(256, dtype=torch.float32).view(1, 256, 1)
        self.table = ((values / 255.0 - self.mean) / self.std).view(3, 256).numpy()

    def __call__(self, path: Path) -> torch.Tensor:
        return self.normalise(self.pixels(path))

    def pixels(self, path: Path) -> np.ndarray:
        """The decoded, resized RGB image as uint8 [size, size, 3] (what an image cache stores)."""
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (self.size, self.size):
                image = image.resize((self.size, self.size), Image.Resampling.BICUBIC)
            return np.asarray(image, dtype=np.uint8).copy()

    def normalise(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 [H, W, 3] -> float [3, H, W]: (pixels / 255 - mean) / std per channel."""
        out = np.empty((3, *pixels.shape[:2]), dtype=np.float32)
        for channel in range(3):
            np.take(self.table[channel], pixels[..., channel], out=out[channel])
        return torch.from_numpy(out)


class TrainDataset(Dataset):
    """One item per record: its image and one caption per language (None where absent).

    With ``parallel`` (the dataset's captions are translations by index, as its reader declares)
    one caption index is drawn per item and every language gives its caption at that index, so
    the K captions are translations of one another. Otherwise, and for a record whose languages
    hold different numbers of captions (``unaligned``), each language draws on its own.
    ``rois`` (aligned with ``records``) adds each image's shipped ROI features.
    """

    def __init__(
        self,
        records: list[Record],
        languages: list[str],
        image_root: Path,
        transform: Callable[[Path], torch.Tensor],
        label_index: dict[str, int],
        parallel: bool,
        rois: ImageRois | None = None,
    ):
        self.records, self.languages, self.rois = records, languages, rois
        self.image_root, self.transform, self.label_index = image_root, transform, label_index
        counts = [
            {len(r.captions[lang]) for lang in languages if r.captions.get(lang)} for r in records
        ]
        self.aligned = [parallel and len(c) == 1 for c in counts]
        # records drawn independently although the dataset is parallel (unequal caption counts)
        self.unaligned = sum(1 for c in counts if parallel and len(c) > 1)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        item = training_item(
            record,
            self.transform(self.image_root / record.image),
            self.languages,
            self.aligned[index],
            self.label_index,
        )
        if self.rois is not None:
            item.update(self.rois[index])
        return item


def training_item(
    record: Record,
    image: torch.Tensor,
    languages: list[str],
    aligned: bool,
    label_index: dict[str, int],
) -> dict:
    """One training item of ``record`` (its decoded ``image``): one caption per language, None
    where absent; ``aligned``: one caption index drawn for every language (translations by
    index), else each language draws its own. Draws use torch's RNG (seeded per item by the
    loaders, so caption choice is reproducible)."""
    shared = None
    if aligned:
        count = next(len(record.captions[k]) for k in languages if record.captions.get(k))
        shared = int(torch.randint(count, ()))
    texts = []
    for lang in languages:
        options = record.captions.get(lang) or []
        if not options:
            texts.append(None)
        elif shared is not None:
            texts.append(options[shared])
        else:
            texts.append(options[int(torch.randint(len(options), ()))])
    return {
        "image": image,
        "texts": texts,
        "id": record.id,
        "objects": [label_index[o] for o in record.extras.get("objects", []) if o in label_index],
        "weak": record.extras.get("alignment") == "weak",
    }


class TrainCollate:
    """Stack a training batch: ``input_ids``/``attention_mask`` [B,K,L], ``present`` [B,K], plus
    ``objects`` (multi-hot), ``alignment_weak`` and ``roi_features`` [B,R,D] / ``roi_mask`` [B,R]
    when the data has them.

    L is ``max_length``; with ``pad_to_multiple`` it is the batch's longest caption rounded up to
    a multiple of it (at most ``max_length``): the same tokens without the pad columns no caption
    of the batch reaches, in a few distinct shapes."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_length: int,
        languages: list[str],
        num_labels: int,
        with_alignment: bool,
        pad_to_multiple: int | None = None,
    ):
        self.tokenizer, self.max_length, self.languages = tokenizer, max_length, languages
        self.num_labels, self.with_alignment = num_labels, with_alignment
        self.pad_to_multiple = pad_to_multiple

    def __call__(self, items: list[dict]) -> dict:
        batch_size, k = len(items), len(self.languages)
        texts = [text for item in items for text in item["texts"]]
        present = torch.tensor([text is not None for text in texts]).view(batch_size, k)
        tokens = self.tokenizer([text or "" for text in texts], self.max_length)
        input_ids = tokens["input_ids"].view(batch_size, k, -1)
        attention_mask = tokens["attention_mask"].view(batch_size, k, -1)
        input_ids = input_ids.masked_fill(~present[..., None], self.tokenizer.pad_token_id)
        attention_mask = attention_mask.masked_fill(~present[..., None], 0)
        if self.pad_to_multiple:
            longest = max(int(attention_mask.sum(-1).max()), 1)
            length = min(
                self.max_length, -(-longest // self.pad_to_multiple) * self.pad_to_multiple
            )
            input_ids, attention_mask = input_ids[..., :length], attention_mask[..., :length]
        batch = {
            "images": torch.stack([item["image"] for item in items]),
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "present": present,
            "languages": list(self.languages),
            "ids": [item["id"] for item in items],
        }
        if self.num_labels:
            objects = torch.zeros(batch_size, self.num_labels, dtype=torch.long)
            for row, item in enumerate(items):
                objects[row, item["objects"]] = 1
            batch["objects"] = objects
        if self.with_alignment:
            batch["alignment_weak"] = torch.tensor(
                [item["weak"] for item in items], dtype=torch.bool
            )
        return batch | stack_rois(items)


def stack_rois(items: list[dict]) -> dict[str, torch.Tensor]:
    """The items' ROI features and masks stacked by key, or nothing when they carry none."""
    if ROI_KEYS[0] not in items[0]:
        return {}
    return {key: torch.stack([item[key] for item in items]) for key in ROI_KEYS}


class ImageDataset(Dataset):
    """Unique images of an evaluation view, each with its index, and its shipped ROI features
    when there are ``rois`` (aligned with ``paths``)."""

    def __init__(
        self,
        paths: list[Path],
        transform: Callable[[Path], torch.Tensor],
        rois: ImageRois | None = None,
    ):
        self.paths, self.transform, self.rois = paths, transform, rois

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        item = {"image": self.transform(self.paths[index]), "index": index}
        if self.rois is not None:
            item.update(self.rois[index])
        return item


def collate_images(items: list[dict]) -> dict:
    return {
        "images": torch.stack([item["image"] for item in items]),
        "index": torch.tensor([item["index"] for item in items]),
        **stack_rois(items),
    }


class CaptionDataset(Dataset):
    """Every caption of an evaluation view, each with its index and its language."""

    def __init__(self, texts: list[str], languages: list[str]):
        if len(texts) != len(languages):
            raise ValueError(f"{len(texts)} captions but {len(languages)} caption languages")
        self.texts, self.languages = texts, languages

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> tuple[str, int, str]:
        return self.texts[index], index, self.languages[index]


class CaptionCollate:
    """Tokenize a batch of evaluation captions; ``language`` lists each row's language (a method
    that tags captions with their language reads it from the batch)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, items: list[tuple[str, int, str]]) -> dict:
        tokens = self.tokenizer([text for text, _, _ in items], self.max_length)
        return {
            **tokens,
            "index": torch.tensor([i for _, i, _ in items]),
            "language": [language for _, _, language in items],
        }


class ParallelBatches(Dataset):
    """Text-only caption pairs, already grouped into batches of one language pair each.

    Each item is a whole batch, so a (distributed) sampler shuffles batches, not pairs, and every
    batch keeps a single (source, target) language pair.
    """

    def __init__(self, batches: list[tuple[str, str, list[tuple[str, str]]]]):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[str, str, list[tuple[str, str]]]:
        return self.batches[index]


class ParallelCollate:
    def __init__(self, tokenizer: Tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch: tuple[str, str, list[tuple[str, str]]]) -> dict:
        src_language, tgt_language, texts = batch
        src = self.tokenizer([s for s, _ in texts], self.max_length)
        tgt = self.tokenizer([t for _, t in texts], self.max_length)
        return {
            "src_input_ids": src["input_ids"],
            "src_attention_mask": src["attention_mask"],
            "tgt_input_ids": tgt["input_ids"],
            "tgt_attention_mask": tgt["attention_mask"],
            "src_language": src_language,
            "tgt_language": tgt_language,
        }
