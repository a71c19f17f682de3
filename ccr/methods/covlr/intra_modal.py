"""Intra-modal structure losses (CoVLR spec §3.2): soft-label classification when the data has
labels, one-directional instance discrimination against augmented views otherwise.

Both normalise over the global batch under several processes (counts and view keys are shared),
so the DDP mean of the per-process losses is the loss of the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ccr.methods.layers.distributed import gather_with_grad, rank, world_size


def soft_label_cross_entropy(logits: Tensor, multi_hot: Tensor) -> Tensor:
    """Mean over labelled rows of −Σ_c ŷ_c log softmax(logits)_c with ŷ = y / Σy (a multi-hot
    ``y [N, C]`` normalised); rows without any label are left out. Zero (with a graph) when no
    row of the global batch has a label."""
    if logits.shape != multi_hot.shape:
        raise ValueError(
            f"soft_label_cross_entropy: logits {tuple(logits.shape)} vs labels {tuple(multi_hot.shape)}"
        )
    targets = multi_hot.to(torch.float32)
    counts = targets.sum(1, keepdim=True)
    labelled = counts.squeeze(1) > 0
    per_row = -(targets / counts.clamp(min=1) * F.log_softmax(logits.float(), dim=1)).sum(1)
    total_rows = labelled.sum().to(torch.float32)
    if world_size() > 1:
        dist.all_reduce(total_rows)
    # Each process divides its sum by the global count x processes: the DDP mean is the global mean.
    return (per_row * labelled).sum() * world_size() / total_rows.clamp(min=1)


def view_info_nce(anchors: Tensor, views: Tensor, temperature: float) -> Tensor:
    """ℓ = mean_i −log softmax_b(a_i · v_b / τ)[i]: each L2-normalised anchor picks its own view
    among the views of the (global) batch; one direction, B-way. Both sides carry gradient."""
    keys = gather_with_grad(views)
    labels = torch.arange(len(anchors), device=anchors.device) + rank() * len(anchors)
    return F.cross_entropy((anchors @ keys.t()).float() / temperature, labels)
