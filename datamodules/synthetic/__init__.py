"""The synthetic default world: seeded scenes of coloured shapes, rendered with PIL, captioned by a
small grammar per language (``languages/``), with knobs for translation noise, weak alignment,
partial language coverage and graded relevance. See docs/synthetic.md."""

from .languages import available as available_languages
from .scene import Scene, relevance_matrix
from .world import SPLITS, WorldKnobs, build_world, load_split, world_dir

__all__ = [
    "SPLITS",
    "Scene",
    "WorldKnobs",
    "available_languages",
    "build_world",
    "load_split",
    "relevance_matrix",
    "world_dir",
]
