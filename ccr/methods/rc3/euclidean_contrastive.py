"""RC3's contrastive losses in raw Euclidean space (spec docs/specs/rc3.md §3.0, §3.3, §3.4).

No projection, normalisation or temperature: a pair's logit is its negative Euclidean distance.
Negatives farther than the positive are pulled towards the anchor ("interpolated hard negatives")
by ``λ = (d⁺/d⁻)^α``, with ``α = ζ · p⁺_avg`` set by the running mean positive probability that a
``PosProbTracker`` keeps. R-XVtCL adds, for weakly aligned triplets, the KL regulariser that makes
the visio-textual distances to three same-image candidates follow their textual distances.

Under DDP every mean is over the global batch (``RowLayout.global_mean``) and XTCL's negatives are
every process's texts (``gather_with_grad``), so two processes train exactly like one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ccr.methods.layers.distributed import gather_with_grad, row_layout, world_size

EPS = 1e-12


def euclidean(a: Tensor, b: Tensor) -> Tensor:
    """Distances ``a [N,D]`` to ``b [N,D]`` (-> ``[N]``) or to ``b [N,M,D]`` (-> ``[N,M]``);
    ``sqrt(sum + eps)`` keeps the gradient finite when a positive equals its anchor."""
    diff = (a.unsqueeze(-2) if b.dim() == 3 else a) - b
    return diff.float().pow(2).sum(-1).add(EPS).sqrt()


def pairwise_euclidean(a: Tensor, b: Tensor) -> Tensor:
    """All distances ``[N, M]`` between rows of ``a [N,D]`` and ``b [M,D]`` (finite gradient at 0).

    From coordinate differences, not ``|a|² + |b|² - 2a·b``: the TRs of a LayerNorm'd encoder
    have norms near √d but lie close together, and that expansion cancels catastrophically (at
    d = 32: distances near 0.05 wrong by up to 0.004, in a way that depends on the matmul's shape,
    so two processes and one disagreed)."""
    distances = torch.cdist(a.float(), b.float(), compute_mode="donot_use_mm_for_euclid_dist")
    return distances.pow(2).add(EPS).sqrt()


def interpolation_weights(d_pos: Tensor, d_neg: Tensor, alpha: float) -> Tensor:
    """λ ``[N,M]``: ``(d⁺/d⁻)^α`` where a negative is farther than the positive, else 1 (Eq. 6);
    detached (spec §8.2), so the gradient reaches anchor and negatives through d⁻ only."""
    harder = d_neg > d_pos[:, None]
    ratio = (d_pos[:, None] / d_neg.clamp_min(1e-6)).pow(alpha)
    return torch.where(harder, ratio, torch.ones_like(d_neg)).detach()


def _positive_nll(d_pos: Tensor, d_neg: Tensor, neg_mask: Tensor | None) -> Tensor:
    """``-log softmax`` of the positive among ``[-d⁺, -d⁻...]`` per anchor ``[N]`` (Eq. 4 form)."""
    neg = -d_neg if neg_mask is None else (-d_neg).masked_fill(~neg_mask, float("-inf"))
    logits = torch.cat([-d_pos[:, None], neg], 1)
    return -logits.log_softmax(1)[:, 0]


def interpolated_contrastive(
    d_pos: Tensor, d_neg: Tensor, alpha: float, neg_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(L̃ per anchor ``[N]`` with interpolated negatives ``λ·d⁻``, L_raw per anchor ``[N]``
    detached, the Eq. 4 loss that feeds the tracker). ``neg_mask [N,M]``: True on real negatives."""
    lam = interpolation_weights(d_pos, d_neg, alpha)
    return _positive_nll(d_pos, lam * d_neg, neg_mask), _positive_nll(
        d_pos, d_neg, neg_mask
    ).detach()


class PosProbTracker(nn.Module):
    """Mean positive probability ``p⁺_avg`` over the previous ``window`` steps (spec §8.4).

    Each update stores ``exp(-mean L_raw)`` of one step, the mean taken over every process, so all
    processes use the same α. Fixed-size buffers: the state is part of every checkpoint.
    """

    def __init__(self, window: int = 100):
        super().__init__()
        if window < 1:
            raise ValueError(f"PosProbTracker window must be >= 1, got {window}")
        self.window = window
        self.register_buffer("history", torch.zeros(window))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def p_avg(self) -> float:
        """Mean of the stored probabilities; 0.0 before the first update (α = 0, λ = 1)."""
        k = min(int(self.count), self.window)
        return float(self.history[:k].mean()) if k else 0.0

    @torch.no_grad()
    def update(self, raw_loss: Tensor) -> None:
        """Record ``exp(-raw_loss)``; ``raw_loss`` is already the global-batch mean (a scalar)."""
        self.history[int(self.count) % self.window] = torch.exp(-raw_loss.detach().float())
        self.count += 1


