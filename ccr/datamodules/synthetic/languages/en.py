"""English captions: "There is a small red circle on the left and an orange star."

Adjectives precede the noun (size, then colour); the article is "an" before a vowel sound.
"""

from __future__ import annotations

from ..plans import CaptionPlan, Mention

CODE = "en"
SEPARATOR = " "
FULL_STOP = "."

SHAPES = {
    "circle": "circle",
    "square": "square",
    "triangle": "triangle",
    "star": "star",
    "cross": "cross",
    "diamond": "diamond",
    "hexagon": "hexagon",
    "ellipse": "ellipse",
}
COLOURS = {
    "red": "red",
    "green": "green",
    "blue": "blue",
    "yellow": "yellow",
    "purple": "purple",
    "orange": "orange",
    "white": "white",
    "black": "black",
}
SIZES = {"small": "small", "large": "large"}
POSITIONS = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "centre": "in the centre",
}
BACKGROUNDS = {
    "grass": "on the grass",
    "sand": "on the sand",
    "water": "on the water",
    "snow": "on the snow",
}


def noun_phrase(mention: Mention) -> list[str]:
    words = ([SIZES[mention.size]] if mention.size else []) + [
        COLOURS[mention.colour],
        SHAPES[mention.shape],
    ]
    article = "an" if words[0][0] in "aeiou" else "a"
    position = POSITIONS[mention.position].split() if mention.position else []
    return [article, *words, *position]


def listing(mentions: tuple[Mention, ...]) -> list[str]:
    """ "A, B and C"."""
    phrases = [noun_phrase(m) for m in mentions]
    out: list[str] = []
    for i, phrase in enumerate(phrases):
        if i == len(phrases) - 1 and i > 0:
            out.append("and")
        out.extend(phrase)
        if i < len(phrases) - 2:
            out[-1] += ","
    return out


def words(plan: CaptionPlan) -> list[str]:
    objects = listing(plan.mentions)
    background = BACKGROUNDS[plan.background].split() if plan.background else []
    frame = plan.frame % 4
    if frame == 0:
        if background:
            objects[-1] += ","
        return objects + background
    if frame == 1:
        return background + ["there", "is"] + objects if background else ["there", "is"] + objects
    opener = ["the", "picture", "shows"] if frame == 2 else ["we", "can", "see"]
    return opener + objects + background
