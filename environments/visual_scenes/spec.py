"""The visual_scenes environment's EnvSpec: questions about generated images of shapes, answered with the help
of the `zoom` tool, scored by exact match (`visual_scene_answer`); scripted oracle and random agents and SFT
demonstrations."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from environments.visual_scenes.questions import MAX_TINY, QUESTION_TYPES, glance_answer
from environments.visual_scenes.scenes import COLORS, SHAPES
from environments.visual_scenes.tasks import SEED_SPAN, SPLITS, first_user_message, generate_split
from environments.visual_scenes.tools import MIN_REGION, zoom


def system_prompt(image_size: int) -> str:
    """The system prompt for images of `image_size` x `image_size` pixels."""
    return (
        f"You are shown a {image_size}x{image_size} image of coloured shapes ({', '.join(SHAPES)}; "
        f"{', '.join(COLORS)}) on a white background, and a question about it. Grey specks are not shapes. "
        "Positions are pixel coordinates (x, y): x from the left edge, y down from the top edge. Some shapes are "
        "tiny and cannot be made out at this size: call the zoom tool on a region around them to see it "
        "enlarged before you answer. Reply with the answer alone: a number in digits, a colour, a shape, or "
        "yes/no."
    )


def _call(region: Sequence[int]) -> dict[str, Any]:
    return {"name": "zoom", "arguments": dict(zip(("x0", "y0", "x1", "y1"), (int(v) for v in region)))}


def oracle_policy(task: Mapping[str, Any], rng: random.Random):
    """Zooms on every tiny object the answer depends on (`zoom_regions`), then gives the answer. It reads the
    answer from the row (the scene description), not from the images: an upper bound that checks that the
    tool, the rollout and the reward agree on every row."""
    for region in task["zoom_regions"]:
        yield _call(region)
    return task["answer"]


def _random_answer(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(0, 4))
    if kind == "color":
        return rng.choice(sorted(COLORS))
    if kind == "shape":
        return rng.choice(SHAPES)
    return rng.choice(["yes", "no"])


def random_policy(task: Mapping[str, Any], rng: random.Random):
    """The floor: half the time zooms on a random region, then answers a random answer of the kind the
    question asks for (a number 0-4, a colour, a shape, yes/no) without looking."""
    scene = task["scene"]
    if rng.random() < 0.5:
        width, height = int(scene["width"]), int(scene["height"])
        x0, y0 = rng.randint(0, width - MIN_REGION), rng.randint(0, height - MIN_REGION)
        yield _call([x0, y0, rng.randint(x0 + MIN_REGION, width), rng.randint(y0 + MIN_REGION, height)])
    return _random_answer(task["answer_type"], rng)


def demonstration(task: Mapping[str, Any], *, use_tool: bool, rng: random.Random) -> list[dict[str, Any]]:
    """One SFT conversation (the agent's system prompt is added by the trainer). With the tool: one zoom turn per
    region the answer depends on, each followed by the zoom tool's real output, then the right answer (a
    question about big shapes only is answered at once). Without: the answer read off the image at a glance,
    tiny shapes guessed (`questions.glance_answer`), the weaker behaviour of an agent that does not zoom."""
    messages: list[dict[str, Any]] = [first_user_message(task)]
    if not use_tool:
        return messages + [{"role": "assistant", "content": glance_answer(task["scene"], task["query"], rng)}]
    for region in task["zoom_regions"]:
        call = _call(region)
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": call}]})
        messages.append({"role": "tool", "name": "zoom", "content": zoom(**call["arguments"], task=task)})
    return messages + [{"role": "assistant", "content": task["answer"]}]


def _range(name: str, value: Sequence[int], low: int) -> tuple[int, int]:
    pair = tuple(int(v) for v in value)
    if len(pair) != 2 or not low <= pair[0] <= pair[1]:
        raise ValueError(f"{name}={list(value)}; expected [min, max] with {low} <= min <= max")
    return pair


def env_spec(*, image_size: int = 224, detail: int = 4, num_objects: Sequence[int] = (4, 8),
             num_tiny: Sequence[int] = (1, 3), num_distractors: Sequence[int] = (0, 4),
             question_types: Sequence[str] = QUESTION_TYPES, train_size: int = 20000, dev_size: int = 200,
             test_size: int = 500, max_turns: int = 6):
    """Questions about generated images of coloured shapes, answered with the `zoom` tool.

    image_size: side of the square image the agent is shown (pixels); detail: canvas pixels per image pixel
    the zoom tool crops from; num_objects / num_tiny / num_distractors: [min, max] shapes per scene, how many
    of them tiny (5-7 pixels, need zooming; at most 4) and grey specks; question_types: a subset of
    `questions.QUESTION_TYPES`; train_size / dev_size / test_size: rows of each split (`num <= 0` asks for all;
    the splits draw from disjoint scene seeds); max_turns: assistant turns per chain (zooms + the answer).
    """
    from agentfly_jax.envs.spec import EnvSpec
    from environments.visual_scenes.reward import visual_scene_answer

    if not 64 <= image_size <= 2048:
        raise ValueError(f"image_size={image_size}; expected 64 to 2048 pixels (shapes are up to 44 pixels wide)")
    if not 1 <= detail <= 8:
        raise ValueError(f"detail={detail}; expected 1 to 8 canvas pixels per image pixel")
    options = {
        "image_size": int(image_size),
        "detail": int(detail),
        "num_objects": _range("num_objects", num_objects, 1),
        "num_tiny": _range("num_tiny", num_tiny, 0),
        "num_distractors": _range("num_distractors", num_distractors, 0),
        "question_types": tuple(question_types),
    }
    unknown = [t for t in options["question_types"] if t not in QUESTION_TYPES]
    if not options["question_types"] or unknown:
        raise ValueError(f"question_types={list(question_types)}; expected a non-empty subset of "
                         f"{list(QUESTION_TYPES)}")
    sizes = {"train": train_size, "dev": dev_size, "test": test_size}
    for split, size in sizes.items():
        if not 1 <= size < SEED_SPAN:
            raise ValueError(f"{split}_size={size}; expected 1 to {SEED_SPAN - 1} rows")
    most_tiny = options["num_tiny"][1]
    if most_tiny > MAX_TINY:
        raise ValueError(f"num_tiny={list(num_tiny)}; at most {MAX_TINY} tiny shapes per scene are supported "
                         "(every combination of their shapes is checked to find what needs zooming)")
    if max_turns < most_tiny + 1:
        raise ValueError(f"max_turns={max_turns}; a scene may hold {most_tiny} tiny shapes to zoom on, so give at "
                         f"least {most_tiny + 1} turns (a zoom per tiny shape, then the answer)")

    def tasks(split: str, num: int, seed: int) -> list[dict]:
        if split not in SPLITS:
            raise ValueError(f"unknown visual_scenes split {split!r}; expected one of {list(SPLITS)}")
        if num > sizes[split]:
            raise ValueError(f"asked for {num} {split} rows but the split has {split}_size={sizes[split]}; "
                             f"raise the option {split}_size or ask for fewer")
        return generate_split(split, num if num > 0 else sizes[split], seed, **options)

    def demonstrations(rows, rng: random.Random, expert_fraction: float) -> list[list[dict]]:
        return [demonstration(t, use_tool=rng.random() < expert_fraction, rng=rng) for t in rows]

    return EnvSpec(
        name="visual_scenes",
        tasks=tasks,
        tools=[zoom],
        reward=visual_scene_answer,
        system_prompt=system_prompt(options["image_size"]),
        agent="tool_calling",
        max_turns=max_turns,
        success_threshold=1.0,
        splits=SPLITS,
        demonstrations=demonstrations,
        oracle_policy=oracle_policy,
        random_policy=random_policy,
    )