def global_mean_scalar(values: Tensor) -> Tensor | None:
    """The mean of ``values`` over every process's rows, detached, the same on every process (a
    collective); None when no process has a row."""
    values = values.detach().float()
    total = torch.stack([values.sum(), values.new_tensor(float(values.numel()))])
    if world_size() > 1:
        dist.all_reduce(total)
    return total[0] / total[1] if total[1] else None


def involution_pairs(n: int, generator: torch.Generator | None = None, device=None) -> Tensor:
    """A random pairing of ``n`` (even) rows: ``perm[perm[b]] == b`` and ``perm[b] != b``; the
    shuffle then pairs 0↔1, 2↔3, ... of the shuffled order (spec §8.1)."""
    if n % 2 or n < 2:
        raise ValueError(f"involution_pairs needs an even number >= 2 of rows, got {n}")
    order = torch.randperm(n, generator=generator).to(device)
    perm = torch.empty_like(order)
    perm[order[0::2]] = order[1::2]
    perm[order[1::2]] = order[0::2]
    return perm


@dataclass
class ContrastiveTerm:
    """One contrastive objective of a step: its loss (this process's share of the global mean),
    per-anchor raw losses (detached, for the tracker) and, for weak triplets, the mean KL."""

    loss: Tensor
    raw: Tensor
    kl: Tensor | None = None


def xtcl_loss(tr_src: Tensor, tr_tgt: Tensor, alpha: float) -> ContrastiveTerm:
    """XTCL (§3.3): anchor TR(x^i) vs positive TR(x^j) of the same pair; negatives are the other
    2N-2 texts of the global batch (both sides of every other pair), source side as anchor only."""
    layout = row_layout(len(tr_src), tr_src.device)
    all_src, all_tgt = gather_with_grad(tr_src, layout), gather_with_grad(tr_tgt, layout)
    total = all_src.shape[0]
    d_all = pairwise_euclidean(tr_src, torch.cat([all_src, all_tgt]))  # [n, 2N]
    rows = torch.arange(len(tr_src), device=tr_src.device)
    own = rows + layout.offset
    d_pos = d_all[rows, total + own]
    mask = torch.ones_like(d_all, dtype=torch.bool)
    mask[rows, own] = False
    mask[rows, total + own] = False
    loss_vec, raw = interpolated_contrastive(d_pos, d_all, alpha, neg_mask=mask)
    return ContrastiveTerm(layout.global_mean(loss_vec), raw)


def rxvtcl_negatives(
    anchor: Tensor, positive: Tensor, c1: Tensor, c2: Tensor, perm: Tensor
) -> Tensor:
    """The six negatives ``[N,6,D]`` of each anchor (v, x^i) with partner triplet ``perm[b]``:
    (1) (v, x̂^i), (v, x̂^j); (2) (v̂, x^i), (v̂, x^j); (3) (v̂, x̂^i), (v̂, x̂^j). ``c1``/``c2`` are the
    fused (v_b, x^i_perm[b]) / (v_b, x^j_perm[b]); type (2) are the partner's type-(1) rows."""
    return torch.stack([c1, c2, c1[perm], c2[perm], anchor[perm], positive[perm]], 1)


def relevance_kl(d_vt: Tensor, d_tr: Tensor) -> Tensor:
    """KL(P_vtr ‖ P_tr) per row ``[N]`` with ``P = softmax(-d)`` over three candidates (Eq. 10-12)."""
    logp_vt, logp_tr = (-d_vt.float()).log_softmax(1), (-d_tr.float()).log_softmax(1)
    return (logp_vt.exp() * (logp_vt - logp_tr)).sum(1)


def textual_distances(tr_i: Tensor, tr_j: Tensor, perm: Tensor) -> Tensor:
    """``d_tr [N,3]``: distances of TR(x^i) to TR(x^j), TR(x̂^i), TR(x̂^j) (the P_tr candidates)."""
    return torch.stack(
        [euclidean(tr_i, tr_j), euclidean(tr_i, tr_i[perm]), euclidean(tr_i, tr_j[perm])], 1
    )


def rxvtcl_vectors(
    anchor: Tensor,
    positive: Tensor,
    c1: Tensor,
    c2: Tensor,
    perm: Tensor,
    alpha: float,
    d_tr: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-anchor (L̃ or L̃^reg ``[N]``, L_raw ``[N]``, KL ``[N]`` or None) of one sub-batch.
    ``d_tr`` given (weak triplets with the regulariser on) adds KL(P_vtr ‖ P_tr) on the raw
    distances to the three same-image candidates (positive, type-(1) negatives)."""
    negatives = rxvtcl_negatives(anchor, positive, c1, c2, perm)
    d_pos, d_neg = euclidean(anchor, positive), euclidean(anchor, negatives)
    loss_vec, raw = interpolated_contrastive(d_pos, d_neg, alpha)
    if d_tr is None:
        return loss_vec, raw, None
    kl = relevance_kl(torch.stack([d_pos, d_neg[:, 0], d_neg[:, 1]], 1), d_tr)
    return loss_vec + kl, raw, kl
