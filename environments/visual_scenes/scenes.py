"""Scenes of coloured shapes: a JSON-able description drawn from a seed, and its renderings.

A scene is a plain dict (so task rows stay small, compare by value and serialise):

    {"width": 224, "height": 224, "detail": 4,
     "objects": [{"shape": "star", "color": "red", "size": 7, "x": 41, "y": 180}, ...],
     "distractors": [{"size": 2, "x": 120, "y": 33}, ...]}

Everything is in *image* pixels, the pixels of the picture the agent is shown (`width` x `height`): an
object's `x`, `y` is the centre of its square bounding box of side `size`. Objects' boxes never overlap and
keep `GAP` pixels apart, so every object is its own blob of one colour. Distractors are small grey specks that
are not shapes (questions never count them).

Two renderings, why two: `render_canvas` draws the scene `detail` times finer (no anti-aliasing: every pixel
is the background, grey or one palette colour, which lets tests check the scene by its pixels), and
`render_image` is that canvas averaged down to the image size (`Image.BOX`), the supersampled picture the agent
gets. A tiny object (`TINY_SIZES`, 5-7 image pixels) is a smudge of roughly the right colour in the image, but
its outline is clear on the canvas; the zoom tool crops the canvas, so zooming in shows detail the image does
not have, as with a photograph taken at a higher resolution than it is displayed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

#: Palette: colour name -> RGB. Far apart in RGB so that every colour stays recognisable when a tiny object
#: is averaged with the white background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 80, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 50, 180),
    "orange": (245, 130, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
DISTRACTOR_COLOR: tuple[int, int, int] = (128, 128, 128)

#: Side of a tiny object's bounding box in image pixels: too small to tell its shape without zooming.
TINY_SIZES = (5, 7)
#: Side of any other object's bounding box in image pixels.
NORMAL_SIZES = (16, 44)
#: Side of a distractor speck in image pixels.
DISTRACTOR_SIZES = (2, 3)
#: Minimum empty pixels between two bounding boxes (objects and distractors alike) and to the image border.
GAP = 4
#: A star's inner radius over its outer radius (a fat star: its area is far from a triangle's, see `area`).
STAR_INNER_RATIO = 0.45


def box(item: Mapping[str, Any]) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of an object's or distractor's bounding box in image pixels (x1, y1 exclusive)."""
    half = item["size"] / 2
    return item["x"] - half, item["y"] - half, item["x"] + half, item["y"] + half


def is_tiny(item: Mapping[str, Any]) -> bool:
    """Whether an object is tiny (its shape cannot be made out in the image without zooming)."""
    return item["size"] <= TINY_SIZES[1]


def area(item: Mapping[str, Any]) -> float:
    """An object's area in square image pixels, from its geometry (what `render_canvas` fills)."""
    side = float(item["size"])
    shape = item["shape"]
    if shape == "square":
        return side * side
    if shape == "circle":
        return math.pi * side * side / 4
    if shape == "triangle":
        return side * side / 2
    if shape == "star":
        outer = side / 2
        return 5 * outer * (outer * STAR_INNER_RATIO) * math.sin(math.radians(36))
    raise ValueError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")


