"""The visual_scenes environment: rows deterministic and split by seed, every answer re-derived from the rendered
pixels (connected components of each palette colour, shapes told by how much of their bounding box they fill),
the zoom tool against PIL crops and through the tool pipeline, the reward's normalisation, the oracle / random
agents through the real rollout, and the SFT demonstrations rendered by the qwen2.5 template."""

import asyncio
import gc
import json
import pickle
import random

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from agentfly_jax.envs.spec import load_env_spec
from agentfly_jax.rollout.templates import render_conversation
from agentfly_jax.tools.context import ToolContext
from agentfly_jax.tools.execute import execute_tool_call
from environments.evaluation import evaluate, scripted_agent, scripted_tokenizer
from environments.visual_scenes import (
    COLORS,
    QUESTION_TYPES,
    SHAPES,
    ZOOM_SIZE,
    SceneImages,
    env_spec,
    first_user_message,
    glance_answer,
    normalize_answer,
    render_canvas,
    render_image,
    visual_scene_answer,
    zoom,
    zoom_image,
)
from environments.visual_scenes.scenes import BACKGROUND, DISTRACTOR_COLOR, is_tiny


@pytest.fixture(scope="module")
def spec():
    return env_spec()


@pytest.fixture(scope="module")
def rows(spec):
    return spec.split_tasks("test", 120, 0)


# ------------------------------------------------------------------------------ an independent pixel reader
def _shape_from_fill(fill: float) -> str:
    """A blob's shape from the share of its bounding box it covers: square 1, circle pi/4, triangle 1/2, the
    environment's fat star about 0.39 (thresholds halfway between)."""
    if fill > 0.9:
        return "square"
    if fill > 0.64:
        return "circle"
    if fill > 0.44:
        return "triangle"
    return "star"


def _codes(array: np.ndarray) -> np.ndarray:
    """Each pixel's RGB as one integer 0xRRGGBB."""
    return (array[..., 0].astype(np.int32) << 16) | (array[..., 1].astype(np.int32) << 8) | array[..., 2]


def read_blobs(array: np.ndarray, labels_of: dict[str, tuple[int, int, int]]) -> list[dict]:
    """Every connected blob of one palette colour in an RGB array: colour, shape, pixel count, bounding box
    (x0, y0, x1, y1 inclusive) and the label image it came from."""
    code = _codes(array)
    blobs = []
    for name, (red, green, blue) in labels_of.items():
        mask = code == ((red << 16) | (green << 8) | blue)
        if not mask.any():
            continue
        labels, _ = ndimage.label(mask)
        pixels = np.bincount(labels.ravel())
        for index, (rows, columns) in enumerate(ndimage.find_objects(labels), start=1):
            bbox = (columns.start, rows.start, columns.stop - 1, rows.stop - 1)
            fill = pixels[index] / ((columns.stop - columns.start) * (rows.stop - rows.start))
            blobs.append({"color": name, "shape": _shape_from_fill(fill), "pixels": int(pixels[index]),
                          "bbox": bbox, "labels": labels, "label": index})
    return blobs


def pixel_answer(row: dict) -> str:
    """The answer of the row's question read off its rendered canvas, without the scene description."""
    detail = row["scene"]["detail"]
    array = np.asarray(render_canvas(row["scene"]))
    blobs = read_blobs(array, COLORS)
    query = row["query"]

    def matching(color, shape):
        return [b for b in blobs if (color is None or b["color"] == color) and (shape is None or b["shape"] == shape)]

    kind = query["type"]
    if kind == "count":
        return str(len(matching(query["color"], query["shape"])))
    if kind == "exists":
        return "yes" if matching(query["color"], query["shape"]) else "no"
    if kind in ("color_at", "shape_at"):
        x, y = query["x"] * detail, query["y"] * detail
        (hit,) = [b for b in blobs if b["labels"][y, x] == b["label"]]
        return hit["color"] if kind == "color_at" else hit["shape"]
    if kind == "relation":
        (a,) = matching(query["a"]["color"], query["a"]["shape"])
        (b,) = matching(query["b"]["color"], query["b"]["shape"])
        relation = query["relation"]
        if relation in ("left of", "right of"):
            first, second = (a, b) if relation == "left of" else (b, a)
            apart = first["bbox"][2] < second["bbox"][0]
            opposite = second["bbox"][2] < first["bbox"][0]
        else:
            first, second = (a, b) if relation == "above" else (b, a)
            apart = first["bbox"][3] < second["bbox"][1]
            opposite = second["bbox"][3] < first["bbox"][1]
        assert apart != opposite, row["question"]  # the question is only asked when the boxes are apart
        return "yes" if apart else "no"
    if kind == "largest":
        ranked = sorted(blobs, key=lambda b: b["pixels"], reverse=True)
        assert ranked[0]["pixels"] >= 1.2 * ranked[1]["pixels"], row["question"]  # a clear winner
        return ranked[0]["color"] if query["ask"] == "color" else ranked[0]["shape"]
    raise AssertionError(kind)


