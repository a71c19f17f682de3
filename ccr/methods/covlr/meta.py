"""First-order meta-gradient of "take a virtual step on one task, score another task there"
(MAML-style, as in CoVLR Eq. 7), written as one loss for ordinary automatic optimisation.

For a meta-train loss ℓ_a, a meta-test loss ℓ_b and the virtual parameters Θ_v (the ones ℓ_b reads),
with Θ_v' = Θ_v − α g_a and g_a = ∇ℓ_a(Θ), first-order MAML (higher-order terms dropped) wants

    Θ_v:                 g_a + ∇_{Θ_v'} ℓ_b(Θ_v')
    other parameters:    their ∇ℓ_a plus their ∇ℓ_b(Θ_v') (heads only one task reads)

``meta_objective`` returns a scalar whose plain ``backward()`` yields exactly these gradients:
Θ_v' = Θ_v − α·sg(g_a) is built from the live parameters (Jacobian = identity, so ℓ_b's gradient
lands on Θ_v), and g_a enters through the linear term ⟨Θ, sg(g_a)⟩ whose value is cancelled. Its
value is ℓ_a(Θ) + ℓ_b(Θ'). One backward pass of ℓ_a (``autograd.grad``) and one of ℓ_b, as with
two ``manual_backward`` calls, but Lightning's gradient clipping, accumulation and DDP reduction
see a single ordinary loss.

Under several processes g_a is averaged over them before the virtual step, so Θ' is the step of
the global batch on every process and equals a single process's Θ' on that batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ccr.methods.layers.distributed import world_size


@dataclass
class MetaObjective:
    """``loss`` to backward; ``inner``/``outer`` (ℓ_a(Θ), ℓ_b(Θ'), detached) to log;
    ``inner_grads``: g_a of the virtual parameters (detached, averaged over processes)."""

    loss: Tensor
    inner: Tensor
    outer: Tensor
    inner_grads: dict[str, Tensor]


def average_over_processes(tensors: list[Tensor]) -> None:
    """In place: every tensor becomes its mean over the processes (one flat all-reduce)."""
    processes = world_size()
    if processes == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= processes
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        tensor.copy_(part.view_as(tensor))


def meta_objective(
    inner_loss: Tensor,
    params: Mapping[str, nn.Parameter],
    virtual: Collection[str],
    outer_loss: Callable[[dict[str, Tensor]], Tensor],
    alpha: float,
    second_order: bool = False,
) -> MetaObjective:
    """The loss whose gradient is the first-order meta-gradient (module docstring).

    ``params``: every trainable parameter by name; ``virtual``: the names stepped virtually;
    ``outer_loss(theta)`` evaluates ℓ_b with ``theta`` (name -> tensor, the virtual ones) in place of
    those parameters. ``second_order=True`` keeps the graph through the inner gradient (the exact
    gradient of Eq. 7, needs double backward): a diagnostic for small models on one process.
    """
    unknown = sorted(set(virtual) - set(params))
    if unknown:
        raise KeyError(f"meta_objective: virtual parameters {unknown[:3]} are not among params")
    if second_order and world_size() > 1:
        raise ValueError("meta_objective: second_order is a single-process diagnostic")
    names = [name for name, p in params.items() if p.requires_grad]
    if inner_loss.requires_grad:
        grads = torch.autograd.grad(
            inner_loss, [params[n] for n in names], allow_unused=True, create_graph=second_order
        )
    else:  # a constant meta-train loss: no step
        grads = (None,) * len(names)
    grads = dict(zip(names, grads, strict=True))
    if not second_order:
        grads = {name: None if g is None else g.detach() for name, g in grads.items()}
        average_over_processes([g for g in grads.values() if g is not None])
    shifted = {
        name: params[name] if grads[name] is None else params[name] - alpha * grads[name]
        for name in virtual
    }
    outer = outer_loss(shifted)
    if second_order:
        loss = inner_loss + outer
    else:
        linear = sum((params[n] * g).sum() for n, g in grads.items() if g is not None)
        loss = inner_loss.detach() + outer
        if torch.is_tensor(linear):
            loss = loss + (linear - linear.detach())
    inner_grads = {name: grads[name].detach() for name in virtual if grads[name] is not None}
    return MetaObjective(
        loss=loss, inner=inner_loss.detach(), outer=outer.detach(), inner_grads=inner_grads
    )
