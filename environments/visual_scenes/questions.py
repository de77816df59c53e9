"""Questions about a scene with one exact, short answer, and which tiny objects the answer depends on.

A question is a JSON-able `query` dict; `answer_query(scene, query)` computes its answer from the scene
description alone (never from pixels) and `question_text(query)` words it:

    {"type": "count", "color": "red", "shape": "triangle"}    How many red triangles are in the image?   "2"
    {"type": "count", "color": None, "shape": "star"}         How many stars are in the image?           "0"
    {"type": "exists", "color": "blue", "shape": "circle"}    Is there a blue circle in the image?       "yes"
    {"type": "color_at", "x": 41, "y": 180}                   What colour is the shape at (41, 180)?     "red"
    {"type": "shape_at", "x": 41, "y": 180}                   What shape is at (41, 180)?                "star"
    {"type": "relation", "a": {...}, "b": {...}, "relation": "left of"}
                                                              Is the red circle to the left of the blue square?
    {"type": "largest", "ask": "color"}                       What colour is the largest shape?          "green"

Answers are a number in digits, a colour name (`scenes.COLORS`), a shape name (`scenes.SHAPES`), or "yes"/"no"
(`ANSWER_TYPES`). Questions are only asked when their answer is unambiguous: a position names the centre of an
object (boxes never overlap); a relation names two objects whose colour and shape are each unique in the scene
(and whose colour no other tiny object has) and whose boxes are fully apart along that axis (no "roughly left
of"); "largest" needs one object with at least `LARGEST_MARGIN` times the area of any other.

What the image shows at a glance: every object's colour and position, and the shape of every object but the
tiny ones, which are coloured smudges (`scenes.TINY_SIZES`). `tiny_objects_to_zoom(scene, query)`: the fewest
tiny objects whose shapes, once seen, settle the answer whatever the shapes of the other tiny objects are. A
question needs the zoom tool when that set is not empty: the oracle zooms on exactly those objects, and
`glance_answer` (the answer with every tiny shape guessed) is right for every question that does not.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

from environments.visual_scenes.scenes import COLORS, SHAPES, area, box, is_tiny

QUESTION_TYPES = ("count", "exists", "color_at", "shape_at", "relation", "largest")
ANSWER_TYPES = {"count": "number", "exists": "yes/no", "color_at": "color", "shape_at": "shape",
                "relation": "yes/no", "largest": None}  # "largest" asks for a colour or a shape
RELATIONS = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}
#: The largest object's area is at least this many times any other's when "largest" is asked.
LARGEST_MARGIN = 1.3
#: Share of object-targeted questions aimed at a tiny object (a tiny one's shape needs zooming, its colour not).
TINY_TARGET_SHARE = 0.6


def answer_type(query: Mapping[str, Any]) -> str:
    """'number', 'color', 'shape' or 'yes/no'."""
    if query["type"] == "largest":
        return "color" if query["ask"] == "color" else "shape"
    return ANSWER_TYPES[query["type"]]


def _matches(item: Mapping[str, Any], color: str | None, shape: str | None) -> bool:
    return (color is None or item["color"] == color) and (shape is None or item["shape"] == shape)


def _only(objects: list[dict], description: Mapping[str, Any]) -> dict | None:
    found = [o for o in objects if _matches(o, description["color"], description["shape"])]
    return found[0] if len(found) == 1 else None


def _at(objects: list[dict], x: float, y: float) -> dict | None:
    for item in objects:
        x0, y0, x1, y1 = box(item)
        if x0 <= x < x1 and y0 <= y < y1:
            return item
    return None


def _holds(a: Mapping[str, Any], b: Mapping[str, Any], relation: str) -> bool | None:
    """True / False when `a` is clearly in / against `relation` to `b` (boxes fully apart), None otherwise."""
    ax0, ay0, ax1, ay1 = box(a)
    bx0, by0, bx1, by1 = box(b)
    if relation in ("left of", "right of"):
        if ax1 <= bx0:
            left = True
        elif bx1 <= ax0:
            left = False
        else:
            return None
        return left if relation == "left of" else not left
    if ay1 <= by0:
        higher = True
    elif by1 <= ay0:
        higher = False
    else:
        return None
    return higher if relation == "above" else not higher


def _largest(objects: list[dict]) -> dict | None:
    ranked = sorted(objects, key=area, reverse=True)
    if len(ranked) == 1 or area(ranked[0]) >= LARGEST_MARGIN * area(ranked[1]):
        return ranked[0]
    return None


def answer_query(scene: Mapping[str, Any], query: Mapping[str, Any]) -> str | None:
    """The exact answer of `query` about `scene`, or None when the question would be ambiguous there."""
    objects = list(scene["objects"])
    kind = query["type"]
    if kind == "count":
        return str(sum(_matches(o, query["color"], query["shape"]) for o in objects))
    if kind == "exists":
        return "yes" if any(_matches(o, query["color"], query["shape"]) for o in objects) else "no"
    if kind in ("color_at", "shape_at"):
        item = _at(objects, query["x"], query["y"])
        if item is None:
            return None
        return item["color"] if kind == "color_at" else item["shape"]
    if kind == "relation":
        a, b = _only(objects, query["a"]), _only(objects, query["b"])
        if a is None or b is None or a is b:
            return None
        holds = _holds(a, b, query["relation"])
        return None if holds is None else ("yes" if holds else "no")
    if kind == "largest":
        item = _largest(objects)
        if item is None:
            return None
        return item["color"] if query["ask"] == "color" else item["shape"]
    raise ValueError(f"unknown question type {kind!r}; expected one of {list(QUESTION_TYPES)}")


def _plural(shape: str) -> str:
    return shape + "s"


def question_text(query: Mapping[str, Any]) -> str:
    """The question as the agent reads it."""
    kind = query["type"]
    if kind == "count":
        if query["color"] and query["shape"]:
            return f"How many {query['color']} {_plural(query['shape'])} are in the image?"
        if query["shape"]:
            return f"How many {_plural(query['shape'])} are in the image?"
        return f"How many {query['color']} shapes are in the image?"
    if kind == "exists":
        return f"Is there a {query['color']} {query['shape']} in the image?"
    if kind == "color_at":
        return f"What colour is the shape at ({query['x']}, {query['y']})?"
    if kind == "shape_at":
        return f"What shape is at ({query['x']}, {query['y']})?"
    if kind == "relation":
        a, b = query["a"], query["b"]
        return f"Is the {a['color']} {a['shape']} {RELATIONS[query['relation']]} the {b['color']} {b['shape']}?"
    if kind == "largest":
        return "What colour is the largest shape?" if query["ask"] == "color" else "What shape is the largest one?"
    raise ValueError(f"unknown question type {kind!r}; expected one of {list(QUESTION_TYPES)}")


# ------------------------------------------------------------------------------------------------ drawing
def _pick_target(rng: random.Random, objects: list[dict]) -> dict:
    tiny = [o for o in objects if is_tiny(o)]
    if tiny and rng.random() < TINY_TARGET_SHARE:
        return rng.choice(tiny)
    return rng.choice(objects)


def _draw_query(kind: str, scene: Mapping[str, Any], rng: random.Random) -> dict | None:
    """One query of `kind` for `scene`, or None when the scene offers no unambiguous one."""
    objects = list(scene["objects"])
    if kind in ("count", "exists"):
        if rng.random() < 0.7:  # about a shape that is there (often a tiny one); else any combination
            target = _pick_target(rng, objects)
            color, shape = target["color"], target["shape"]
        else:
            color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
        if kind == "count":
            form = rng.random()
            if form < 0.2:
                color = None
            elif form < 0.4:
                shape = None
        return {"type": kind, "color": color, "shape": shape}
    if kind in ("color_at", "shape_at"):
        target = _pick_target(rng, objects)
        return {"type": kind, "x": target["x"], "y": target["y"]}
    if kind == "relation":
        # Referents are unique by colour and shape, and no other tiny object shares their colour: a tiny smudge
        # of that colour could be the same shape, and the question would need zooming on every such smudge.
        unique = [o for o in objects if _only(objects, o) is o
                  and not any(is_tiny(t) and t is not o and t["color"] == o["color"] for t in objects)]
        relation = rng.choice(sorted(RELATIONS))
        pairs = [(a, b) for a in unique for b in unique if a is not b and _holds(a, b, relation) is not None]
        if not pairs:
            return None
        a, b = rng.choice(pairs)
        return {"type": "relation", "relation": relation, "a": {"color": a["color"], "shape": a["shape"]},
                "b": {"color": b["color"], "shape": b["shape"]}}
    if kind == "largest":
        if _largest(objects) is None:
            return None
        return {"type": "largest", "ask": rng.choice(["color", "shape"])}
    raise ValueError(f"unknown question type {kind!r}; expected one of {list(QUESTION_TYPES)}")


def draw_query(scene: Mapping[str, Any], rng: random.Random, types: tuple[str, ...] = QUESTION_TYPES) -> dict:
    """A query about `scene` of a type drawn uniformly from `types` (another type when the scene has no
    unambiguous question of the one drawn). Deterministic in the rng's state."""
    unknown = [t for t in types if t not in QUESTION_TYPES]
    if not types or unknown:
        raise ValueError(f"question types {list(types)}; expected a non-empty subset of {list(QUESTION_TYPES)}")
    order = list(types)
    rng.shuffle(order)
    for kind in order:
        query = _draw_query(kind, scene, rng)
        if query is not None and answer_query(scene, query) is not None:
            return query
    raise ValueError(f"the scene has no unambiguous question of the types {list(types)}; add 'count' or "
                     "'exists' (always answerable) to the question types")


