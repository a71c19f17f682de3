"""French captions: "Il y a un petit cercle rouge à gauche et une grande étoile blanche."

Nouns carry gender; the article, the size adjective (before the noun) and the colour adjective
(after the noun) agree with it.
"""

from __future__ import annotations

from ..plans import CaptionPlan, Mention

CODE = "fr"
SEPARATOR = " "
FULL_STOP = "."

SHAPES = {
    "circle": ("cercle", "m"),
    "square": ("carré", "m"),
    "triangle": ("triangle", "m"),
    "star": ("étoile", "f"),
    "cross": ("croix", "f"),
    "diamond": ("losange", "m"),
    "hexagon": ("hexagone", "m"),
    "ellipse": ("ellipse", "f"),
}
COLOURS = {
    "red": ("rouge", "rouge"),
    "green": ("vert", "verte"),
    "blue": ("bleu", "bleue"),
    "yellow": ("jaune", "jaune"),
    "purple": ("violet", "violette"),
    "orange": ("orange", "orange"),
    "white": ("blanc", "blanche"),
    "black": ("noir", "noire"),
}
SIZES = {"small": ("petit", "petite"), "large": ("grand", "grande")}
POSITIONS = {
    "left": "à gauche",
    "right": "à droite",
    "top": "en haut",
    "bottom": "en bas",
    "centre": "au centre",
}
BACKGROUNDS = {
    "grass": "dans l'herbe",
    "sand": "dans le sable",
    "water": "dans l'eau",
    "snow": "dans la neige",
}
GENDER_INDEX = {"m": 0, "f": 1}


def noun_phrase(mention: Mention) -> list[str]:
    noun, gender = SHAPES[mention.shape]
    g = GENDER_INDEX[gender]
    size = [SIZES[mention.size][g]] if mention.size else []
    position = POSITIONS[mention.position].split() if mention.position else []
    return ["un" if gender == "m" else "une", *size, noun, COLOURS[mention.colour][g], *position]


def listing(mentions: tuple[Mention, ...]) -> list[str]:
    """ "A, B et C"."""
    out: list[str] = []
    for i, mention in enumerate(mentions):
        if i == len(mentions) - 1 and i > 0:
            out.append("et")
        out.extend(noun_phrase(mention))
        if i < len(mentions) - 2:
            out[-1] += ","
    return out


def words(plan: CaptionPlan) -> list[str]:
    objects = listing(plan.mentions)
    background = BACKGROUNDS[plan.background].split() if plan.background else []
    frame = plan.frame % 4
    if frame == 0:
        return objects + background
    if frame == 1:
        if background:
            background[-1] += ","
            return background + ["il", "y", "a"] + objects
        return ["il", "y", "a"] + objects
    opener = ["l'image", "montre"] if frame == 2 else ["on", "voit"]
    return opener + objects + background
