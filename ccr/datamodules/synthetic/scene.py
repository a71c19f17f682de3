"""Scenes of the synthetic world: what objects an image holds, and how alike two scenes are.

Attribute values are canonical English keys; every language file translates the same keys, and
the difficulty knobs ``num_shapes`` / ``num_colours`` take the first values of these lists.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

SHAPES = ["circle", "square", "triangle", "star", "cross", "diamond", "hexagon", "ellipse"]
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SIZES = ["small", "large"]
POSITIONS = ["left", "right", "top", "bottom", "centre"]
BACKGROUNDS = ["grass", "sand", "water", "snow"]


@dataclass(frozen=True)
class SceneObject:
    """One shape in a scene; ``position`` is one of five regions, unique within a scene."""

    shape: str
    colour: str
    size: str
    position: str

    @property
    def label(self) -> str:
        """The object label methods see (``extras["objects"]``): colour and shape."""
        return f"{self.colour} {self.shape}"

    @property
    def category(self) -> str:
        """The label's category, the world's analogue of a COCO object category: the shape."""
        return self.shape


@dataclass(frozen=True)
class Scene:
    """The described objects, unmentioned distractor objects, and an optional background."""

    objects: tuple[SceneObject, ...]
    distractors: tuple[SceneObject, ...]
    background: str | None

    def to_json(self) -> dict:
        return {
            "objects": [asdict(o) for o in self.objects],
            "distractors": [asdict(o) for o in self.distractors],
            "background": self.background,
        }

    @classmethod
    def from_json(cls, raw: dict) -> Scene:
        return cls(
            tuple(SceneObject(**o) for o in raw["objects"]),
            tuple(SceneObject(**o) for o in raw["distractors"]),
            raw["background"],
        )


def label_categories(scene_json: dict) -> dict[str, str]:
    """Label -> category of the described objects of one record's scene (``extras["scene"]``)."""
    return {o.label: o.category for o in Scene.from_json(scene_json).objects}


def sample_scene(
    rng: random.Random,
    *,
    num_shapes: int,
    num_colours: int,
    max_objects: int,
    distractors: int,
    background_prob: float,
) -> Scene:
    """Draw 1..max_objects described objects with distinct (colour, shape) and distinct regions,
    plus ``distractors`` small unmentioned objects anywhere, and a background with
    ``background_prob``."""
    shapes, colours = SHAPES[:num_shapes], COLOURS[:num_colours]
    count = rng.randint(1, max_objects)
    kinds = rng.sample([(s, c) for s in shapes for c in colours], count)
    regions = rng.sample(POSITIONS, count)
    objects = tuple(
        SceneObject(shape, colour, rng.choice(SIZES), region)
        for (shape, colour), region in zip(kinds, regions, strict=True)
    )
    extra = tuple(
        SceneObject(rng.choice(shapes), rng.choice(colours), "small", rng.choice(POSITIONS))
        for _ in range(distractors)
    )
    background = rng.choice(BACKGROUNDS) if rng.random() < background_prob else None
    return Scene(objects, extra, background)


def relevance_matrix(scenes: list[Scene]) -> torch.Tensor:
    """Graded scene-to-scene relevance in [0, 1] ([N, N], 1 on the diagonal).

    Two objects match with 0.5 per shared shape and colour, plus 0.25 for the size once shape and
    colour both agree (so identical objects score 1.25 before normalising). Each object in one scene
    takes its best match in the other; the symmetric mean of those scores, divided by 1.25, is the
    relevance. Distractors and backgrounds are ignored: relevance follows what captions describe.
    """
    width = max(len(s.objects) for s in scenes)
    codes = np.full((len(scenes), width, 3), -1, dtype=np.int64)
    for i, scene in enumerate(scenes):
        for j, obj in enumerate(scene.objects):
            codes[i, j] = (
                SHAPES.index(obj.shape),
                COLOURS.index(obj.colour),
                SIZES.index(obj.size),
            )
    rows = [
        _relevance_rows(codes[start : start + 256], codes) for start in range(0, len(scenes), 256)
    ]
    return torch.from_numpy(np.concatenate(rows).astype(np.float32))


def _relevance_rows(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Relevance of a chunk of scenes (encoded [R, W, 3], -1 padded) against all scenes."""
    a, b = rows[:, None, :, None, :], cols[None, :, None, :, :]  # [R,1,W,1,3] and [1,N,1,W,3]
    same_shape, same_colour = a[..., 0] == b[..., 0], a[..., 1] == b[..., 1]
    same_size = a[..., 2] == b[..., 2]
    sim = 0.5 * same_shape + 0.5 * same_colour + 0.25 * (same_shape & same_colour & same_size)
    row_valid, col_valid = rows[..., 0] >= 0, cols[..., 0] >= 0
    sim = np.where(row_valid[:, None, :, None] & col_valid[None, :, None, :], sim, 0.0)
    best_row = sim.max(axis=3).sum(axis=2)  # each row-scene object's best match in the column scene
    best_col = sim.max(axis=2).sum(axis=2)
    counts = row_valid.sum(axis=1)[:, None] + col_valid.sum(axis=1)[None, :]
    return (best_row + best_col) / counts / 1.25
