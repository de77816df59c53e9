"""The agent's first message for rows with images: the images (the row's `images`, any sequence, or one image)
then the question, for every built-in agent; SFT demonstrations of the visual_scenes environment start with the
very prompt (tokens and images) the agent sees in RL."""
import random

import numpy as np
import pytest
from PIL import Image

from agentfly_jax.rollout import encode_conversation
from agentfly_jax.rollout.agents import ReactAgent, ToolCallingAgent
from agentfly_jax.rollout.agents.base import task_images
from agentfly_jax.images import ImageSettings
from agentfly_jax.rollout.templates import ConversationEncoder
from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer
from agentfly_jax.trainer.loop import _as_agent_prompts
from environments.visual_scenes import demonstration, env_spec, first_user_message, zoom
from tests.rollout.fakes import FakeScriptedBackend

SETTINGS = ImageSettings(min_pixels=56 * 56, max_pixels=56 * 56)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def rows():
    return env_spec(image_size=64).split_tasks("train", 4, 0)


def _agent(cls, tokenizer, **options):
    return cls(FakeScriptedBackend(tokenizer, lambda p: ""), tokenizer, tools=[zoom], chat_template="qwen2.5",
               min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels, **options)


@pytest.mark.parametrize("cls", [ToolCallingAgent, ReactAgent])
def test_first_user_message_shows_the_rows_images_then_the_question(cls, tokenizer, rows):
    agent = _agent(cls, tokenizer, system_prompt="Look closely.")
    for row in rows:
        messages = agent.build_messages(row)
        assert messages[0]["role"] == "system" and messages[1:] == [first_user_message(row)]
        parts = messages[1]["content"]
        assert [p["type"] for p in parts] == ["image", "text"] and parts[-1]["text"] == row["question"]
        assert parts[0]["image"].tobytes() == row["images"][0].tobytes()  # the scene, read through the sequence
    plain = agent.build_messages({"question": "What is 2 + 2?"})
    assert plain[1] == {"role": "user", "content": "What is 2 + 2?"}  # a text row is unchanged
    assert agent.build_messages({"question": "q", "images": []})[1] == {"role": "user", "content": "q"}


def test_images_field_forms():
    picture = Image.new("RGB", (30, 20), "red")
    array = np.zeros((20, 30, 3), np.uint8)
    part = {"type": "image", "image": "scene.png"}

    def kinds(images):
        return [p.get("image", p.get("image_url")) for p in task_images({"question": "q", "images": images})]

    assert kinds([picture, array, "a.png"])[0] is picture and len(kinds((picture, array, "a.png"))) == 3
    assert kinds(picture) == [picture] and kinds("a.png") == ["a.png"] and kinds(b"raw") == [b"raw"]
    assert kinds(array)[0] is array  # one array is one image, not a sequence of rows
    assert kinds(iter(["a.png", "b.png"])) == ["a.png", "b.png"]  # any iterable, iterated once
    assert task_images({"question": "q", "images": [part]}) == [part]  # a ready content part is kept as it is
    assert task_images({"question": "q", "images": part}) == [part]
    assert task_images({"question": "q"}) == [] and task_images({"question": "q", "images": None}) == []
    with pytest.raises(ValueError, match="images\\[1\\] is None"):
        task_images({"question": "q", "images": ["a.png", None]})


def test_rollout_prompt_encodes_the_scene_as_the_processor_would(tokenizer, rows):
    agent = _agent(ToolCallingAgent, tokenizer)
    row = rows[0]
    encoder = ConversationEncoder(tokenizer, chat_template="qwen2.5", image_settings=agent.image_settings)
    prompt = encoder.start(agent.build_messages(row), tools=agent.template_tools())
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(encoder.images) == 1 and encoder.images[0].grid_thw == (1, 4, 4)  # 64 px -> 56 x 56: 4 tokens
    assert prompt.count(pad) == 4
    text = tokenizer.decode(prompt)
    assert text.index("<|vision_start|>") < text.index(row["question"])  # the image before the question


@pytest.mark.parametrize("cls", [ToolCallingAgent, ReactAgent])
def test_demonstrations_start_with_the_agents_rollout_prompt(cls, tokenizer, rows):
    agent = _agent(cls, tokenizer)
    for row in rows:
        encoder = ConversationEncoder(tokenizer, chat_template="qwen2.5", image_settings=agent.image_settings)
        prompt = encoder.start(agent.build_messages(row), tools=agent.template_tools())
        demo = demonstration(row, use_tool=True, rng=random.Random(0))
        encoded = encode_conversation(tokenizer, _as_agent_prompts(agent, demo), tools=agent.template_tools(),
                                      chat_template="qwen2.5", image_settings=agent.image_settings)
        assert encoded.token_ids[:len(prompt)] == prompt and sum(encoded.action_mask[:len(prompt)]) == 0
        assert encoded.images[0] == encoder.images[0]  # the same scene, prepared the same way
        assert len(encoded.images) == 1 + len(row["zoom_regions"])  # and one image per zoom


def test_cut_long_demonstration_keeps_whole_images_only(tokenizer, rows):
    """config.sft.cut_long: a cut through an image's tokens moves back before them, and that image is dropped."""
    from types import SimpleNamespace

    from agentfly_jax.trainer.loop import _cut_encoded

    row = next(r for r in rows if r["zoom_regions"])
    agent = _agent(ToolCallingAgent, tokenizer)
    encoded = encode_conversation(tokenizer, _as_agent_prompts(agent, demonstration(row, use_tool=True,
                                                                                      rng=random.Random(0))),
                                  tools=agent.template_tools(), chat_template="qwen2.5",
                                  image_settings=agent.image_settings)
    run = SimpleNamespace(tokenizer=tokenizer)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pads = [i for i, t in enumerate(encoded.token_ids) if t == pad]
    first_zoom = pads[encoded.images[0].num_tokens]  # where the zoom image's tokens start
    inside = _cut_encoded(run, encoded, first_zoom + 2)
    assert len(inside.token_ids) == len(inside.action_mask) == first_zoom and inside.images == encoded.images[:1]
    after = _cut_encoded(run, encoded, first_zoom + encoded.images[1].num_tokens + 1)
    assert len(after.token_ids) == first_zoom + encoded.images[1].num_tokens + 1 and after.images == encoded.images[:2]
    assert after.token_ids == encoded.token_ids[:len(after.token_ids)]
