"""Task rows of the visual_scenes environment: one generated scene and one question per row, split by seed.

Splits. Row `i` of a split is drawn from `random.Random(scene_seed(split, seed, i))`, and every (split, seed)
owns its own block of `SEED_SPAN` scene seeds, so the splits never share a generator seed and every split is
deterministic and prefix-stable (the first `n` rows are the same for any larger `n`).

Row fields:
- `question`: the question text (what the user message says next to the image);
- `images`: the pictures the first user message shows, before the question: a `SceneImages`, a sequence of
  one PIL RGB image rendered when read (rows stay a few hundred bytes, not 150 KB, and compare by value);
  `first_user_message(row)` builds the message;
- `answer` (exact short answer), `answer_type` ("number", "color", "shape", "yes/no"), `question_type`,
  `query` (the question as data, `environments.visual_scenes.questions`);
- `scene` (the JSON-able scene description the zoom tool draws from, `environments.visual_scenes.scenes`),
  `scene_seed`, `id`;
- `needs_zoom` and `zoom_regions`: whether the answer depends on the shapes of tiny objects, and one region
  [x0, y0, x1, y1] around each of the fewest tiny objects whose shapes settle it (what the oracle zooms on;
  `questions.tiny_objects_to_zoom`).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from environments.visual_scenes.questions import (
    QUESTION_TYPES,
    answer_query,
    answer_type,
    draw_query,
    question_text,
    tiny_objects_to_zoom,
)
from environments.visual_scenes.scenes import generate_scene, render_image

SPLITS = ("train", "dev", "test")
#: Scene seeds per (split, seed); a split's size must stay below it.
SEED_SPAN = 10_000_000
#: Side of the square the oracle zooms on around a tiny object, in image pixels.
ZOOM_REGION_SIDE = 24


def scene_seed(split: str, seed: int, index: int) -> int:
    """The generator seed of row `index` of a split: disjoint blocks of SEED_SPAN seeds per (split, seed)."""
    if split not in SPLITS:
        raise ValueError(f"unknown visual_scenes split {split!r}; expected one of {list(SPLITS)}")
    if not 0 <= index < SEED_SPAN:
        raise ValueError(f"row index {index} is outside 0..{SEED_SPAN - 1}")
    return (int(seed) * len(SPLITS) + SPLITS.index(split)) * SEED_SPAN + index


class SceneImages(Sequence):
    """The images of a row's first user message: one PIL RGB image of the scene, rendered when read.

    A read-only sequence (len 1; iterate or index it); equal when the scenes are equal. A row holds only its
    scene description and a weak reference to the last image rendered: while anything still holds that image
    (e.g. a rollout's encoder cache, which prepares a prompt image once per object for all of a task's
    chains), reading it again gives the same object; otherwise it is rendered again (a few milliseconds)."""

    def __init__(self, scene: Mapping[str, Any]):
        self.scene = scene
        self._last: weakref.ref | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"scene": self.scene}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.scene, self._last = state["scene"], None

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(1))]
        if index not in (0, -1):
            raise IndexError(f"a scene has one image; index {index} is out of range")
        image = self._last() if self._last is not None else None
        if image is None:
            image = render_image(self.scene)
            self._last = weakref.ref(image)
        return image

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SceneImages) and self.scene == other.scene

    def __hash__(self) -> int:
        return hash(repr(self.scene))

    def __repr__(self) -> str:
        return f"SceneImages(1 image, {self.scene['width']}x{self.scene['height']})"


def first_user_message(task: Mapping[str, Any]) -> dict[str, Any]:
    """The conversation's first user message: the row's images, then its question, as content parts."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in task["images"]]
    parts.append({"type": "text", "text": task["question"]})
    return {"role": "user", "content": parts}


def zoom_region(item: Mapping[str, Any], width: int, height: int, side: int = ZOOM_REGION_SIDE) -> list[int]:
    """A region [x0, y0, x1, y1] of at least `side` pixels a side around an object, inside the image."""
    side = max(side, int(item["size"]) + 4)
    x0 = min(max(0, int(item["x"]) - side // 2), max(0, width - side))
    y0 = min(max(0, int(item["y"]) - side // 2), max(0, height - side))
    return [x0, y0, min(width, x0 + side), min(height, y0 + side)]


def make_row(split: str, seed: int, index: int, *, image_size: int, detail: int, num_objects: tuple[int, int],
             num_tiny: tuple[int, int], num_distractors: tuple[int, int],
             question_types: tuple[str, ...] = QUESTION_TYPES) -> dict[str, Any]:
    """Row `index` of a split (see the module docstring for its fields)."""
    row_seed = scene_seed(split, seed, index)
    rng = random.Random(row_seed)
    scene = generate_scene(rng, width=image_size, height=image_size, detail=detail, num_objects=num_objects,
                           num_tiny=num_tiny, num_distractors=num_distractors)
    query = draw_query(scene, rng, question_types)
    to_zoom = tiny_objects_to_zoom(scene, query)
    return {
        "id": f"visual_scenes-{split}-{seed}-{index}",
        "question": question_text(query),
        "images": SceneImages(scene),
        "answer": answer_query(scene, query),
        "answer_type": answer_type(query),
        "question_type": query["type"],
        "query": query,
        "scene": scene,
        "scene_seed": row_seed,
        "needs_zoom": bool(to_zoom),
        "zoom_regions": [zoom_region(scene["objects"][i], image_size, image_size) for i in to_zoom],
    }


def generate_split(split: str, num: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    """Rows 0..num-1 of `split` (options: `make_row`'s keywords)."""
    if not 0 <= num < SEED_SPAN:
        raise ValueError(f"asked for {num} rows; a split holds 0 to {SEED_SPAN - 1}")
    return [make_row(split, seed, index, **options) for index in range(num)]