# ------------------------------------------------------------------------------------------------ the rows
def test_rows_are_deterministic_prefix_stable_and_differ_by_seed(spec, rows):
    again = spec.split_tasks("test", 120, 0)
    assert again == rows
    assert spec.split_tasks("test", 30, 0) == rows[:30]
    assert [r["question"] for r in spec.split_tasks("test", 30, 1)] != [r["question"] for r in rows[:30]]
    first, second = rows[0]["images"][0], again[0]["images"][0]
    assert first.size == (224, 224) and first.mode == "RGB"
    assert np.array_equal(np.asarray(first), np.asarray(second))  # the same pixels each time they are read
    assert all(r["question"].strip() and r["answer"] for r in rows)


def test_splits_share_no_seed_and_no_task(spec):
    by_split = {split: spec.split_tasks(split, 150, 0) for split in ("train", "dev", "test")}
    seeds = {split: {r["scene_seed"] for r in got} for split, got in by_split.items()}
    contents = {split: {(r["question"], json.dumps(r["scene"], sort_keys=True)) for r in got}
                for split, got in by_split.items()}
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not seeds[a] & seeds[b], (a, b)
        assert not contents[a] & contents[b], (a, b)
    assert len(seeds["train"]) == len(contents["train"]) == 150
    # another run seed is another block of scene seeds
    assert not seeds["train"] & {r["scene_seed"] for r in spec.split_tasks("train", 150, 1)}


def test_every_answer_is_read_back_from_the_pixels(spec):
    rows = spec.split_tasks("dev", 120, 0)
    assert {r["question_type"] for r in rows} == set(QUESTION_TYPES)
    for row in rows:
        assert pixel_answer(row) == row["answer"], (row["question"], row["scene"])
    answers = {r["answer"] for r in rows}
    assert {"yes", "no", "0"} <= answers and answers & set(COLORS) and answers & set(SHAPES)


def test_the_canvas_holds_exactly_the_described_objects_and_grey_specks(rows):
    for row in rows[:40]:
        scene = row["scene"]
        array = np.asarray(render_canvas(scene))
        blobs = read_blobs(array, COLORS)
        described = sorted((o["color"], o["shape"]) for o in scene["objects"])
        assert sorted((b["color"], b["shape"]) for b in blobs) == described
        for item in scene["objects"]:  # each blob sits in its object's box
            d = scene["detail"]
            (blob,) = [b for b in blobs if b["labels"][item["y"] * d, item["x"] * d] == b["label"]]
            half = item["size"] * d / 2
            x0, y0, x1, y1 = blob["bbox"]
            assert item["x"] * d - half <= x0 and x1 < item["x"] * d + half
            assert item["y"] * d - half <= y0 and y1 < item["y"] * d + half
        grey = read_blobs(array, {"grey": DISTRACTOR_COLOR})
        assert len(grey) == len(scene["distractors"])
        allowed = [*COLORS.values(), BACKGROUND, DISTRACTOR_COLOR]
        allowed_codes = {(red << 16) | (green << 8) | blue for red, green, blue in allowed}
        assert set(np.unique(_codes(array)).tolist()) <= allowed_codes  # no anti-aliasing on the canvas


