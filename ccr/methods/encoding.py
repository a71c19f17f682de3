"""How a method's embeddings of an evaluated split are computed: one batch, or a whole split.

``RetrievalModule.validation_step`` encodes each evaluation batch with :func:`encode_batch`; the
demo, the report and a checkpoint's re-encoding call :func:`encode_view`, which feeds the same
function the same batches, so every embedding they show is the one the metrics scored.

What a method reads besides images or captions comes in the batch: the batch keys a method names
in ``image_inputs`` / ``caption_inputs`` (e.g. RC3: the images' shipped ``roi_features`` and
``roi_mask``, each caption's ``language``) are passed to its ``encode_*`` and ``*_cache`` methods
as keyword arguments when the batch holds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from ccr.methods.layers.batches import fill_rows, first_rows

IMAGES, CAPTIONS = "images", "captions"  # the two sides of an evaluated split


class Encoder(Protocol):
    """What this module calls on a method (``RetrievalModule`` has all of it)."""

    image_inputs: ClassVar[tuple[str, ...]]
    caption_inputs: ClassVar[tuple[str, ...]]

    def encode_images(self, *args: Any, **kwargs: Any) -> Tensor: ...
    def encode_texts(self, *args: Any, **kwargs: Any) -> Tensor: ...
    def image_cache(self, *args: Any, **kwargs: Any) -> Any: ...
    def text_cache(self, *args: Any, **kwargs: Any) -> Any: ...
    def parameters(self) -> Any: ...


class EvaluatedView(Protocol):
    """What :func:`encode_view` reads of an evaluation view (``CCRDataModule.eval_view``)."""

    image_ids: list[str]
    caption_language: list[str]

    def image_loader(self, batch_size: int) -> DataLoader: ...
    def caption_loader(self, batch_size: int) -> DataLoader: ...


@dataclass
class EncodedBatch:
    """One evaluation batch's item indices, float32 embeddings and (when asked) the cross-encoder's
    per-item caches, without the rows that filled the batch up."""

    index: Tensor
    embeddings: Tensor
    cache: Tensor | Mapping[str, Tensor] | None = None


def side_inputs(module: Encoder, side: str, batch: Mapping[str, Any]) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of ``module``'s encoders for one side of ``batch``."""
    if side == IMAGES:
        args, extra = (batch["images"],), module.image_inputs
    elif side == CAPTIONS:
        args, extra = (batch["input_ids"], batch["attention_mask"]), module.caption_inputs
    else:
        raise ValueError(f"evaluation side {side!r}: expected {IMAGES!r} or {CAPTIONS!r}")
    return args, {key: batch[key] for key in extra if key in batch}


def encode_batch(
    module: Encoder,
    side: str,
    batch: Mapping[str, Any],
    rows: int | None,
    keep_cache: bool = False,
) -> EncodedBatch:
    """Embeddings of one evaluation batch of ``side`` (``images`` or ``captions``).

    A short batch is filled up to ``rows`` (the loader's batch size) with copies of its first row,
    whose outputs are dropped: CPU kernels round differently for different shapes, and a DDP run's
    shards end in other short batches than one process does, so without one shape an item's
    embedding (and near-tied rankings) would depend on how the set was sharded."""
    count = len(batch["index"])
    filled = fill_rows(dict(batch), rows)
    args, kwargs = side_inputs(module, side, filled)
    if side == IMAGES:
        emb = module.encode_images(*args, **kwargs)
        cache = module.image_cache(*args, **kwargs) if keep_cache else None
    else:
        emb = module.encode_texts(*args, **kwargs)
        cache = module.text_cache(*args, **kwargs) if keep_cache else None
    return EncodedBatch(batch["index"][:count], emb[:count].float(), first_rows(cache, count))


@torch.no_grad()
def encode_view(module: Encoder, view: EvaluatedView, batch_size: int) -> tuple[Tensor, Tensor]:
    """(image embeddings ``[N, D]``, caption embeddings ``[T, D]``) of an evaluation view, in index
    order, from the batches evaluation encodes (``data.eval_batch_size``) by :func:`encode_batch`.
    The module should be in eval mode; its tensors' device is where the batches go."""
    device = next(module.parameters()).device
    sides = (
        (IMAGES, view.image_loader(batch_size), len(view.image_ids)),
        (CAPTIONS, view.caption_loader(batch_size), len(view.caption_language)),
    )
    out = []
    for side, loader, count in sides:
        placed: Tensor | None = None
        for batch in loader:
            moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            encoded = encode_batch(module, side, moved, batch_size)
            if placed is None:
                placed = encoded.embeddings.new_empty(count, encoded.embeddings.shape[1])
            placed[encoded.index] = encoded.embeddings
        if placed is None:
            raise ValueError(f"the evaluation view has no {side} to encode")
        out.append(placed.cpu())
    return out[0], out[1]
