"""The synthetic default world: seeded scenes of coloured shapes, rendered with PIL, captioned by a
small grammar per language (``languages/``), with knobs for translation noise, weak alignment,
partial language coverage and graded relevance. See docs/synthetic.md."""

from .languages import available as available_languages
from .scene import Scene, label_categories, relevance_matrix
from .world import (
    PRETRAIN,
    SPLITS,
    WorldKnobs,
    build_pretrain,
    build_world,
    load_split,
    parallel_text_dir,
    scene_key,
    world_dir,
)

CAPTIONS_PARALLEL = True  # caption i of every language realises the same plan (translations)

__all__ = [
    "CAPTIONS_PARALLEL",
    "PRETRAIN",
    "SPLITS",
    "Scene",
    "WorldKnobs",
    "available_languages",
    "build_pretrain",
    "build_world",
    "label_categories",
    "load_split",
    "parallel_text_dir",
    "relevance_matrix",
    "scene_key",
    "world_dir",
]