def test_image_rows_and_first_message(rows):
    row = rows[0]
    images = row["images"]
    assert isinstance(images, SceneImages) and len(images) == 1 and len(list(images)) == 1
    with pytest.raises(IndexError):
        images[1]
    assert pickle.loads(pickle.dumps(images)) == images
    held = images[0]
    assert images[0] is held  # one object while it is held: an encoder cache prepares it once for all chains
    pixels = np.asarray(held).copy()
    del held
    gc.collect()
    assert np.array_equal(np.asarray(images[0]), pixels)  # rendered again, the same pixels
    view = render_image(row["scene"])
    canvas = render_canvas(row["scene"])
    assert canvas.size == (224 * 4, 224 * 4)
    # the image is the canvas averaged over each 4x4 block
    blocks = np.asarray(canvas, dtype=np.float64).reshape(224, 4, 224, 4, 3).mean(axis=(1, 3))
    assert np.abs(np.asarray(view, dtype=np.float64) - blocks).max() <= 1.0
    message = first_user_message(row)
    assert message["role"] == "user"
    assert [p["type"] for p in message["content"]] == ["image", "text"]
    assert message["content"][1]["text"] == row["question"]
    assert np.array_equal(np.asarray(message["content"][0]["image"]), np.asarray(view))
    json.dumps(row, default=str)  # rows can be logged as the evaluation script logs them


def test_needs_zoom_marks_the_questions_a_glance_cannot_answer(spec):
    rows = spec.split_tasks("train", 400, 0)
    rng = random.Random(0)
    without = [r for r in rows if not r["needs_zoom"]]
    with_zoom = [r for r in rows if r["needs_zoom"]]
    assert 0.2 < len(with_zoom) / len(rows) < 0.8
    assert all(glance_answer(r["scene"], r["query"], rng) == r["answer"] for r in without)
    glance = sum(glance_answer(r["scene"], r["query"], rng) == r["answer"] for r in with_zoom) / len(with_zoom)
    assert glance < 0.6
    for row in with_zoom:  # one region per relevant tiny object, holding its box
        tiny = [o for o in row["scene"]["objects"] if is_tiny(o)]
        assert 1 <= len(row["zoom_regions"]) <= len(tiny)
        for x0, y0, x1, y1 in row["zoom_regions"]:
            assert any(x0 <= o["x"] - o["size"] / 2 and o["x"] + o["size"] / 2 <= x1 and
                       y0 <= o["y"] - o["size"] / 2 and o["y"] + o["size"] / 2 <= y1 for o in tiny)


# ------------------------------------------------------------------------------------------------ zoom
def test_zoom_is_the_canvas_crop_enlarged(rows):
    scene = rows[3]["scene"]
    canvas = render_canvas(scene)
    for region, size in (((10, 20, 50, 60), (224, 224)), ((0, 0, 224, 224), (224, 224)),
                         ((100, 30, 140, 50), (224, 112)), ((7, 9, 11, 29), (45, 224))):
        x0, y0, x1, y1 = region
        expected = canvas.crop((x0 * 4, y0 * 4, x1 * 4, y1 * 4)).resize(size, Image.Resampling.LANCZOS)
        got = zoom_image(scene, *region)
        assert got.size == size
        assert np.array_equal(np.asarray(got), np.asarray(expected)), region
    parts = zoom(10, 20, 50, 60, task=rows[3])
    assert [p["type"] for p in parts] == ["text", "image"]
    assert "x 10-50, y 20-60" in parts[0]["text"] and "5.6x" in parts[0]["text"]
    assert parts[1]["image"].size == (ZOOM_SIZE, ZOOM_SIZE)


def _nearest_palette(array: np.ndarray) -> np.ndarray:
    palette = np.array(list(COLORS.values()) + [BACKGROUND, DISTRACTOR_COLOR], dtype=np.float64)
    return (((array[..., None, :].astype(np.float64) - palette) ** 2).sum(-1)).argmin(-1)


def _shape_seen(image: Image.Image, color: str, x: int, y: int) -> str | None:
    labels, _ = ndimage.label(_nearest_palette(np.asarray(image)) == list(COLORS).index(color))
    if labels[y, x] == 0:
        return None
    ys, xs = np.nonzero(labels == labels[y, x])
    return _shape_from_fill(len(xs) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)))


