"""JaxSampler with images: a tiny random Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration.generate
(fp32, greedy tokens and logprobs), continuous batching of prompts with different images, bounded compiles, clear
errors, and a tool-calling chain with images through the sampler, checked against the Flax forward with pixels.

Prompts are real: the offline Qwen2.5 tokenizer (real vision token ids) and the qwen2.5 template expand the images,
prepared by `rollout.images.prepare_image`, to their pad tokens; the reference model gets the same images' pixel
values (`pixel_inputs`, itself checked against transformers' image processor in tests/rollout/test_images.py).
"""
import asyncio

import jax
import numpy as np
import PIL.Image
import pytest
import torch
import transformers

from agentfly_jax.models import load_pretrained, mrope_positions, pad_patches, vision_layout
from agentfly_jax.rollout.agents import ToolCallingAgent
from agentfly_jax.rollout.backends import JaxSampler
from agentfly_jax.images import ImageSettings, PreparedImage, pixel_inputs, prepare_image
from agentfly_jax.rollout.templates import encode_conversation
from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer
from agentfly_jax.tools import tool
from agentfly_jax.tools.parsers import ParseResult, ToolCall
from tests.models.hf_reference import build

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653
TOL = 1e-4
# Vision depth 2: one window block (56 px windows = 2x2 merged tokens) and one full-attention block; a small text
# rope_theta turns the low frequencies too, so a wrong (m)RoPE position shows in the logits.
HF_CONFIG = {
    "text_config": {"vocab_size": 151936, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}},
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                      "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 56, "patch_size": 14,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
    "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD, "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END, "tie_word_embeddings": False,
}
SETTINGS = ImageSettings(min_pixels=28 * 28, max_pixels=140 * 140)


def random_picture(height, width, seed):
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# Resized to 56x84 (grid 4x6, 6 tokens), 112x140 (8x10, 20 tokens), 28x56 (2x4, 2 tokens), 84x84 (6x6, 9 tokens).
PICTURES = {"wide": random_picture(60, 90, 1), "big": random_picture(115, 140, 2), "tiny": random_picture(30, 55, 3),
            "square": random_picture(80, 80, 4)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, our model, our params) of one tiny random Qwen2.5-VL checkpoint."""
    path = str(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    hf_model = build(transformers.Qwen2_5_VLConfig(**HF_CONFIG), path,
                     cls=transformers.Qwen2_5_VLForConditionalGeneration, attn_implementation="eager")
    model, params = load_pretrained(path)
    return hf_model, model, params


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen2_5_tokenizer()


@pytest.fixture(scope="module")
def sampler(checkpoint):
    """One sampler for the parity tests; a pass takes at most 128 patches, so busy admissions split into passes."""
    _, model, params = checkpoint
    shared = JaxSampler(model, params, max_slots=8, max_len=256, steps_per_call=4, prefill_patches=128,
                        min_patch_bucket=32)
    yield shared
    asyncio.run(shared.close())


def user_prompt(tokenizer, parts):
    """(prompt ids with the generation prompt, prepared images) of one user message of text and picture names."""
    content = [{"type": "image", "image": PICTURES[p]} if p in PICTURES else {"type": "text", "text": p}
               for p in parts]
    encoded = encode_conversation(tokenizer, [{"role": "user", "content": content}], chat_template="qwen2.5",
                                  add_generation_prompt=True, image_settings=SETTINGS)
    return encoded.token_ids, encoded.images


def hf_greedy(hf_model, prompt, images, new_tokens):
    """transformers' greedy tokens and their logprobs (log_softmax of the raw logits) for `prompt` + images."""
    ids = torch.tensor([prompt])
    inputs = {}
    if images:
        pixel_values, grid = pixel_inputs(images)
        inputs = {"pixel_values": torch.from_numpy(pixel_values), "image_grid_thw": torch.from_numpy(grid)}
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                mm_token_type_ids=(ids == IMAGE_PAD).long(), generation_config=config, **inputs)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens)]
    assert len(tokens) == new_tokens
    return tokens, logprobs


_FORWARD = {}


