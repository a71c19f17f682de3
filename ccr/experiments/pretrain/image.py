"""Pretrain the world's image encoder: a tiny timm ViT trained to name what a scene holds (its
shapes, colours, colour-shape objects, what lies in each region, the background), as a multi-label
classifier. It learns from the world's ``pretrain`` scenes only, never from the retrieval splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from ccr.datamodules.datasets import ImageTransform
from ccr.datamodules.records import Record
from ccr.datamodules.synthetic.scene import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES, Scene


@dataclass(frozen=True)
class ImageRecipe:
    """Architecture and schedule of the image backbone (``data.backbones.image``): a timm model
    name and the options that shrink it."""

    model: str = "vit_tiny_patch16_224"
    patch_size: int = 8
    embed_dim: int = 64
    depth: int = 2
    num_heads: int = 4
    steps: int = 600
    batch_size: int = 128
    lr: float = 1.0e-3
    warmup_steps: int = 50

    def timm_options(self, image_size: int) -> dict:
        return {
            "img_size": image_size,
            "patch_size": self.patch_size,
            "embed_dim": self.embed_dim,
            "depth": self.depth,
            "num_heads": self.num_heads,
        }


LABELS = (
    [f"shape:{s}" for s in SHAPES]
    + [f"colour:{c}" for c in COLOURS]
    + [f"object:{c} {s}" for c in COLOURS for s in SHAPES]
    + [f"{p}:{s}" for p in POSITIONS for s in SHAPES]
    + [f"{p}:{c}" for p in POSITIONS for c in COLOURS]
    + [f"{p}:{z}" for p in POSITIONS for z in SIZES]
    + [f"background:{b}" for b in BACKGROUNDS]
)
LABEL_INDEX = {label: i for i, label in enumerate(LABELS)}


def scene_labels(scene: Scene) -> list[str]:
    """The described objects' labels (distractors are not named, as captions do not name them)."""
    labels = [f"background:{scene.background}"] if scene.background else []
    for o in scene.objects:
        labels += [
            f"shape:{o.shape}",
            f"colour:{o.colour}",
            f"object:{o.colour} {o.shape}",
            f"{o.position}:{o.shape}",
            f"{o.position}:{o.colour}",
            f"{o.position}:{o.size}",
        ]
    return labels


def targets(records: list[Record]) -> torch.Tensor:
    multi_hot = torch.zeros(len(records), len(LABELS))
    for row, record in enumerate(records):
        for label in scene_labels(Scene.from_json(record.extras["scene"])):
            multi_hot[row, LABEL_INDEX[label]] = 1.0
    return multi_hot


def pretrain_image(
    records: list[Record],
    image_root: Path,
    transform: ImageTransform,
    recipe: ImageRecipe,
    seed: int,
) -> tuple[torch.nn.Module, float]:
    """Train the classifier for ``recipe.steps`` steps; returns it (eval mode, head included) and
    the label F1 (threshold 0.5) on the last 10 % of the records, which it never trains on."""
    import timm

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    images = torch.stack([transform(image_root / cast(str, r.image)) for r in records])
    labels = targets(records)
    held = max(1, len(records) // 10)
    train_x, train_y, test_x, test_y = images[held:], labels[held:], images[:held], labels[:held]
    model = timm.create_model(
        recipe.model,
        pretrained=False,
        num_classes=len(LABELS),
        **recipe.timm_options(images.shape[-1]),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(
            (step + 1) / max(recipe.warmup_steps, 1), max(0.05, 1 - step / max(recipe.steps, 1))
        ),
    )
    model.train()
    for _ in range(recipe.steps):
        rows = torch.randint(len(train_x), (recipe.batch_size,), generator=generator)
        loss = F.binary_cross_entropy_with_logits(model(train_x[rows]), train_y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        predicted = model(test_x) > 0
    true_positive = (predicted & (test_y > 0)).sum().item()
    f1 = 2 * true_positive / max(predicted.sum().item() + test_y.sum().item(), 1)
    return model, f1