def test_zoom_shows_tiny_shapes_the_image_loses(spec):
    rows = [r for r in spec.split_tasks("train", 200, 3) if r["zoom_regions"]]
    zoomed = glanced = total = 0
    for row in rows:
        scene = row["scene"]
        view = render_image(scene)
        for x0, y0, x1, y1 in row["zoom_regions"]:
            for item in scene["objects"]:
                if not (is_tiny(item) and x0 <= item["x"] < x1 and y0 <= item["y"] < y1):
                    continue
                image = zoom_image(scene, x0, y0, x1, y1)
                factor = image.width / (x1 - x0)
                at = int((item["x"] - x0) * factor), int((item["y"] - y0) * factor)
                total += 1
                zoomed += _shape_seen(image, item["color"], *at) == item["shape"]
                glanced += _shape_seen(view, item["color"], item["x"], item["y"]) == item["shape"]
    assert total > 100
    assert zoomed == total  # every tiny shape is plain once zoomed
    assert glanced / total < 0.75  # the image alone loses many of them


def _run(call, row):
    return asyncio.run(execute_tool_call(call, [zoom], context=ToolContext(task=row)))


@pytest.mark.parametrize("arguments, message", [
    ({"x0": 30, "y0": 10, "x1": 20, "y1": 40}, "x1=20 must be greater than x0=30: give the left edge first"),
    ({"x0": 10, "y0": 40, "x1": 30, "y1": 40}, "y1=40 must be greater than y0=40: give the top edge first"),
    ({"x0": -5, "y0": 10, "x1": 20, "y1": 40}, "x0=-5 is outside the image: x runs from 0 to 224"),
    ({"x0": 0, "y0": 10, "x1": 20, "y1": 300}, "y1=300 is outside the image: y runs from 0 to 224"),
    ({"x0": 0, "y0": 10, "x1": 3, "y1": 40}, "the region is 3 pixels wide; zoom needs at least 4 pixels"),
    ({"x0": 0, "y0": 10, "x1": 20, "y1": 12}, "the region is 2 pixels high"),
])
def test_bad_regions_come_back_as_clear_errors(rows, arguments, message):
    result = _run({"name": "zoom", "arguments": arguments}, rows[0])
    assert not result.ok and result.error_kind == "tool_exception"
    assert message in result.observation


def test_zoom_arguments_are_checked(rows):
    result = _run({"name": "zoom", "arguments": {"x0": 0, "y0": 0, "x1": "ten", "y1": 40}}, rows[0])
    assert not result.ok and result.error_kind == "bad_arguments" and "x1" in result.observation
    result = _run({"name": "zoom", "arguments": {"x0": 0, "y0": 0, "x1": 40}}, rows[0])
    assert not result.ok and result.error_kind == "bad_arguments" and "y1" in result.observation
    with pytest.raises(TypeError, match=r"x0=1.5: coordinates are whole pixels"):
        zoom_image(rows[0]["scene"], 1.5, 0, 20, 20)
    with pytest.raises(TypeError, match=r"y0=True"):
        zoom_image(rows[0]["scene"], 0, True, 20, 20)
    good = _run({"name": "zoom", "arguments": {"x0": 0, "y0": 0, "x1": 40.0, "y1": 40}}, rows[0])
    assert good.ok and len(good.images) == 1 and good.images[0].size == (224, 224)
    assert good.observation.startswith("Zoomed in on x 0-40, y 0-40")


# ------------------------------------------------------------------------------------------------ reward
@pytest.mark.parametrize("prediction, gold, expected", [
    ("3", "3", 1.0), ("three", "3", 1.0), ("Three.", "3", 1.0), ("03", "3", 1.0), ("\\boxed{4}", "4", 1.0),
    ("<answer>Red</answer>", "red", 1.0), ("Final Answer: yes", "yes", 1.0), ("True", "yes", 1.0),
    ("violet", "purple", 1.0), ("Circles", "circle", 1.0), ("a star", "star", 1.0), ("none", "0", 1.0),
    ("There are 3.", "3", 0.0), ("4", "3", 0.0), ("no", "yes", 0.0), ("red", "orange", 0.0),
    ("square", "circle", 0.0), ("", "yes", 0.0), ("²", "2", 0.0),
])
def test_reward_normalises_then_matches_exactly(prediction, gold, expected):
    assert visual_scene_answer(prediction=prediction, answer=gold)["reward"] == expected
    assert normalize_answer(gold) == gold  # the generator's answers are already canonical