def flax_logprobs(model, params, token_ids, images, temperature):
    """log_softmax(logits / T) of every token after the first, from one forward of the Flax model with the pixel
    inputs: the trainer's view of the sequence. Tokens are padded at the end to a multiple of 128 and patches to
    256 (neither reaches a real token: attention is causal and padded patches attend only among themselves), so
    one compiled forward serves most sequences."""
    length = -(-len(token_ids) // 128) * 128
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(token_ids)] = token_ids
    vision = {}
    grid = None
    if images:
        pixel_values, grid = pixel_inputs(images)
        vision = {"pixel_values": pad_patches(pixel_values, 256),
                  "vision_layout": vision_layout(model.config.vision, grid, 256)}
    positions = mrope_positions(model.config, ids, grid)
    if id(model) not in _FORWARD:  # the module is not hashable: close over it
        _FORWARD[id(model)] = (model, jax.jit(lambda p, i, pos, **kw: model.apply({"params": p}, i, pos, **kw)))
    logits = np.asarray(_FORWARD[id(model)][1](params, ids, positions, **vision))[0, :len(token_ids) - 1]
    scaled = logits.astype(np.float64) / temperature
    shifted = scaled - scaled.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return logprobs[np.arange(len(token_ids) - 1), ids[0, 1:len(token_ids)]]


def generate(sampler, prompt, images, **options):
    async def run():
        return await sampler.generate(prompt, images=images, **options)
    return asyncio.run(run())


def assert_equals_transformers(hf_model, prompt, images, completion, new_tokens):
    tokens, logprobs = hf_greedy(hf_model, prompt, images, new_tokens)
    assert completion.token_ids == tokens and completion.finish_reason == "length"
    np.testing.assert_allclose(completion.logprobs, logprobs, atol=TOL, rtol=0)


# --------------------------------------------------------------------------------------------- parity
def test_one_image_greedy_equals_transformers_generate(checkpoint, tokenizer, sampler):
    hf_model, _, _ = checkpoint
    prompt, images = user_prompt(tokenizer, ["wide", "What is in the picture?"])
    assert sampler.supports_images and [image.grid_thw for image in images] == [(1, 4, 6)]
    assert prompt.count(IMAGE_PAD) == 6
    [completion] = generate(sampler, prompt, images, max_tokens=6, temperature=0.0)
    assert_equals_transformers(hf_model, prompt, images, completion, 6)
    # The image is seen: another picture of the same size in the same prompt changes what is sampled.
    other = [PreparedImage(images[0].pixels[::-1].copy())]
    [flipped] = generate(sampler, prompt, other, max_tokens=6, temperature=0.0)
    assert not np.allclose(flipped.logprobs, completion.logprobs, atol=1e-3)


def test_two_images_of_different_sizes_with_text_between(checkpoint, tokenizer, sampler):
    hf_model, _, _ = checkpoint
    prompt, images = user_prompt(tokenizer, ["Compare", "big", "with the smaller", "tiny", "please."])
    assert [image.grid_thw for image in images] == [(1, 8, 10), (1, 2, 4)]
    [completion] = generate(sampler, prompt, images, max_tokens=6, temperature=0.0)
    assert_equals_transformers(hf_model, prompt, images, completion, 6)


def test_concurrent_prompts_with_different_images_each_equal_transformers(checkpoint, tokenizer, sampler):
    """Prompts of different lengths and images, a text-only one among them, sampled together: each equals
    transformers on its own. 128 patches per pass: the admission is split into several prompt passes."""
    hf_model, _, _ = checkpoint
    cases = [["wide", "one?"], ["square", "A much longer question about the square picture, in many words?"],
             ["Only text here, no picture at all."], ["tiny", "then", "wide", "and", "square", "three?"],
             ["big", "Describe the whole big picture in detail, please."], ["tiny", "Why is that so? Tell me more."]]
    requests = [user_prompt(tokenizer, parts) for parts in cases]
    calls_before = sampler.stats["prefill_calls"]

    async def run():
        return await asyncio.gather(*[sampler.generate(prompt, images=images, max_tokens=5, temperature=0.0)
                                      for prompt, images in requests])

    results = asyncio.run(run())
    passes = sampler.stats["prefill_calls"] - calls_before
    assert 2 < passes < len(cases)  # batched, but no pass holds more than 128 patches
    assert len({len(prompt) for prompt, _ in requests}) == len(cases)
    for (prompt, images), [completion] in zip(requests, results):
        assert_equals_transformers(hf_model, prompt, images, completion, 5)


def test_text_only_prompt_on_the_vision_model_equals_transformers(checkpoint, tokenizer, sampler):
    """A prompt without images takes the text path (the decoder's prompt pass, rotary offset 0)."""
    hf_model, model, params = checkpoint
    prompt, images = user_prompt(tokenizer, ["No picture in this one."])
    assert images == []
    encoded_before = sampler.stats["images"]
    [completion] = generate(sampler, prompt, [], max_tokens=6, temperature=0.0)
    assert sampler.stats["images"] == encoded_before and sampler.compile_counts["prefill"] >= 1
    assert_equals_transformers(hf_model, prompt, [], completion, 6)
    np.testing.assert_allclose(completion.logprobs,
                               flax_logprobs(model, params, prompt + completion.token_ids, [], 1.0)[-6:],
                               atol=TOL, rtol=0)


