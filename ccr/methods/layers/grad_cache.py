"""Large contrastive batches on little memory: encode a batch in micro-batches whose activations
are dropped and recomputed in the backward pass, then compute one loss over the whole batch.

``trainer.accumulate_grad_batches`` does not help a contrastive loss: each micro-batch is its own
softmax, so the negatives stay those of one micro-batch. GradCache (Gao et al., 2021) and
open_clip's ``--accum-freq`` instead build the loss over every micro-batch's features. Here each
micro-batch runs its encoder under non-reentrant activation checkpointing: the forward keeps only
its inputs and its output features (no activations), the loss sees the features of the whole
batch (gathered over processes as usual), and the backward recomputes one micro-batch at a time
and back-propagates the loss's gradient with respect to its features through it. That is
GradCache's computation (a forward without stored activations, the loss, a second forward and a
backward per micro-batch; the activation memory of one micro-batch) in a single backward pass, so
it composes with Lightning's automatic optimisation, gradient clipping and DDP's one all-reduce
per step. The RNG state of each micro-batch's forward is replayed in its recomputation (dropout
draws the same masks), so the gradient is exact.

With dropout off the loss and gradient equal those of the unchunked batch up to float rounding
(different matmul shapes); with dropout on they equal those of the same micro-batched forward
without recomputation (the masks are drawn per micro-batch). A BatchNorm layer in training mode
normalises by its micro-batch's statistics, which no recomputation can make those of the batch:
chunking through one is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint


def encode_in_chunks(encode: Callable[..., Any], *inputs: Tensor, chunks: int) -> Any:
    """``encode(*inputs)`` computed in ``chunks`` micro-batches along the rows (dimension 0) with
    activation recomputation, their outputs concatenated: a tensor, a tuple of tensors or a
    dataclass of tensors, each with one row per input row. ``chunks`` 1 calls ``encode`` as is.

    Micro-batches are as equal as ``torch.tensor_split`` makes them; with fewer rows than
    ``chunks`` the empty ones are skipped."""
    if chunks < 1:
        raise ValueError(f"encode_in_chunks: chunks must be >= 1, got {chunks}")
    if chunks == 1 or not torch.is_grad_enabled():
        return encode(*inputs)
    rows = {len(x) for x in inputs}
    if len(rows) != 1:
        raise ValueError(f"encode_in_chunks: inputs have different row counts {sorted(rows)}")
    pieces = zip(*(x.tensor_split(chunks) for x in inputs), strict=True)
    refusal = nn.modules.module.register_module_forward_pre_hook(_refuse_batch_statistics)
    try:
        outputs = [
            checkpoint(encode, *piece, use_reentrant=False, preserve_rng_state=True)
            for piece in pieces
            if len(piece[0])
        ]
    finally:
        refusal.remove()
    return _concat(outputs)


def _refuse_batch_statistics(module: nn.Module, args: Any) -> None:
    """A forward pre-hook on every module run in a micro-batch: a training-mode BatchNorm would
    normalise by the micro-batch's statistics, not the batch's."""
    if isinstance(module, _BatchNorm) and module.training:
        raise ValueError(
            f"optim.grad_cache_chunks: a {type(module).__name__} in training mode would normalise "
            "each micro-batch by its own statistics, so the step would not be the whole batch's; "
            "set optim.grad_cache_chunks=1 or keep that layer in eval mode (frozen)"
        )


def _concat(parts: list[Any]) -> Any:
    """Row-wise concatenation of like outputs (tensors, tuples or dataclasses of tensors)."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(parts)
    if isinstance(first, tuple):
        return tuple(_concat(list(items)) for items in zip(*parts, strict=True))
    if is_dataclass(first):
        return replace(
            first, **{f.name: _concat([getattr(p, f.name) for p in parts]) for f in fields(first)}
        )
    raise TypeError(
        f"encode_in_chunks: cannot concatenate an output of type {type(first).__name__}"
    )