# ------------------------------------------------------------------------------------------------ zooming
#: The most tiny objects a scene may hold: `tiny_objects_to_zoom` tries every shape of every tiny object.
MAX_TINY = 4


def _settled(scene: Mapping[str, Any], query: Mapping[str, Any], unknown: Sequence[int], answer: str) -> bool:
    """Whether the answer stays `answer` for every assignment of shapes to the objects `unknown`."""
    objects = list(scene["objects"])
    for shapes in itertools.product(SHAPES, repeat=len(unknown)):
        changed = list(objects)
        for index, shape in zip(unknown, shapes):
            changed[index] = {**objects[index], "shape": shape}
        if answer_query({**scene, "objects": changed}, query) != answer:
            return False
    return True


def tiny_objects_to_zoom(scene: Mapping[str, Any], query: Mapping[str, Any]) -> list[int]:
    """Indices of the fewest tiny objects whose shapes settle the answer: with their true shapes known, every
    shape of the other tiny objects gives the same answer (an ambiguous question counts as another answer, e.g.
    a tiny red smudge next to "the red circle"). Empty when the answer is settled at a glance; among sets of
    the same size, the first in index order."""
    tiny = [index for index, item in enumerate(scene["objects"]) if is_tiny(item)]
    if len(tiny) > MAX_TINY:
        raise ValueError(f"the scene holds {len(tiny)} tiny objects; at most {MAX_TINY} are supported")
    answer = answer_query(scene, query)
    for count in range(len(tiny) + 1):
        for seen in itertools.combinations(tiny, count):
            if _settled(scene, query, [index for index in tiny if index not in seen], answer):
                return list(seen)
    raise AssertionError("with every tiny shape known the answer is settled")


def glance_answer(scene: Mapping[str, Any], query: Mapping[str, Any], rng: random.Random) -> str:
    """What an agent answers from the image alone, without zooming: it sees every object's colour, but the
    shape of a tiny object is a guess. The right answer when `tiny_objects_to_zoom` is empty; often wrong
    otherwise."""
    guessed = copy.deepcopy(dict(scene))
    for item in guessed["objects"]:
        if is_tiny(item):
            item["shape"] = rng.choice(SHAPES)
    answer = answer_query(guessed, query)
    if answer is None:  # the guesses made the referent ambiguous: a guess of the right kind
        kind = answer_type(query)
        answer = {"yes/no": rng.choice(["yes", "no"]), "shape": rng.choice(SHAPES),
                  "color": rng.choice(sorted(COLORS)), "number": str(rng.randint(0, 3))}[kind]
    return answer
