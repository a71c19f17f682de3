"""What one caption says about a scene, before any language puts it into words.

A plan names the objects it mentions (in the order it mentions them), which optional details it
keeps, and a sentence frame. Realising the same plan in every language yields translations of one
another, which is what makes the parallel-sentence view parallel.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .scene import Scene, SceneObject


@dataclass(frozen=True)
class Mention:
    """An object as a caption mentions it; ``size`` / ``position`` are None when left out."""

    shape: str
    colour: str
    size: str | None
    position: str | None


@dataclass(frozen=True)
class CaptionPlan:
    """The content of one caption; a language uses frame ``frame % len(its frames)``."""

    mentions: tuple[Mention, ...]
    background: str | None
    frame: int


def sample_plans(
    scene: Scene,
    objects: tuple[SceneObject, ...],
    count: int,
    mention_prob: float,
    rng: random.Random,
) -> list[CaptionPlan]:
    """``count`` paraphrase plans over ``objects``: distinct frames, shuffled order, and each
    optional detail (size, position, background) kept with probability ``mention_prob``."""
    first_frame = rng.randrange(count)
    plans = []
    for k in range(count):
        order = rng.sample(objects, len(objects))
        with_size = rng.random() < mention_prob
        with_position = rng.random() < mention_prob
        with_background = scene.background is not None and rng.random() < mention_prob
        mentions = tuple(
            Mention(
                o.shape,
                o.colour,
                o.size if with_size else None,
                o.position if with_position else None,
            )
            for o in order
        )
        plans.append(
            CaptionPlan(mentions, scene.background if with_background else None, first_frame + k)
        )
    return plans


def mistranslate(
    plan: CaptionPlan, shapes: list[str], colours: list[str], rng: random.Random
) -> CaptionPlan:
    """A machine-translation-like lexical error: one mention gets a wrong colour or shape."""
    index = rng.randrange(len(plan.mentions))
    mention = plan.mentions[index]
    if rng.random() < 0.5:
        mention = replace(
            mention, colour=rng.choice([c for c in colours if c != mention.colour] or colours)
        )
    else:
        mention = replace(
            mention, shape=rng.choice([s for s in shapes if s != mention.shape] or shapes)
        )
    mentions = plan.mentions[:index] + (mention,) + plan.mentions[index + 1 :]
    return replace(plan, mentions=mentions)


def garble(words: list[str], rng: random.Random) -> list[str]:
    """A machine-translation-like fluency error: drop, repeat or swap neighbouring words."""
    words = list(words)
    if len(words) < 3:
        return words
    i = rng.randrange(len(words) - 1)
    operation = rng.choice(("drop", "repeat", "swap"))
    if operation == "drop":
        del words[i]
    elif operation == "repeat":
        words.insert(i, words[i])
    else:
        words[i], words[i + 1] = words[i + 1], words[i]
    return words
