"""Batched entropic optimal transport between two token sequences, and the word-alignment
pseudo-labels CL2CM derives from it (spec cl2cm.md §3.3, §3.9).

Every pair b of a batch has its own number of valid tokens (``M_b`` source, ``N_b`` target); the
padded positions carry no mass. The solves are log-domain Sinkhorn iterations on the whole padded
batch at once (no per-pair loop), in fp32 and without gradient: the plan is a label, not a path
for the gradient.

Variants (``variant``):

* ``balanced``: uniform marginals a = 1/M_b, b = 1/N_b, both met (total mass 1);
* ``unbalanced``: the marginals are soft constraints (KL penalty ``marginal_penalty``), so words
  with no good partner can shed mass;
* ``partial``: only ``partial_mass`` of the mass is transported, each side at most its marginal.
"""

from __future__ import annotations

import torch
from torch import Tensor

VARIANTS = ("balanced", "unbalanced", "partial")
LABEL_NORMS = ("mass", "count")


def _log_marginal(mask: Tensor) -> Tensor:
    """log of the uniform marginal over the True positions of ``mask [B, L]``; -inf elsewhere."""
    count = mask.sum(1, keepdim=True).clamp_min(1).float()
    return torch.where(mask, -count.log(), float("-inf"))


def _safe(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` where ``mask``, -inf elsewhere (also where an empty row made them NaN)."""
    return torch.where(mask, values, torch.full_like(values, float("-inf")))


@torch.no_grad()
def sinkhorn_plan(
    similarity: Tensor,
    source_mask: Tensor,
    target_mask: Tensor,
    *,
    epsilon: float = 0.1,
    iterations: int = 100,
    variant: str = "balanced",
    marginal_penalty: float = 1.0,
    partial_mass: float = 0.8,
) -> Tensor:
    """The entropic transport plan ``A [B, Ls, Lt]`` for cost ``1 - similarity``.

    ``similarity [B, Ls, Lt]`` (cosines), ``source_mask [B, Ls]`` / ``target_mask [B, Lt]`` bool
    (True on the words). Padded rows and columns of the plan are exactly 0. The balanced plan ends
    on the target update, so its column sums are exactly 1/N_b.
    """
    if variant not in VARIANTS:
        raise ValueError(f"OT variant {variant!r}: expected one of {VARIANTS}")
    source_mask, target_mask = source_mask.bool(), target_mask.bool()
    valid = source_mask[:, :, None] & target_mask[:, None, :]
    log_kernel = _safe((similarity.detach().float() - 1.0) / epsilon, valid)
    log_a, log_b = _log_marginal(source_mask), _log_marginal(target_mask)
    if variant == "partial":
        return _partial_plan(
            log_kernel, log_a, log_b, source_mask, target_mask, partial_mass, iterations
        )
    # Scalings u = exp(log_u), v = exp(log_v); the plan is diag(u) K diag(v).
    power = 1.0 if variant == "balanced" else marginal_penalty / (marginal_penalty + epsilon)
    log_u, log_v = torch.zeros_like(log_a), torch.zeros_like(log_b)
    for _ in range(iterations):
        row = torch.logsumexp(log_kernel + log_v[:, None, :], dim=2)
        log_u = _safe(power * (log_a - row), source_mask)
        column = torch.logsumexp(log_kernel + log_u[:, :, None], dim=1)
        log_v = _safe(power * (log_b - column), target_mask)
    return (log_u[:, :, None] + log_kernel + log_v[:, None, :]).exp()


def _partial_plan(log_kernel, log_a, log_b, source_mask, target_mask, mass, iterations) -> Tensor:
    """Entropic partial transport by iterated Bregman projections: rows capped at a, columns
    capped at b, total mass rescaled to ``mass`` (each pair's own total)."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"partial OT mass {mass} must be in (0, 1]")
    log_plan = log_kernel
    log_mass = torch.log(torch.tensor(mass))
    for _ in range(iterations):
        rows = torch.logsumexp(log_plan, dim=2)
        log_plan = log_plan + _safe((log_a - rows).clamp_max(0.0), source_mask)[:, :, None]
        columns = torch.logsumexp(log_plan, dim=1)
        log_plan = log_plan + _safe((log_b - columns).clamp_max(0.0), target_mask)[:, None, :]
        total = torch.logsumexp(log_plan.flatten(1), dim=1)
        log_plan = (
            log_plan + torch.nan_to_num(log_mass - total, posinf=0.0, neginf=0.0)[:, None, None]
        )
    return log_plan.exp()


@torch.no_grad()
def ot_pseudo_labels(
    plan: Tensor, source_mask: Tensor, target_mask: Tensor, norm: str = "mass"
) -> tuple[Tensor, Tensor]:
    """Thresholded word-alignment labels from a plan: keep entries above the pair's mean plan
    value over its valid entries (γ_b), then normalise each source row by its kept mass
    (``norm="mass"``, a distribution per word) or by its kept count (``"count"``, Eq. 9 literally).

    Returns ``labels [B, Ls, Lt]`` and ``rows [B, Ls]`` (source words with a kept entry; the
    others get no label and are left out of the loss).
    """
    if norm not in LABEL_NORMS:
        raise ValueError(f"word_label_norm {norm!r}: expected one of {LABEL_NORMS}")
    valid = source_mask.bool()[:, :, None] & target_mask.bool()[:, None, :]
    gamma = (plan * valid).sum((1, 2)) / valid.sum((1, 2)).clamp_min(1)
    keep = (plan > gamma[:, None, None]) & valid
    kept = plan * keep
    denominator = kept.sum(2, keepdim=True) if norm == "mass" else keep.sum(2, keepdim=True).float()
    rows = source_mask.bool() & (denominator.squeeze(2) > 0)
    labels = torch.where(
        rows[:, :, None], kept / denominator.clamp_min(1e-30), torch.zeros_like(kept)
    )
    return labels, rows


@torch.no_grad()
def attention_pseudo_labels(
    source_states: Tensor, target_states: Tensor, source_mask: Tensor, target_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """The ablation's alternative labels: softmax over target words of h^s_m · h^t_n / sqrt(H),
    used directly for every source word (no thresholding)."""
    scale = source_states.shape[-1] ** -0.5
    scores = torch.einsum("bmh,bnh->bmn", source_states.float(), target_states.float()) * scale
    scores = scores.masked_fill(~target_mask.bool()[:, None, :], float("-inf"))
    rows = source_mask.bool() & target_mask.bool().any(1, keepdim=True)
    labels = torch.where(
        rows[:, :, None], scores.softmax(2).nan_to_num(0.0), torch.zeros_like(scores)
    )
    return labels, rows
