"""German captions: "Im Gras gibt es einen kleinen roten Kreis links und ein blaues Dreieck."

Nouns carry gender (m/f/n); after the indefinite article every adjective takes the mixed
declension ending of the noun's gender and case (nominative or accusative, depending on the
frame). A fronted place phrase moves the verb to second position ("Im Gras gibt es ...").
"""

from __future__ import annotations

from ..plans import CaptionPlan, Mention

CODE = "de"
SEPARATOR = " "
FULL_STOP = "."

SHAPES = {
    "circle": ("Kreis", "m"),
    "square": ("Quadrat", "n"),
    "triangle": ("Dreieck", "n"),
    "star": ("Stern", "m"),
    "cross": ("Kreuz", "n"),
    "diamond": ("Raute", "f"),
    "hexagon": ("Sechseck", "n"),
    "ellipse": ("Ellipse", "f"),
}
COLOURS = {
    "red": "rot",
    "green": "grün",
    "blue": "blau",
    "yellow": "gelb",
    "purple": "violett",
    "orange": "orangefarben",
    "white": "weiß",
    "black": "schwarz",
}
SIZES = {"small": "klein", "large": "groß"}
POSITIONS = {
    "left": "links",
    "right": "rechts",
    "top": "oben",
    "bottom": "unten",
    "centre": "in der Mitte",
}
BACKGROUNDS = {"grass": "im Gras", "sand": "im Sand", "water": "im Wasser", "snow": "im Schnee"}

ARTICLE = {
    ("nom", "m"): "ein",
    ("nom", "f"): "eine",
    ("nom", "n"): "ein",
    ("acc", "m"): "einen",
    ("acc", "f"): "eine",
    ("acc", "n"): "ein",
}
ENDING = {
    ("nom", "m"): "er",
    ("nom", "f"): "e",
    ("nom", "n"): "es",
    ("acc", "m"): "en",
    ("acc", "f"): "e",
    ("acc", "n"): "es",
}


def noun_phrase(mention: Mention, case: str) -> list[str]:
    noun, gender = SHAPES[mention.shape]
    stems = ([SIZES[mention.size]] if mention.size else []) + [COLOURS[mention.colour]]
    adjectives = [stem + ENDING[case, gender] for stem in stems]
    position = POSITIONS[mention.position].split() if mention.position else []
    return [ARTICLE[case, gender], *adjectives, noun, *position]


def listing(mentions: tuple[Mention, ...], case: str) -> list[str]:
    """ "A, B und C"."""
    out: list[str] = []
    for i, mention in enumerate(mentions):
        if i == len(mentions) - 1 and i > 0:
            out.append("und")
        out.extend(noun_phrase(mention, case))
        if i < len(mentions) - 2:
            out[-1] += ","
    return out


def words(plan: CaptionPlan) -> list[str]:
    background = BACKGROUNDS[plan.background].split() if plan.background else []
    frame = plan.frame % 4
    if frame == 0:
        return listing(plan.mentions, "nom") + background
    objects = listing(plan.mentions, "acc")
    if frame == 1:
        return background + ["gibt", "es"] + objects if background else ["es", "gibt"] + objects
    opener = ["das", "Bild", "zeigt"] if frame == 2 else ["man", "sieht"]
    return opener + objects + background