def _separated(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[2] + GAP <= b[0] or b[2] + GAP <= a[0] or a[3] + GAP <= b[1] or b[3] + GAP <= a[1]


def _place(rng: random.Random, size: int, width: int, height: int, taken: list[tuple[float, ...]],
           tries: int = 200) -> tuple[int, int] | None:
    """A centre for a box of side `size` clear of `taken` and the border, or None when none was found."""
    low = GAP + (size + 1) // 2
    if width - low < low or height - low < low:
        return None
    for _ in range(tries):
        x, y = rng.randint(low, width - low), rng.randint(low, height - low)
        candidate = box({"x": x, "y": y, "size": size})
        if all(_separated(candidate, other) for other in taken):
            return x, y
    return None


def generate_scene(rng: random.Random, *, width: int = 224, height: int = 224, detail: int = 4,
                   num_objects: tuple[int, int] = (4, 8), num_tiny: tuple[int, int] = (1, 3),
                   num_distractors: tuple[int, int] = (0, 4)) -> dict[str, Any]:
    """A scene drawn from `rng`: between `num_objects` objects (of which `num_tiny` tiny, never all of them)
    with random shape, colour, size and position, plus `num_distractors` grey specks. Deterministic in the
    rng's state. An object that finds no free place (a crowded small image) is left out, so a scene may hold
    fewer objects than drawn, but always at least one normal-sized object."""
    count = rng.randint(*num_objects)
    tiny = min(rng.randint(*num_tiny), count - 1)
    sizes = [rng.randint(*NORMAL_SIZES) for _ in range(count - tiny)] + [rng.randint(*TINY_SIZES)
                                                                       for _ in range(tiny)]
    sizes.sort(reverse=True)  # big ones first: they are the hardest to place
    taken: list[tuple[float, ...]] = []
    objects = []
    for size in sizes:
        shape, color = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        where = _place(rng, size, width, height, taken)
        if where is None:
            continue
        item = {"shape": shape, "color": color, "size": size, "x": where[0], "y": where[1]}
        taken.append(box(item))
        objects.append(item)
    if not any(not is_tiny(o) for o in objects):
        raise ValueError(f"a {width}x{height} image has no room for a {sizes[0]}-pixel object; use a larger image")
    rng.shuffle(objects)  # list order carries no hint of size
    distractors = []
    for _ in range(rng.randint(*num_distractors)):
        size = rng.randint(*DISTRACTOR_SIZES)
        where = _place(rng, size, width, height, taken)
        if where is not None:
            item = {"size": size, "x": where[0], "y": where[1]}
            taken.append(box(item))
            distractors.append(item)
    return {"width": width, "height": height, "detail": detail, "objects": objects, "distractors": distractors}


# ------------------------------------------------------------------------------------------------ rendering
def _outline(item: Mapping[str, Any], scale: float) -> tuple[str, list[tuple[float, float]]]:
    """('ellipse' | 'polygon', points) of an object in canvas pixels (`scale` canvas pixels per image pixel).

    Boxes are drawn from their left/top edge to one canvas pixel short of the right/bottom edge, because
    PIL fills both end points of a rectangle or ellipse."""
    x0, y0, x1, y1 = (value * scale for value in box(item))
    right, bottom = x1 - 1, y1 - 1
    shape = item["shape"]
    if shape == "circle":
        return "ellipse", [(x0, y0), (right, bottom)]
    if shape == "square":
        return "polygon", [(x0, y0), (right, y0), (right, bottom), (x0, bottom)]
    if shape == "triangle":
        return "polygon", [((x0 + right) / 2, y0), (right, bottom), (x0, bottom)]
    if shape == "star":
        cx, cy, outer = (x0 + right) / 2, (y0 + bottom) / 2, (right - x0) / 2
        points = []
        for k in range(10):
            radius = outer if k % 2 == 0 else outer * STAR_INNER_RATIO
            angle = math.radians(-90 + 36 * k)
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        return "polygon", points
    raise ValueError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")


def render_canvas(scene: Mapping[str, Any]):
    """The scene drawn at `detail` canvas pixels per image pixel, without anti-aliasing (a PIL RGB image of
    width*detail x height*detail)."""
    from PIL import Image, ImageDraw

    scale = int(scene["detail"])
    canvas = Image.new("RGB", (int(scene["width"]) * scale, int(scene["height"]) * scale), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for speck in scene["distractors"]:
        x0, y0, x1, y1 = (value * scale for value in box(speck))
        draw.ellipse([(x0, y0), (x1 - 1, y1 - 1)], fill=DISTRACTOR_COLOR)
    for item in scene["objects"]:
        kind, points = _outline(item, scale)
        color = COLORS[item["color"]]
        if kind == "ellipse":
            draw.ellipse(points, fill=color)
        else:
            draw.polygon(points, fill=color)
    return canvas


def render_image(scene: Mapping[str, Any]):
    """The picture the agent is shown: the canvas averaged down to width x height (supersampled)."""
    from PIL import Image

    canvas = render_canvas(scene)
    return canvas.resize((int(scene["width"]), int(scene["height"])), Image.Resampling.BOX)


def describe_object(item: Mapping[str, Any]) -> str:
    """'the red star at (41, 180)': how the questions and demonstrations name an object."""
    return f"the {item['color']} {item['shape']} at ({item['x']}, {item['y']})"
