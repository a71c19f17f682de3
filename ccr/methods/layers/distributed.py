"""Feature gathering across processes that keeps the gradient, for losses over the global batch.

Processes may hold different numbers of rows (a short last batch, the rows of one language in a
mixed batch, none at all). Every function here that talks to other processes is a collective:
every process must call it, in the same order, whatever its row count.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class RowLayout:
    """How the rows of a per-process tensor are spread over the processes (counts in rank order)."""

    counts: tuple[int, ...]
    rank: int

    @property
    def local(self) -> int:
        return self.counts[self.rank]

    @property
    def offset(self) -> int:
        """Global index of this process's first row in the gathered tensor."""
        return sum(self.counts[: self.rank])

    @property
    def total(self) -> int:
        return sum(self.counts)

    def global_mean(self, values: Tensor) -> Tensor:
        """This process's share of the mean of ``values`` over every process's rows:
        ``sum(values) * W / total``. The average of the shares over the W processes (what DDP does
        to gradients and what a logged loss shows) is the global mean; on one process it is the
        mean. A process without rows contributes an exact zero that stays in the graph."""
        if self.total == 0:
            raise ValueError("global_mean: no process has any row")
        return values.sum() / (self.total / len(self.counts))


def row_layout(rows: int, device: torch.device | str) -> RowLayout:
    """Every process's row count (a collective: one small all_gather on ``device``)."""
    if not _active():
        return RowLayout(counts=(rows,), rank=0)
    mine = torch.tensor([rows], dtype=torch.long, device=device)
    counts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, mine)
    return RowLayout(counts=tuple(int(c) for c in counts), rank=dist.get_rank())


class _GatherWithGrad(torch.autograd.Function):
    """All-gather of unequal row counts (pad to the largest, gather, trim); backward sums every
    process's gradient for this process's rows.

    Each process computes a loss on its local rows against all gathered rows. Summing the slice
    gradients over processes and letting DDP average parameter gradients yields exactly the gradient
    of the average of the local losses; ``RowLayout.global_mean`` makes that average the loss on
    the global batch.
    """

    @staticmethod
    def forward(ctx, x: Tensor, layout: RowLayout) -> Tensor:
        padded = x.new_zeros((max(layout.counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in layout.counts]
        dist.all_gather(parts, padded)
        ctx.layout = layout
        return torch.cat([part[:count] for part, count in zip(parts, layout.counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        layout = ctx.layout
        return grad[layout.offset : layout.offset + layout.local], None


def gather_with_grad(x: Tensor, layout: RowLayout | None = None) -> Tensor:
    """Concatenate ``x [n_p, ...]`` from every process in rank order (``[sum n_p, ...]``), with
    gradient. Row counts may differ, zero included; ``layout`` (from ``row_layout(len(x))``) saves
    the count exchange when the caller already has it. Without a process group, or with one
    process, returns ``x`` unchanged.
    """
    if not _active():
        return x
    if layout is None:
        layout = row_layout(x.shape[0], x.device)
    if layout.local != x.shape[0]:
        raise ValueError(
            f"gather_with_grad: layout says {layout.local} local rows, x has {x.shape[0]}"
        )
    return _GatherWithGrad.apply(x, layout)
