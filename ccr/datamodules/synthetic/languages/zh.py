"""Chinese captions, written without spaces: "左边有一个小的红色圆形，右边有一个蓝色正方形。"

Every object takes the classifier 个 ("一个"); modifiers precede the noun, joined by 的. Lists use
、 and a final 和; existence is 有, with the place first; a background comes first as 「背景是草地，」.
"""

from __future__ import annotations

from ..plans import CaptionPlan, Mention

CODE = "zh"
SEPARATOR = ""
FULL_STOP = "。"

SHAPES = {
    "circle": "圆形",
    "square": "正方形",
    "triangle": "三角形",
    "star": "星形",
    "cross": "十字形",
    "diamond": "菱形",
    "hexagon": "六边形",
    "ellipse": "椭圆形",
}
COLOURS = {
    "red": "红色",
    "green": "绿色",
    "blue": "蓝色",
    "yellow": "黄色",
    "purple": "紫色",
    "orange": "橙色",
    "white": "白色",
    "black": "黑色",
}
SIZES = {"small": "小", "large": "大"}
POSITIONS = {"left": "左边", "right": "右边", "top": "上面", "bottom": "下面", "centre": "中间"}
BACKGROUNDS = {"grass": "草地", "sand": "沙地", "water": "水面", "snow": "雪地"}


def bare_phrase(mention: Mention) -> list[str]:
    """一个 + size 的 + colour + shape."""
    size = [SIZES[mention.size], "的"] if mention.size else []
    return ["一", "个", *size, COLOURS[mention.colour], SHAPES[mention.shape]]


def listing(phrases: list[list[str]]) -> list[str]:
    """ "A、B和C"."""
    out: list[str] = []
    for i, phrase in enumerate(phrases):
        if i:
            out.append("和" if i == len(phrases) - 1 else "、")
        out.extend(phrase)
    return out


def words(plan: CaptionPlan) -> list[str]:
    background = ["背景", "是", BACKGROUNDS[plan.background], "，"] if plan.background else []
    frame = plan.frame % 4
    placed = [m.position is not None for m in plan.mentions]
    if frame == 1:
        if all(placed):
            clauses: list[str] = []
            for i, mention in enumerate(plan.mentions):
                clauses += (["，"] if i else []) + [
                    POSITIONS[mention.position],
                    "有",
                    *bare_phrase(mention),
                ]
            return background + clauses
        return background + ["图", "中", "有"] + listing([bare_phrase(m) for m in plan.mentions])
    objects = listing(
        [
            ([POSITIONS[m.position], "的"] if m.position else []) + bare_phrase(m)
            for m in plan.mentions
        ]
    )
    if frame == 0:
        return background + objects
    if frame == 2:
        return background + ["这", "张", "图片", "显示", "了"] + objects
    return background + ["可以", "看到"] + objects
