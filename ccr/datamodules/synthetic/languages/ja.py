"""Japanese captions, written without spaces: "左に小さい赤い円、右に青い四角形があります。"

Modifiers precede the noun (position, size, colour, shape); i-adjectives attach directly and the
others take の. Existence uses 「があります」, with each place marked by に; a background comes
first as 「背景は草で、」.
"""

from __future__ import annotations

from ..plans import CaptionPlan, Mention

CODE = "ja"
SEPARATOR = ""
FULL_STOP = "。"

SHAPES = {
    "circle": "円",
    "square": "四角形",
    "triangle": "三角形",
    "star": "星",
    "cross": "十字",
    "diamond": "ひし形",
    "hexagon": "六角形",
    "ellipse": "楕円",
}
COLOURS = {
    "red": "赤い",
    "green": "緑の",
    "blue": "青い",
    "yellow": "黄色い",
    "purple": "紫の",
    "orange": "オレンジ色の",
    "white": "白い",
    "black": "黒い",
}
SIZES = {"small": "小さい", "large": "大きい"}
POSITIONS = {"left": "左", "right": "右", "top": "上", "bottom": "下", "centre": "真ん中"}
BACKGROUNDS = {"grass": "草", "sand": "砂", "water": "水", "snow": "雪"}


def noun_phrase(mention: Mention, place_particle: str) -> list[str]:
    """Words of one object; ``place_particle`` is の (attributive) or に (existence)."""
    place = [POSITIONS[mention.position], place_particle] if mention.position else []
    size = [SIZES[mention.size]] if mention.size else []
    return [*place, *size, COLOURS[mention.colour], SHAPES[mention.shape]]


def words(plan: CaptionPlan) -> list[str]:
    background = ["背景", "は", BACKGROUNDS[plan.background], "で", "、"] if plan.background else []
    frame = plan.frame % 4
    if frame == 1:
        objects: list[str] = []
        for i, mention in enumerate(plan.mentions):
            objects += (["、"] if i else []) + noun_phrase(mention, "に")
        return background + objects + ["が", "あり", "ます"]
    objects = []
    for i, mention in enumerate(plan.mentions):
        objects += (["と"] if i else []) + noun_phrase(mention, "の")
    if frame == 0:
        return background + objects
    if frame == 2:
        return background + objects + ["が", "写っ", "て", "いる", "画像"]
    return background + ["画像", "に", "は"] + objects + ["が", "見え", "ます"]