def test_sampled_logprobs_with_images_equal_the_flax_forward(checkpoint, tokenizer, sampler):
    """n samples at temperature 0.8 share the prompt pass; each token's logprob is log_softmax(logits / 0.8) of the
    model's forward over the whole sequence with the pixel inputs."""
    _, model, params = checkpoint
    prompt, images = user_prompt(tokenizer, ["square", "and", "wide", "?"])
    completions = generate(sampler, prompt, images, max_tokens=8, temperature=0.8, n=3, seed=5)
    assert len({tuple(c.token_ids) for c in completions}) > 1
    for c in completions:
        expected = flax_logprobs(model, params, prompt + c.token_ids, images, 0.8)[-len(c.token_ids):]
        np.testing.assert_allclose(c.logprobs, expected, atol=TOL, rtol=0)


def test_new_weights_reach_the_vision_tower_without_recompiling(checkpoint, tokenizer, sampler):
    """update_weights swaps the vision tower's params too: the same prompt then samples from the new weights,
    equal to the Flax forward with them, through the programs already compiled."""
    _, model, params = checkpoint
    prompt, images = user_prompt(tokenizer, ["wide", "What is in the picture?"])
    [before] = generate(sampler, prompt, images, max_tokens=4, temperature=0.0)
    compiles = dict(sampler.compile_counts)
    changed = {**params, "visual": jax.tree.map(lambda p: p * 1.5, params["visual"])}

    async def run():
        await sampler.update_weights(changed, version=1)
        [after] = await sampler.generate(prompt, images=images, max_tokens=4, temperature=0.0)
        await sampler.update_weights(params, version=2)  # the other tests share this sampler
        return after

    after = asyncio.run(run())
    assert dict(sampler.compile_counts) == compiles and after.weight_version == 1
    expected = flax_logprobs(model, changed, prompt + after.token_ids, images, 1.0)[-4:]
    np.testing.assert_allclose(after.logprobs, expected, atol=TOL, rtol=0)
    assert np.abs(np.asarray(after.logprobs[:1]) - before.logprobs[:1]).max() > 1e-3


# --------------------------------------------------------------------------------------------- compiles
def test_compiles_one_prompt_pass_per_length_and_patch_bucket(checkpoint, tokenizer):
    _, model, params = checkpoint
    sampler = JaxSampler(model, params, max_slots=4, max_len=256, steps_per_call=4, min_patch_bucket=32)
    wide = user_prompt(tokenizer, ["wide", "a?"])  # 24 patches: bucket 32
    wide_longer = user_prompt(tokenizer, ["wide", "a somewhat longer question?"])  # same length bucket
    square = user_prompt(tokenizer, ["square", "b?"])  # 36 patches: bucket 64
    text = user_prompt(tokenizer, ["no picture"])

    async def run(requests):
        for prompt, images in requests:
            await sampler.generate(prompt, images=images, max_tokens=3, temperature=0.0)
        return dict(sampler.compile_counts)

    first = asyncio.run(run([wide, wide_longer]))
    assert first["prefill_images"] == 1 and "prefill" not in first
    assert asyncio.run(run([wide_longer, wide, text]))["prefill_images"] == 1
    counts = asyncio.run(run([square, wide]))
    assert counts["prefill_images"] == 2 and counts["prefill"] == 1
    # the image prompts' one slot insert (one prompt bucket), the text prompt started through prefix caching's
    # in-place prompt pass and its start program, and the decode programs of the windows the lengths need, images or
    # not: the prompts' lengths all fall in one octave of windows, its power of two and its 1.5x midpoint
    assert counts["insert"] == 1 and counts["start"] == 1 and counts["decode"] <= 2
    assert sampler.stats["images"] == 6  # every pass encodes its prompts' images
    asyncio.run(sampler.close())