# ------------------------------------------------------------------------------------------------ agents
def test_oracle_solves_every_task_and_random_is_the_floor(spec, rows):
    tasks = rows[:64]
    tokenizer = scripted_tokenizer()
    oracle = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), tasks))
    assert oracle["success"] == 1.0 and oracle["tool_errors_total"] == 0
    assert oracle["tool_calls_mean"] == pytest.approx(np.mean([len(t["zoom_regions"]) for t in tasks]))
    assert oracle["tool_calls_mean"] > 0.3
    rand = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer), tasks))
    assert rand["success"] < 0.5 and rand["tool_errors_total"] == 0 and rand["tool_calls_mean"] > 0


def test_demonstrations_zoom_then_answer_or_answer_at_a_glance(spec, rows):
    tokenizer = scripted_tokenizer()
    chosen = [r for r in rows if r["needs_zoom"]][:6] + [r for r in rows if not r["needs_zoom"]][:2]
    expert = spec.demonstrations(chosen, random.Random(0), 1.0)
    for row, conversation in zip(chosen, expert):
        calls = [m for m in conversation if m.get("tool_calls")]
        tool_messages = [m for m in conversation if m["role"] == "tool"]
        assert len(calls) == len(tool_messages) == len(row["zoom_regions"])
        for call, region in zip(calls, row["zoom_regions"]):
            assert call["tool_calls"][0]["function"] == {"name": "zoom", "arguments": dict(
                zip(("x0", "y0", "x1", "y1"), region))}
        for message in tool_messages:
            assert [p["type"] for p in message["content"]] == ["text", "image"]
        assert conversation[-1] == {"role": "assistant", "content": row["answer"]}
        text = "".join(chunk.text for chunk in render_conversation(
            tokenizer, conversation, tools=[zoom.schema], chat_template="qwen2.5"))
        assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1 + len(tool_messages)
        assert row["question"] in text
    baseline = spec.demonstrations(chosen, random.Random(0), 0.0)
    assert all(len(c) == 2 and c[1]["role"] == "assistant" for c in baseline)
    right = [c[1]["content"] == r["answer"] for r, c in zip(chosen, baseline)]
    assert all(right[6:]) and not all(right[:6])  # a glance is right without tiny shapes, not always with them


def test_loads_by_name_and_checks_options():
    spec = load_env_spec("visual_scenes", {"image_size": 160, "num_tiny": [2, 2], "test_size": 10})
    assert spec.name == "visual_scenes" and spec.agent == "tool_calling" and spec.splits == ("train", "dev", "test")
    assert [t.name for t in spec.tools] == ["zoom"] and spec.reward.name == "visual_scene_answer"
    assert spec.success_threshold == 1.0 and spec.pools == {} and "160x160" in spec.system_prompt
    rows = spec.split_tasks("test", 0, 0)
    assert len(rows) == 10 and rows[0]["images"][0].size == (160, 160)
    assert all(sum(is_tiny(o) for o in r["scene"]["objects"]) == 2 for r in rows)
    with pytest.raises(ValueError, match="test_size=10"):
        spec.split_tasks("test", 11, 0)
    with pytest.raises(ValueError, match="no split 'val'"):
        spec.split_tasks("val", 1, 0)
    with pytest.raises(ValueError, match="question_types"):
        env_spec(question_types=["colour"])
    with pytest.raises(ValueError, match=r"num_tiny=\[3, 1\]"):
        env_spec(num_tiny=[3, 1])
    with pytest.raises(ValueError, match="max_turns=3"):
        env_spec(max_turns=3)
    with pytest.raises(ValueError, match="has no option 'image_sizes'"):
        load_env_spec("visual_scenes", {"image_sizes": 100})
    only_counts = env_spec(question_types=["count"]).split_tasks("train", 20, 0)
    assert {r["question_type"] for r in only_counts} == {"count"}
