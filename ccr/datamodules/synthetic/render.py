"""Draw a scene as a small RGB image with PIL (deterministic: same scene and jitter, same pixels)."""

from __future__ import annotations

import math
import random

from PIL import Image, ImageDraw

from .scene import Scene, SceneObject

COLOUR_RGB = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
BACKGROUND_RGB = {
    "grass": (120, 170, 90),
    "sand": (215, 195, 150),
    "water": (110, 160, 210),
    "snow": (235, 240, 245),
}
NEUTRAL_RGB = (128, 128, 128)

# Region centres as fractions of the image side, and object radii as fractions of it.
REGION_CENTRE = {
    "left": (0.22, 0.5),
    "right": (0.78, 0.5),
    "top": (0.5, 0.22),
    "bottom": (0.5, 0.78),
    "centre": (0.5, 0.5),
}
RADIUS = {"small": 0.09, "large": 0.17}
JITTER = 0.05


def render_scene(scene: Scene, size: int, rng: random.Random) -> Image.Image:
    """Distractors first (behind), then described objects; ``rng`` jitters object centres."""
    image = Image.new("RGB", (size, size), BACKGROUND_RGB.get(scene.background, NEUTRAL_RGB))
    draw = ImageDraw.Draw(image)
    for obj in scene.distractors:
        _draw_object(draw, obj, size, rng, radius_scale=0.7)
    for obj in scene.objects:
        _draw_object(draw, obj, size, rng, radius_scale=1.0)
    return image


def _draw_object(
    draw: ImageDraw.ImageDraw, obj: SceneObject, size: int, rng: random.Random, radius_scale: float
) -> None:
    fx, fy = REGION_CENTRE[obj.position]
    cx = (fx + rng.uniform(-JITTER, JITTER)) * size
    cy = (fy + rng.uniform(-JITTER, JITTER)) * size
    r = RADIUS[obj.size] * size * radius_scale
    fill = COLOUR_RGB[obj.colour]
    box = (cx - r, cy - r, cx + r, cy + r)
    if obj.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif obj.shape == "ellipse":
        draw.ellipse((cx - r, cy - 0.55 * r, cx + r, cy + 0.55 * r), fill=fill)
    elif obj.shape == "square":
        s = 0.85 * r
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif obj.shape == "cross":
        t = 0.35 * r
        draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
        draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)
    else:
        draw.polygon(_polygon(obj.shape, cx, cy, r), fill=fill)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of the polygonal shapes, pointing up."""
    if shape == "star":
        radii = [r if i % 2 == 0 else 0.45 * r for i in range(10)]
        angles = [-math.pi / 2 + i * math.pi / 5 for i in range(10)]
    else:
        sides = {"triangle": 3, "diamond": 4, "hexagon": 6}[shape]
        radii = [r] * sides
        angles = [-math.pi / 2 + i * 2 * math.pi / sides for i in range(sides)]
    if shape == "diamond":
        radii = [r if i % 2 == 0 else 0.65 * r for i in range(4)]
    return [
        (cx + rad * math.cos(a), cy + rad * math.sin(a))
        for rad, a in zip(radii, angles, strict=True)
    ]
