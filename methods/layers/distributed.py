"""Feature gathering across processes that keeps the gradient, for losses over the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if _active() else 1


class _GatherWithGrad(torch.autograd.Function):
    """All-gather forward; backward sums every process's gradient for this process's slice.

    Each process computes a loss on its local rows against all gathered columns. Summing the slice
    gradients over processes and letting DDP average parameter gradients yields exactly the gradient
    of the mean of the local losses, i.e. of the loss on the global batch.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.batch = x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = dist.get_rank() * ctx.batch
        return grad[start : start + ctx.batch]


def gather_with_grad(x: Tensor) -> Tensor:
    """Concatenate ``x [B, ...]`` from every process in rank order (``[W*B, ...]``), with gradient.

    Every process must pass the same batch size B (training loaders drop the last partial batch).
    Without a process group, or with one process, returns ``x`` unchanged.
    """
    return _GatherWithGrad.apply(x) if _active() else x
