"""The `zoom` tool: a region of the image, enlarged from the scene's finer canvas.

The region is given in the pixels of the image the agent was shown (x from the left edge, y down from the top
edge, x1/y1 exclusive). It is cut from the canvas (`scenes.render_canvas`, `detail` times finer than the
image) and resized so that its longer side is `ZOOM_SIZE` pixels, keeping its proportions (a stretched circle
would look like an ellipse). The tool returns content parts, a short text and the image:

    [{"type": "text", "text": "Zoomed in on x 30-54, y 168-192 ..."}, {"type": "image", "image": <PIL.Image>}]

A bad region raises ValueError (TypeError for a coordinate that is not an integer) with a message saying what
to change; the rollout shows it to the agent as the call's observation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentfly_jax.tools.decorator import tool
from environments.visual_scenes.scenes import render_canvas

#: Side (pixels) of the longer edge of every zoomed image.
ZOOM_SIZE = 224
#: The smallest region side (image pixels) zoom accepts: at most ZOOM_SIZE / MIN_REGION times enlarged.
MIN_REGION = 4


def _check_region(x0: Any, y0: Any, x1: Any, y1: Any, width: int, height: int) -> None:
    for name, value in (("x0", x0), ("y0", y0), ("x1", x1), ("y1", y1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r}: coordinates are whole pixels (integers)")
    for axis, low, high, size in (("x", x0, x1, width), ("y", y0, y1, height)):
        for name, value in ((f"{axis}0", low), (f"{axis}1", high)):
            if not 0 <= value <= size:
                raise ValueError(f"{name}={value} is outside the image: {axis} runs from 0 to {size}")
        if high <= low:
            raise ValueError(f"{axis}1={high} must be greater than {axis}0={low}: give the "
                             f"{'left' if axis == 'x' else 'top'} edge first")
        if high - low < MIN_REGION:
            raise ValueError(f"the region is {high - low} pixels {'wide' if axis == 'x' else 'high'}; zoom needs "
                             f"at least {MIN_REGION} pixels in each direction")


def zoom_image(scene: Mapping[str, Any], x0: int, y0: int, x1: int, y1: int):
    """The zoomed PIL image of region (x0, y0)-(x1, y1) (image pixels) of `scene`; raises ValueError for a
    region that is not inside the image or is smaller than MIN_REGION, TypeError for non-integer coordinates."""
    from PIL import Image

    width, height, detail = int(scene["width"]), int(scene["height"]), int(scene["detail"])
    _check_region(x0, y0, x1, y1, width, height)
    crop = render_canvas(scene).crop((x0 * detail, y0 * detail, x1 * detail, y1 * detail))
    span_x, span_y = x1 - x0, y1 - y0
    longer = max(span_x, span_y)
    size = (max(1, round(ZOOM_SIZE * span_x / longer)), max(1, round(ZOOM_SIZE * span_y / longer)))
    return crop.resize(size, Image.Resampling.LANCZOS)


@tool
def zoom(x0: int, y0: int, x1: int, y1: int, task: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Look closer at a rectangle of the image: returns that region enlarged, with finer detail than the
    image shows. Coordinates are pixels of the image: x from the left edge, y down from the top edge.

    Args:
      x0: left edge of the region (0 <= x0 < x1).
      y0: top edge of the region (0 <= y0 < y1).
      x1: right edge of the region (at most the image width).
      y1: bottom edge of the region (at most the image height).
    """
    scene = task["scene"]
    image = zoom_image(scene, x0, y0, x1, y1)
    factor = image.width / (x1 - x0)
    text = (f"Zoomed in on x {x0}-{x1}, y {y0}-{y1} of the {scene['width']}x{scene['height']} image, shown at "
            f"{image.width}x{image.height} pixels ({factor:.1f}x).")
    return [{"type": "text", "text": text}, {"type": "image", "image": image}]
