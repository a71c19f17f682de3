"""Czech captions: "Na obrázku je malý červený kruh vlevo a velká modrá hvězda."

Nouns are masculine inanimate or feminine; hard adjectives agree in gender and case (-ý/-á in the
nominative, -ý/-ou in the accusative) and feminine nouns in -a take -u in the accusative. The verb
"být" agrees in number with the coordinated subject (je / jsou).
"""

from __future__ import annotations

from ..plans import CaptionPlan, Mention

CODE = "cs"
SEPARATOR = " "
FULL_STOP = "."

SHAPES = {
    "circle": ("kruh", "m"),
    "square": ("čtverec", "m"),
    "triangle": ("trojúhelník", "m"),
    "star": ("hvězda", "f"),
    "cross": ("kříž", "m"),
    "diamond": ("kosočtverec", "m"),
    "hexagon": ("šestiúhelník", "m"),
    "ellipse": ("elipsa", "f"),
}
COLOURS = {
    "red": "červen",
    "green": "zelen",
    "blue": "modr",
    "yellow": "žlut",
    "purple": "fialov",
    "orange": "oranžov",
    "white": "bíl",
    "black": "čern",
}  # hard-adjective stems
SIZES = {"small": "mal", "large": "velk"}
POSITIONS = {
    "left": "vlevo",
    "right": "vpravo",
    "top": "nahoře",
    "bottom": "dole",
    "centre": "uprostřed",
}
BACKGROUNDS = {"grass": "v trávě", "sand": "v písku", "water": "ve vodě", "snow": "ve sněhu"}

ADJECTIVE_ENDING = {("nom", "m"): "ý", ("nom", "f"): "á", ("acc", "m"): "ý", ("acc", "f"): "ou"}


def noun_form(noun: str, gender: str, case: str) -> str:
    if gender == "f" and case == "acc":
        return noun[:-1] + "u"
    return noun


def noun_phrase(mention: Mention, case: str) -> list[str]:
    noun, gender = SHAPES[mention.shape]
    stems = ([SIZES[mention.size]] if mention.size else []) + [COLOURS[mention.colour]]
    adjectives = [stem + ADJECTIVE_ENDING[case, gender] for stem in stems]
    position = [POSITIONS[mention.position]] if mention.position else []
    return [*adjectives, noun_form(noun, gender, case), *position]


def listing(mentions: tuple[Mention, ...], case: str) -> list[str]:
    """ "A, B a C"."""
    out: list[str] = []
    for i, mention in enumerate(mentions):
        if i == len(mentions) - 1 and i > 0:
            out.append("a")
        out.extend(noun_phrase(mention, case))
        if i < len(mentions) - 2:
            out[-1] += ","
    return out


def words(plan: CaptionPlan) -> list[str]:
    background = BACKGROUNDS[plan.background].split() if plan.background else []
    frame = plan.frame % 4
    if frame == 0:
        return listing(plan.mentions, "nom") + background
    if frame == 1:
        verb = "je" if len(plan.mentions) == 1 else "jsou"
        place = background or ["na", "obrázku"]
        return place + [verb] + listing(plan.mentions, "nom")
    opener = ["obrázek", "ukazuje"] if frame == 2 else ["vidíme"]
    return opener + listing(plan.mentions, "acc") + background
