"""AdamW parameter groups (no weight decay on norms, biases, scalars, positions) and the
learning-rate schedules every method shares: linear warm-up, then a cosine or a linear decay."""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

# Parameters that are not weight matrices even though they have 2+ dimensions.
NO_DECAY_NAMES = (
    "pos_embed",
    "positional_embedding",
    "cls_token",
    "position_embeddings",
    "token_type_embeddings",
)


def decays(name: str, param: nn.Parameter) -> bool:
    """Weight decay only for weight matrices: never for biases, norm scales, the temperature or
    learned positions/[CLS] (1-D or named in ``NO_DECAY_NAMES``)."""
    return param.ndim >= 2 and not any(part in name for part in NO_DECAY_NAMES)


def param_groups(
    module: nn.Module, weight_decay: float, lr: float, lr_scales: Mapping[str, float] | None = None
) -> list[dict]:
    """AdamW groups over the trainable parameters of ``module``.

    ``lr_scales`` maps a parameter-name prefix to a learning-rate multiplier (e.g. 2x for newly
    initialised heads); the first matching prefix wins. Empty groups are left out.
    """
    lr_scales = dict(lr_scales or {})
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        scale = next((s for prefix, s in lr_scales.items() if name.startswith(prefix)), 1.0)
        groups.setdefault((decays(name, param), scale), []).append(param)
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0, "lr": lr * scale}
        for (decay, scale), params in groups.items()
    ]


def warmup_step_count(total_steps: int, warmup_steps: int, warmup_ratio: float | None) -> int:
    """Warm-up length: ``warmup_ratio`` of the run's optimizer steps when set (CCRk: the first 3 %),
    else the fixed ``warmup_steps``."""
    return warmup_steps if warmup_ratio is None else int(warmup_ratio * total_steps)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier at optimizer ``step`` (0-based): linear warm-up to 1 over
    ``warmup_steps`` (reached at step ``warmup_steps - 1``), then a cosine from 1 down to
    ``min_lr_ratio`` at ``total_steps``, constant afterwards."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_linear(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Like ``warmup_cosine``, but after the warm-up the multiplier falls linearly from 1 at step
    ``warmup_steps`` to ``min_lr_ratio`` at ``total_steps`` (0: the [ref] decay to zero)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


SCHEDULES = {"cosine": warmup_cosine, "linear": warmup_linear}