# --------------------------------------------------------------------------------------------- errors
def test_prompts_whose_images_do_not_match_their_pads_are_refused(checkpoint, tokenizer, sampler):
    prompt, images = user_prompt(tokenizer, ["wide", "and", "tiny", "?"])
    [wide, tiny] = images
    with pytest.raises(ValueError, match=r"holds 8 image pad tokens .* but its 1 image\(s\) take 6 \(\[6\]\)"):
        generate(sampler, prompt, [wide], max_tokens=2)
    with pytest.raises(ValueError, match=r"holds 8 image pad tokens .* but its 0 image\(s\) take 0"):
        generate(sampler, prompt, [], max_tokens=2)
    # the right number of tokens, in the wrong order: the runs do not fit the images' grids
    with pytest.raises(ValueError, match=r"image 1 \(grid \[1, 4, 6\]\) needs 6 image tokens but row 0 has a run "
                                         "of 4"):
        generate(sampler, prompt, [tiny, wide], max_tokens=2)
    with pytest.raises(TypeError, match=r"images\[0\] is a Image; JaxSampler takes PreparedImage"):
        generate(sampler, prompt, [PICTURES["wide"], tiny], max_tokens=2)
    with pytest.raises(ValueError, match="the prompt ends inside an image"):
        generate(sampler, prompt[:prompt.index(IMAGE_PAD) + 6], [wide], max_tokens=2)
    coarse = prepare_image(PICTURES["wide"], ImageSettings(patch_size=7, min_pixels=28 * 28, max_pixels=140 * 140))
    with pytest.raises(ValueError, match=r"= \(7, 2, 2\) but the model's vision tower takes \(14, 2, 2\)"):
        generate(sampler, prompt, [coarse, tiny], max_tokens=2)
    # refused before anything ran: the sampler still serves
    [completion] = generate(sampler, prompt, images, max_tokens=2, temperature=0.0)
    assert len(completion.token_ids) == 2


def test_a_text_only_model_refuses_images(tiny_model):
    model, params = tiny_model
    sampler = JaxSampler(model, params, max_slots=1, max_len=64)
    assert sampler.supports_images is False
    image = prepare_image(PICTURES["tiny"], SETTINGS)
    with pytest.raises(ValueError, match="serves a text-only CausalLM, which cannot see images; got 1"):
        generate(sampler, [1, 2, 3], [image], max_tokens=2)
    assert sampler.compile_counts == {}


# --------------------------------------------------------------------------------------------- a chain
@tool
def show(name: str) -> list:
    """Shows a picture.

    Args:
        name: Which picture.
    """
    return [{"type": "text", "text": f"Here is {name}:"}, {"type": "image", "image": PICTURES["tiny"]}]


class PictureToolAgent(ToolCallingAgent):
    """Asks about a picture; every turn calls `show` (a random model writes no tool call of its own)."""

    def build_messages(self, task):
        return [{"role": "user", "content": [{"type": "image", "image": PICTURES["wide"]},
                                             {"type": "text", "text": task["question"]}]}]

    def parse(self, text):
        return ParseResult(text=text, tool_calls=[ToolCall("show", {"name": "it"}, raw="")])


def test_a_tool_calling_chain_with_images_runs_on_the_sampler(checkpoint, tokenizer):
    """Two turns: the first prompt holds the user's picture, the second also the tool's; the trajectory's sampled
    tokens carry logprobs equal to the Flax forward over the whole trajectory with its images."""
    _, model, params = checkpoint
    # The random model ends a turn at any even token id, so turns are short and chains reach their second turn.
    stops = list(range(0, 151643, 2))
    sampler = JaxSampler(model, params, max_slots=4, max_len=512, steps_per_call=4, max_stop_tokens=len(stops))
    agent = PictureToolAgent(sampler, tokenizer, tools=[show], chat_template="qwen2.5", max_turns=2,
                             max_new_tokens=8, temperature=0.9, stop_token_ids=stops,
                             min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
    trajectories = asyncio.run(agent.run([{"question": "What is it?"}], num_chains=2, seed=3, progress=False))
    asyncio.run(sampler.close())
    assert sampler.stats["images"] == 2 * (1 + 2)  # each chain's second prompt sent its first image again
    for trajectory in trajectories:
        assert trajectory.finish_reason == "max_turns" and trajectory.num_turns == 2, trajectory.metrics
        assert [image.grid_thw for image in trajectory.images] == [(1, 4, 6), (1, 2, 4), (1, 2, 4)]
        ids, mask = trajectory.token_ids, np.asarray(trajectory.action_mask)
        assert ids.count(IMAGE_PAD) == 6 + 2 + 2
        sampled = np.flatnonzero(mask)
        assert len(sampled) >= 2 and sampled[0] > 0
        expected = flax_logprobs(model, params, ids, trajectory.images, 0.9)[sampled - 1]
        np.testing.assert_allclose(np.asarray(trajectory.sampler_logprobs)[sampled], expected, atol=TOL, rtol=0)
