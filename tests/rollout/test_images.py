"""Images for vision-language policies, against transformers' Qwen2-VL processing as the reference.

The references are independent of our code: `Qwen2VLImageProcessorPil` (transformers' numpy/PIL image processor;
torchvision is not installed) for resizing, pixel values and patch grids, and a `Qwen2_5_VLProcessor` built
offline from the real Qwen2.5 tokenizer, that image processor and the Qwen2.5 chat template with vision
placeholders, for the token ids of whole conversations (it expands each image's `<|image_pad|>` itself).
Everything here uses small images so that the file runs in seconds.
"""

import asyncio
import base64
import copy
import io
import struct
import zlib

import numpy as np
import PIL.Image
import pytest
from transformers import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.processing_utils import ProcessorMixin

from agentfly_jax.rollout.agents import ReactAgent, ToolCallingAgent
from agentfly_jax.rollout.chat_templates import QWEN2_5_JINJA
from agentfly_jax.images import (
    ImageError,
    ImageSettings,
    PreparedImage,
    image_token_count,
    load_image,
    pixel_inputs,
    prepare_image,
    preprocess,
    smart_resize,
)
from agentfly_jax.rollout.templates import ConversationEncoder, encode_conversation
from agentfly_jax.rollout.trajectory import Trajectory, images_to_batch, trajectories_to_batch
from agentfly_jax.tools import execute_tool_call, tool
from tests.rollout.fakes import FakeScriptedBackend, tool_call_text

IMAGE_PAD_ID, VISION_START_ID, VISION_END_ID = 151655, 151652, 151653
SMALL_MAX_PIXELS = 28 * 28 * 64  # at most 64 tokens per image: cheap, and larger images get downscaled
TEXT_KEYS = {"tokens", "positions", "segment_ids", "action_mask", "sampler_logprobs", "rewards", "group_ids",
             "lengths", "policy_versions", "policy_versions_max"}


def random_image(height, width, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def encoded_bytes(image, image_format="PNG", **options):
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def hf_pixels(images, **kwargs):
    """transformers' (pixel_values, image_grid_thw) for `images`."""
    processor = Qwen2VLImageProcessorPil(**{key: kwargs.pop(key) for key in ("min_pixels", "max_pixels") if key in kwargs})
    out = processor(images, return_tensors="np", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]


def assert_same_pixels(ours, reference):
    (pixel_values, grid), (reference_values, reference_grid) = ours, reference
    assert grid.tolist() == reference_grid.tolist()
    assert pixel_values.shape == reference_values.shape and pixel_values.dtype == np.float32
    assert np.abs(pixel_values - reference_values).max() <= 1e-6


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without its video processor (which needs torchvision): images and text only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


@pytest.fixture(scope="module")
def hf_processor(qwen_tokenizer):
    return ImageOnlyQwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS),
        tokenizer=qwen_tokenizer,
        chat_template=QWEN2_5_JINJA,
    )


def hf_conversation(processor, messages, tools=None, add_generation_prompt=False):
    out = processor.apply_chat_template(
        copy.deepcopy(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
        return_dict=True, return_tensors="np",
    )
    return out["input_ids"][0].tolist(), out.get("pixel_values"), out.get("image_grid_thw")


# --------------------------------------------------------------------------------------------------
# Resizing and pixel values
# --------------------------------------------------------------------------------------------------


def test_smart_resize_equals_transformers_on_a_grid_of_sizes():
    settings = [(56 * 56, 28 * 28 * 1280), (56 * 56, SMALL_MAX_PIXELS), (28 * 28 * 16, 28 * 28 * 32)]
    sizes = [1, 2, 5, 13, 14, 27, 28, 41, 42, 43, 69, 70, 71, 99, 100, 223, 224, 500, 999, 1000, 1500]
    for min_pixels, max_pixels in settings:
        for height in sizes:
            for width in sizes:
                if max(height, width) / min(height, width) > 200:
                    continue
                assert smart_resize(height, width, 28, min_pixels, max_pixels) == hf_smart_resize(
                    height, width, 28, min_pixels, max_pixels
                ), (height, width, min_pixels, max_pixels)


@pytest.mark.parametrize(
    "height, width, max_pixels",
    [
        (1, 1, SMALL_MAX_PIXELS),  # smaller than min_pixels: scaled up
        (5, 7, SMALL_MAX_PIXELS),
        (20, 30, SMALL_MAX_PIXELS),
        (50, 70, SMALL_MAX_PIXELS),  # 70 / 28 = 2.5 rounds to even
        (42, 98, SMALL_MAX_PIXELS),  # 42 / 28 = 1.5 rounds to even
        (224, 224, SMALL_MAX_PIXELS),
        (300, 500, SMALL_MAX_PIXELS),  # above max_pixels: scaled down
        (10, 1990, SMALL_MAX_PIXELS),  # very wide (aspect ratio 199)
        (1000, 37, SMALL_MAX_PIXELS),  # very tall
        (2, 400, SMALL_MAX_PIXELS),  # aspect ratio exactly 200, still accepted
        (1100, 1000, 28 * 28 * 1280),  # above the default max_pixels
    ],
)
def test_preprocess_equals_transformers_image_processor(height, width, max_pixels):
    image = random_image(height, width, seed=height * 7 + width)
    assert_same_pixels(preprocess([image], max_pixels=max_pixels), hf_pixels([image], max_pixels=max_pixels))


def test_preprocess_of_several_images_with_custom_min_pixels_equals_transformers():
    images = [random_image(30, 40, seed=1), random_image(120, 60, seed=2), random_image(7, 9, seed=3)]
    ours = preprocess(images, min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 32)
    assert_same_pixels(ours, hf_pixels(images, min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 32))
    assert ours[1].dtype == np.int64 and ours[1][:, 0].tolist() == [1, 1, 1]


def test_too_elongated_images_are_refused_like_transformers_with_an_image_error():
    image = random_image(2, 500)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        hf_pixels([image])
    with pytest.raises(ImageError, match="aspect ratio of 250.0; the Qwen2-VL processor accepts at most 200"):
        preprocess([image])


def test_image_token_count_is_the_processors_expansion(hf_processor, qwen_tokenizer):
    image = random_image(90, 150)
    prepared = prepare_image(image, ImageSettings(max_pixels=SMALL_MAX_PIXELS))
    assert prepared.grid_thw == (1, 6, 10) and prepared.num_patches == 60
    assert image_token_count(prepared.grid_thw) == prepared.num_tokens == 15
    assert image_token_count((2, 4, 6), merge_size=1) == 48
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = hf_processor(text=[text], images=[image], return_tensors="np")["input_ids"][0].tolist()
    assert ids.count(IMAGE_PAD_ID) == prepared.num_tokens


def test_prepared_image_keeps_uint8_pixels_and_checks_them():
    prepared = prepare_image(random_image(60, 60), ImageSettings(max_pixels=SMALL_MAX_PIXELS))
    assert prepared.pixels.dtype == np.uint8 and prepared.pixels.shape == (56, 56, 3)
    assert not prepared.pixels.flags.writeable
    assert prepared == PreparedImage(np.array(prepared.pixels)) and prepared != PreparedImage(prepared.pixels * 0)
    with pytest.raises(ImageError, match="multiples of patch_size \\* merge_size = 28"):
        PreparedImage(np.zeros((30, 28, 3), np.uint8))
    with pytest.raises(ImageError, match="must be \\[H, W, 3\\] uint8"):
        PreparedImage(np.zeros((28, 28, 3), np.float32))
    with pytest.raises(ValueError, match="min_pixels=5000 is more than max_pixels=4000"):
        ImageSettings(min_pixels=5000, max_pixels=4000)
    with pytest.raises(ValueError, match="ImageSettings.max_pixels must be a positive int"):
        ImageSettings(max_pixels=0)


# --------------------------------------------------------------------------------------------------
# Loading: modes, arrays, files, and what is refused
# --------------------------------------------------------------------------------------------------


def images_in_modes():
    base = random_image(40, 60, seed=4)
    rgba = base.copy()
    rgba.putalpha(PIL.Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 60), dtype=np.uint8)))
    palette = base.convert("P")
    palette.info["transparency"] = 3
    small = np.random.default_rng(6).integers(0, 256, (40, 60))
    return {
        "1": base.convert("1"),
        "L": base.convert("L"),
        "LA": rgba.convert("LA"),
        "P": palette,
        "PA": rgba.convert("PA"),
        "RGBA": rgba,
        "RGBX": base.convert("RGBX"),
        "CMYK": base.convert("CMYK"),
        "YCbCr": base.convert("YCbCr"),
        "I;16": PIL.Image.fromarray(small.astype(np.uint16)),
        "I": PIL.Image.fromarray(small.astype(np.int32)),
        "F": PIL.Image.fromarray(small.astype(np.float32)),
    }


@pytest.mark.parametrize("mode", list(images_in_modes()))
def test_every_mode_converts_to_rgb_as_transformers_does(mode):
    image = images_in_modes()[mode]
    assert image.mode == mode
    loaded = load_image(image)
    assert loaded.mode == "RGB" and np.array_equal(np.asarray(loaded), np.asarray(image.convert("RGB")))
    assert_same_pixels(preprocess([image]), hf_pixels([image]))


def test_wide_modes_whose_values_would_be_clipped_and_unconvertible_modes_are_refused():
    sixteen_bit = PIL.Image.fromarray(np.full((8, 8), 4000, np.uint16))
    assert np.asarray(sixteen_bit.convert("RGB")).min() == 255  # what transformers would show: a white image
    with pytest.raises(ImageError, match="mode 'I;16' with values from 4000 to 4000.*clip"):
        load_image(sixteen_bit)
    with pytest.raises(ImageError, match="mode 'La', which PIL cannot convert to RGB"):
        load_image(PIL.Image.new("La", (8, 8)))


def test_arrays_load_as_transformers_reads_them():
    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, (45, 70, 3), dtype=np.uint8)
    assert_same_pixels(preprocess([rgb]), hf_pixels([rgb]))  # transformers takes the array itself
    gray = rgb[..., 0]
    assert_same_pixels(preprocess([gray]), hf_pixels([PIL.Image.fromarray(gray)]))
    assert_same_pixels(preprocess([gray[..., None]]), hf_pixels([PIL.Image.fromarray(gray)]))
    rgba = np.concatenate([rgb, rng.integers(0, 256, (45, 70, 1), dtype=np.uint8)], axis=-1)
    assert_same_pixels(preprocess([rgba]), hf_pixels([PIL.Image.fromarray(rgba, mode="RGBA")]))
    floats = rng.random((45, 70, 3))
    floats[0, :3] = [0.0, 1.0, 2 / 255]
    # floats in [0, 1] are already rescaled: transformers is told so, and reads them as its to_pil_image does
    for array in (floats, floats.astype(np.float32)):
        assert_same_pixels(preprocess([array]), hf_pixels([array], do_rescale=False))


@pytest.mark.parametrize(
    "array, message",
    [
        (np.zeros((0, 5, 3), np.uint8), "the image is empty"),
        (np.full((4, 4, 3), np.nan), "NaN or infinite"),
        (np.full((4, 4, 3), np.inf, np.float32), "NaN or infinite"),
        (np.full((4, 4, 3), 2.0), "values in \\[0, 1\\], got \\[2.0, 2.0\\]"),
        (np.zeros((4, 4, 3), np.int64), "uint8 \\(0..255\\) or float \\(0..1\\), got dtype int64"),
        (np.zeros((4, 4, 3), bool), "got dtype bool"),
        (np.zeros((3, 20, 30), np.uint8), "looks channels-first"),
        (np.zeros((4, 4, 2), np.uint8), "got shape \\(4, 4, 2\\)"),
        (np.zeros((2, 4, 4, 3), np.uint8), "got shape \\(2, 4, 4, 3\\)"),
    ],
)
def test_bad_arrays_raise_image_errors(array, message):
    with pytest.raises(ImageError, match=message):
        load_image(array)


def test_files_bytes_and_data_urls_decode_as_transformers_loads_them(tmp_path):
    image = random_image(40, 60, seed=8)
    png = encoded_bytes(image)
    expected = hf_pixels([image])
    path = tmp_path / "image.png"
    path.write_bytes(png)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    for source in (png, bytearray(png), str(path), path, "file://" + str(path), data_url,
                   {"type": "image", "image": str(path)}, {"type": "image_url", "image_url": {"url": data_url}},
                   {"image_url": data_url}, {"type": "image", "url": str(path)}):
        assert_same_pixels(preprocess([source]), expected)

    # a JPEG whose EXIF says "rotate": transformers' load_image turns it upright, and so do we
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    rotated = tmp_path / "rotated.jpg"
    rotated.write_bytes(encoded_bytes(image, "JPEG", exif=exif.tobytes()))
    assert load_image(rotated).size == (40, 60)
    assert_same_pixels(preprocess([str(rotated)]), hf_pixels([str(rotated)]))


def png_header_only(width, height):
    """A PNG whose header claims width x height pixels, with almost no pixel data behind it."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_the_pixel_cap_is_checked_on_the_header_before_decoding():
    # The data behind these headers is far too short: decoding would fail as truncated, so a cap error proves
    # the check came first.
    with pytest.raises(ImageError, match="10000x10000 = 100000000 pixels, more than the cap of 67108864"):
        load_image(png_header_only(10000, 10000))
    with pytest.raises(ImageError, match="300x200 = 60000 pixels, more than the cap of 50000"):
        load_image(png_header_only(300, 200), max_input_pixels=50000)
    with pytest.raises(ImageError, match="too many pixels to decode safely"):  # beyond PIL's own bomb limit
        load_image(png_header_only(30000, 30000))
    with pytest.raises(ImageError, match="truncated or corrupt"):
        load_image(png_header_only(300, 200))
    image = random_image(100, 100)
    with pytest.raises(ImageError, match="more than the cap of 9999"):
        load_image(encoded_bytes(image), max_input_pixels=9999)
    with pytest.raises(ImageError, match="more than the cap of 9999"):
        load_image(np.asarray(image), max_input_pixels=9999)
    assert load_image(encoded_bytes(image), max_input_pixels=10000).size == (100, 100)
    with pytest.raises(ImageError, match="more than the cap of 9999"):
        prepare_image(image, ImageSettings(max_input_pixels=9999))


def test_unreadable_sources_raise_image_errors(tmp_path):
    png = encoded_bytes(random_image(64, 64))
    cases = [
        (png[: len(png) // 2], "cannot be decoded \\(truncated or corrupt image data\\)"),
        (b"definitely not an image", "not an image PIL can read"),
        (b"", "no image data"),
        (str(tmp_path / "missing.png"), "no image file at"),
        ("https://example.com/cat.png", "web URL; images are not downloaded"),
        ("data:image/png,rawdata", "not base64 encoded"),
        ("data:image/png;base64,@@@@", "base64 payload cannot be decoded"),
        ({"type": "image"}, "holds no image"),
        ({"type": "image_url", "image_url": {"detail": "high"}}, "needs a string 'url'"),
        (12345, "cannot read an image from a int"),
        (PIL.Image.new("RGB", (0, 5)), "the image is empty \\(0x5 pixels\\)"),
    ]
    for source, message in cases:
        with pytest.raises(ImageError, match=message):
            load_image(source)
    assert issubclass(ImageError, ValueError)


# --------------------------------------------------------------------------------------------------
# Chat templates: token ids and pixels equal the VL processor's
# --------------------------------------------------------------------------------------------------

ZOOM_TOOL = {
    "type": "function",
    "function": {"name": "zoom", "description": "Zoom into the picture.",
                 "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
}


def vision_conversation():
    """Images in user messages and in (consecutive) tool messages, several turns."""
    return [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [{"type": "image", "image": random_image(50, 70, seed=10)},
                                     {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "Let me zoom.",
         "tool_calls": [{"type": "function", "function": {"name": "zoom", "arguments": {"x": 1}}},
                        {"type": "function", "function": {"name": "zoom", "arguments": {"x": 2}}}]},
        {"role": "tool", "content": [{"type": "text", "text": "zoomed:"},
                                     {"type": "image", "image": random_image(300, 200, seed=11)}]},
        {"role": "tool", "content": [{"type": "image", "image": np.zeros((20, 20, 3), np.uint8)},
                                     {"type": "text", "text": "and the corner"},
                                     {"type": "image", "image": random_image(100, 20, seed=12)}]},
        {"role": "assistant", "content": "A cat on a mat."},
        {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                     {"type": "image", "image": random_image(64, 64, seed=13)}]},
        {"role": "assistant", "content": "The same cat."},
    ]


SMALL = ImageSettings(max_pixels=SMALL_MAX_PIXELS)


@pytest.mark.parametrize("template", ["qwen2.5", "jinja"])
@pytest.mark.parametrize("tools", [None, [ZOOM_TOOL]], ids=["no_tools", "tools"])
def test_encoded_conversation_equals_the_vl_processor(qwen_tokenizer, hf_processor, template, tools):
    chat_template = "qwen2.5" if template == "qwen2.5" else QWEN2_5_JINJA
    messages = vision_conversation()
    for end in (2, 5, len(messages)):  # prompt only, after the tool images, the whole conversation
        prefix = messages[:end]
        generation_prompt = prefix[-1]["role"] != "assistant"
        ids, reference_values, reference_grid = hf_conversation(hf_processor, prefix, tools, generation_prompt)
        encoded = encode_conversation(qwen_tokenizer, prefix, tools=tools, chat_template=chat_template,
                                      add_generation_prompt=generation_prompt, image_settings=SMALL)
        assert encoded.token_ids == ids
        assert_same_pixels(pixel_inputs(encoded.images), (reference_values, reference_grid))
        vision = [bit for token, bit in zip(encoded.token_ids, encoded.action_mask)
                  if token in (IMAGE_PAD_ID, VISION_START_ID, VISION_END_ID)]
        assert vision and not any(vision)

    # The rollout encoder, turn by turn, gives the same ids, masks and images.
    encoder = ConversationEncoder(qwen_tokenizer, chat_template=chat_template, tools=tools, image_settings=SMALL)
    encoder.start(messages[:2])
    for index in (2, 5):
        encoder.append_assistant(encoded_turn(qwen_tokenizer, messages, index, tools), messages[index])
        encoder.append_messages(messages[index + 1 : index + (3 if index == 2 else 2)])
    encoder.append_assistant(encoded_turn(qwen_tokenizer, messages, 7, tools), messages[7])
    assert encoder.finish() == encoded
    assert [encoded.token_ids[start : start + image.num_tokens] for start, image in
            zip(encoder.image_starts, encoder.images)] == [[IMAGE_PAD_ID] * image.num_tokens for image in encoder.images]


def encoded_turn(tokenizer, messages, index, tools):
    """The ids a model samples for assistant message `index`: its text after the generation prompt."""
    prompt = encode_conversation(tokenizer, messages[:index], tools=tools, chat_template="qwen2.5",
                                 add_generation_prompt=True, image_settings=SMALL)
    through = encode_conversation(tokenizer, messages[: index + 1], tools=tools, chat_template="qwen2.5",
                                  image_settings=SMALL)
    return through.token_ids[len(prompt.token_ids) : -1]  # up to <|im_end|>, without the "\n" after it


def test_templates_that_cannot_place_images_are_refused(qwen_tokenizer, llama3_tokenizer):
    picture = [{"role": "user", "content": [{"type": "image", "image": random_image(30, 30)}, "What?"]}]
    with pytest.raises(ValueError, match="template 'llama3' has no placeholder for image content parts.*qwen2.5"):
        encode_conversation(llama3_tokenizer, picture, chat_template="llama3")
    text_only = "{% for m in messages %}{{ m.content if m.content is string else 'parts' }}{% endfor %}"
    with pytest.raises(ValueError, match="wrote 0 <\\|image_pad\\|> placeholders for 1 image parts"):
        encode_conversation(qwen_tokenizer, picture, chat_template=text_only)
    with pytest.raises(ValueError, match="wrote 2 <\\|image_pad\\|> placeholders for 1 image parts"):
        encode_conversation(qwen_tokenizer, [{"role": "user", "content": [
            {"type": "text", "text": "<|image_pad|>"}, {"type": "image", "image": random_image(30, 30)}]}],
            chat_template="qwen2.5")
    with pytest.raises(ValueError, match="tokenizer has no <\\|image_pad\\|> token"):
        encode_conversation(llama3_tokenizer, picture, chat_template=QWEN2_5_JINJA)
    encoder = ConversationEncoder(qwen_tokenizer, chat_template=QWEN2_5_JINJA)
    encoder.start([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="assistant messages cannot contain image"):
        encoder.append_assistant([1, 2], {"role": "assistant", "content": [{"type": "image", "image": "x.png"}]})


def test_text_only_encoding_is_unchanged_by_image_support(qwen_tokenizer):
    """A literal <|image_pad|> in text without image parts stays what it always was: one token."""
    messages = [{"role": "user", "content": "say <|image_pad|>"}]
    encoded = encode_conversation(qwen_tokenizer, messages, chat_template="qwen2.5", add_generation_prompt=True)
    assert encoded.images == [] and encoded.token_ids.count(IMAGE_PAD_ID) == 1
    assert encoded.token_ids == qwen_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


# --------------------------------------------------------------------------------------------------
# Tool observations with images
# --------------------------------------------------------------------------------------------------


@tool
def look(kind: str) -> list:
    """Returns a picture with text.

    Args:
        kind: What to return.
    """
    picture = np.full((30, 40, 3), 200, np.uint8)
    if kind == "pil":
        return [{"type": "text", "text": "a grey box"}, {"type": "image", "image": PIL.Image.fromarray(picture)}]
    if kind == "array_and_png":
        return [{"type": "image", "image": picture}, {"type": "text", "text": "two views"},
                {"type": "image", "image": encoded_bytes(PIL.Image.fromarray(picture))}]
    if kind == "dict":
        return {"observation": [{"type": "text", "text": "x"}, {"type": "image", "image": picture}], "score": 3}
    if kind == "text_parts":
        return [{"type": "text", "text": "only "}, {"type": "text", "text": "text"}]
    if kind == "long":
        return [{"type": "text", "text": "y" * 30}, {"type": "image", "image": picture},
                {"type": "text", "text": "z" * 30}]
    if kind == "surrogate":
        return [{"type": "text", "text": "bad \ud800"}, {"type": "image", "image": picture}]
    if kind == "corrupt":
        return [{"type": "text", "text": "broken"}, {"type": "image", "image": b"\x89PNG not really"}]
    if kind == "nan":
        return [{"type": "image", "image": np.full((4, 4, 3), np.nan)}]
    if kind == "missing":
        return [{"type": "image"}]
    if kind == "bad_text":
        return [{"type": "text", "text": 5}]
    raise ValueError(kind)


def call_look(kind, **options):
    return asyncio.run(execute_tool_call({"name": "look", "arguments": {"kind": kind}}, [look], **options))


def test_tool_images_become_content_parts_and_bad_ones_bad_image_observations():
    result = call_look("pil")
    assert result.ok and result.observation == "a grey box" and result.error_kind is None
    assert [part["type"] for part in result.content] == ["text", "image"]
    [image] = result.images
    assert image.mode == "RGB" and np.asarray(image).tolist() == np.full((30, 40, 3), 200).tolist()

    result = call_look("array_and_png")
    assert result.ok and result.observation == "two views" and len(result.images) == 2
    assert all(np.array_equal(np.asarray(image), np.full((30, 40, 3), 200)) for image in result.images)

    result = call_look("dict")
    assert result.ok and result.extras == {"score": 3} and len(result.images) == 1

    result = call_look("text_parts")  # no image: the same as returning the text
    assert result.ok and result.content == result.observation == "only text" and result.parts is None

    result = call_look("long", max_observation_chars=40)
    assert not result.ok and result.error_kind == "oversized" and len(result.images) == 1
    texts = [part["text"] for part in result.parts if part["type"] == "text"]
    assert texts[:2] == ["y" * 30, "z" * 10] and "[observation truncated: the tool returned 60 characters" in texts[2]

    result = call_look("surrogate")
    assert not result.ok and result.error_kind == "tool_exception" and result.parts[0]["text"] == "bad \\ud800"

    for kind, message in [("corrupt", "(part 1): the 15 bytes: not an image PIL can read"),
                          ("nan", "(part 0): the image array holds NaN"),
                          ("missing", "(part 0): the content part {'type': 'image'} holds no image")]:
        result = call_look(kind)
        assert not result.ok and result.error_kind == "bad_image" and result.parts is None, kind
        assert result.observation.startswith("Error: tool 'look' returned an image that cannot be used " + message)
    result = call_look("bad_text")
    assert result.error_kind == "tool_exception" and "text part without a string 'text'" in result.error


def test_agents_put_tool_images_in_their_observation_messages(qwen_tokenizer):
    with_image, failed = call_look("pil"), call_look("corrupt")
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["hi"]))
    tool_calling = ToolCallingAgent(backend, qwen_tokenizer, tools=[look], chat_template="qwen2.5")
    assert tool_calling.observation_messages([with_image, failed]) == [
        {"role": "tool", "content": with_image.parts}, {"role": "tool", "content": failed.observation}]
    react = ReactAgent(backend, qwen_tokenizer, tools=[look], chat_template="qwen2.5")
    [message] = react.observation_messages([failed, with_image])
    assert message["content"] == [
        {"type": "text", "text": "Observation: " + failed.observation},
        {"type": "text", "text": "\nObservation: a grey box"},
        {"type": "image", "image": with_image.images[0]},
    ]
    assert react.observation_messages([failed]) == [{"role": "user", "content": "Observation: " + failed.observation}]


# --------------------------------------------------------------------------------------------------
# Rollouts: trajectories keep their images; batches lay them out for the vision tower
# --------------------------------------------------------------------------------------------------

PROMPT_IMAGE = random_image(60, 90, seed=20)


class PictureAgent(ToolCallingAgent):
    """A tool-calling agent whose task shows a picture with the question."""

    def build_messages(self, task):
        return [{"role": "user", "content": [{"type": "image", "image": PROMPT_IMAGE},
                                             {"type": "text", "text": task["question"]}]}]


def picture_agent(tokenizer, backend, **options):
    options.setdefault("max_pixels", SMALL_MAX_PIXELS)
    return PictureAgent(backend, tokenizer, tools=[look], chat_template="qwen2.5", max_turns=4, **options)


def scripted(replies):
    return lambda prompt: replies[min(prompt.turn, len(replies) - 1)]


def rollout(agent, tasks, num_chains=1):
    return asyncio.run(agent.run(tasks, num_chains=num_chains, progress=False))


def test_trajectory_keeps_its_images_and_equals_the_processors_encoding(qwen_tokenizer, hf_processor):
    replies = [tool_call_text("look", {"kind": "array_and_png"}), "It is grey."]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    agent = picture_agent(qwen_tokenizer, backend)
    [trajectory] = rollout(agent, [{"question": "What colour?"}])
    assert trajectory.finish_reason == "stop" and trajectory.num_turns == 2
    assert [record.images for record in trajectory.tool_call_records] == [2]

    # The processor, given the conversation the chain had (its messages hold the tool's images), gives the same
    # ids (plus the "\n" the template writes after the last <|im_end|>) and the same pixels.
    ids, reference_values, reference_grid = hf_conversation(hf_processor, trajectory.messages, agent.template_tools())
    assert trajectory.token_ids == ids[:-1] and ids[-1:] == qwen_tokenizer.encode("\n")
    assert_same_pixels(pixel_inputs(trajectory.images), (reference_values, reference_grid))
    vision = [bit for token, bit in zip(trajectory.token_ids, trajectory.action_mask)
              if token in (IMAGE_PAD_ID, VISION_START_ID, VISION_END_ID)]
    assert len(vision) == sum(image.num_tokens + 2 for image in trajectory.images) and not any(vision)

    # Each generate call got the images of its prompt, in order.
    assert [len(call["images"]) for call in backend.calls] == [1, 3]
    assert backend.calls[1]["images"] == trajectory.images
    assert all(call["prompt_ids"].count(IMAGE_PAD_ID) == sum(i.num_tokens for i in call["images"])
               for call in backend.calls)


def test_batch_lays_out_every_image_in_row_and_token_order(qwen_tokenizer, hf_processor):
    replies = [tool_call_text("look", {"kind": "pil"}), "Grey."]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    trajectories = rollout(picture_agent(qwen_tokenizer, backend), [{"question": "a?"}, {"question": "b?"}])
    text_only = Trajectory(token_ids=[1, 2, 3], action_mask=[0, 1, 1], sampler_logprobs=[0.0, -1.0, -1.0])
    trajectories.insert(1, text_only)
    batch = trajectories_to_batch(trajectories, image_token_id=IMAGE_PAD_ID)
    images = [image for trajectory in trajectories for image in trajectory.images]
    total = sum(image.num_patches for image in images)
    assert len(images) == 4 and batch["pixel_values"].shape == (1024, 1176) and total <= 1024
    assert batch["image_rows"].tolist() == [0, 0, 2, 2]
    assert batch["image_grid_thw"].tolist() == [list(image.grid_thw) for image in images]
    assert not batch["pixel_values"][total:].any()
    expected_ids = np.repeat(np.arange(4), [image.num_patches for image in images])
    assert batch["patch_image_ids"][:total].tolist() == expected_ids.tolist()
    assert (batch["patch_image_ids"][total:] == -1).all()

    # The same pixels as the processor's for the batch of both conversations, image for image.
    reference = hf_processor.apply_chat_template(
        [copy.deepcopy(trajectories[0].messages), copy.deepcopy(trajectories[2].messages)], tools=[look.schema],
        tokenize=True, return_dict=True, return_tensors="np", processor_kwargs={"padding": True})
    assert np.abs(batch["pixel_values"][:total] - reference["pixel_values"]).max() <= 1e-6
    assert batch["image_grid_thw"].tolist() == reference["image_grid_thw"].tolist()

    # The k-th <|image_pad|> in row-major order is the k-th merge window of patches: scattering per-window
    # features through the pad positions puts each image's windows on its own pads, in order.
    window_image = batch["patch_image_ids"][:total:4]
    pad_rows = np.nonzero(batch["tokens"] == IMAGE_PAD_ID)[0]
    assert len(pad_rows) == len(window_image)
    assert np.array_equal(batch["image_rows"][window_image], pad_rows)

    # The model's host-side layout takes the batch as it is: real patches get their frames, padding none.
    from agentfly_jax.models.config import VisionConfig
    from agentfly_jax.models.qwen2_5_vl import vision_layout

    layout = vision_layout(VisionConfig(), batch["image_grid_thw"], batch["pixel_values"].shape[0])
    assert np.array_equal(layout.full_segments > 0, batch["patch_image_ids"] >= 0)
    assert np.array_equal(layout.full_segments[:total] - 1, batch["patch_image_ids"][:total])

    # Text keys are what they always were; a text-only batch has no pixel keys at all.
    text_batch = trajectories_to_batch([text_only])
    assert set(text_batch) == TEXT_KEYS and set(batch) == TEXT_KEYS | {
        "pixel_values", "image_grid_thw", "image_rows", "patch_image_ids"}
    for key in TEXT_KEYS - {"tokens", "positions", "segment_ids", "action_mask", "sampler_logprobs"}:
        assert batch[key].shape == (3,)

    fixed = images_to_batch(trajectories, pad_patches_to=total)
    assert fixed["pixel_values"].shape == (total, 1176) and (fixed["patch_image_ids"] >= 0).all()
    for bad in (total - 4, total + 2):
        with pytest.raises(ValueError, match=f"pad_patches_to={bad} must be at least the batch's {total} patches"):
            images_to_batch(trajectories, pad_patches_to=bad)
    with pytest.raises(ValueError, match="trajectory 0 has .* image tokens \\(id 151654\\)"):
        images_to_batch(trajectories, image_token_id=151654)
    with pytest.raises(ValueError, match="got trajectories without images"):
        images_to_batch([text_only])
    odd = Trajectory(token_ids=[1], action_mask=[0], sampler_logprobs=[0.0],
                     images=[PreparedImage(np.zeros((16, 16, 3), np.uint8), patch_size=8)])
    with pytest.raises(ValueError, match="different patch geometries"):
        images_to_batch([trajectories[0], odd])
    with pytest.raises(ValueError, match="Trajectory.images\\[0\\] is a Image"):
        Trajectory(token_ids=[1], action_mask=[0], sampler_logprobs=[0.0], images=[PROMPT_IMAGE])


def test_a_prompt_without_room_to_sample_ends_its_chain_counted(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["never sampled"]))

    def reward_fn(prediction):  # would score 1.0 if it ran
        return 1.0

    agent = picture_agent(qwen_tokenizer, backend, max_context_tokens=40, reward_fn=reward_fn)
    trajectories = rollout(agent, [{"question": "What colour?"}], num_chains=2)
    assert backend.calls == []
    for trajectory in trajectories:
        assert trajectory.finish_reason == "prompt_too_long" and trajectory.chain_error
        assert trajectory.reward == 0.0 and trajectory.num_action_tokens == 0
        assert len(trajectory.images) == 1
        assert "the prompt has" in trajectory.metrics["error"]
        assert "of them for its 1 images" in trajectory.metrics["error"]
        assert "max_context_tokens=40" in trajectory.metrics["error"]
        assert "lower max_pixels" in trajectory.metrics["error"]
    assert agent.last_run_stats["finish/prompt_too_long"] == 2 and agent.last_run_stats["chain_errors"] == 0


def test_an_observation_image_past_the_context_is_cut_with_its_tokens(qwen_tokenizer):
    replies = [tool_call_text("look", {"kind": "pil"}), "Grey."]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    [full] = rollout(picture_agent(qwen_tokenizer, backend), [{"question": "q?"}])
    first_sampled = full.action_mask.index(1)
    first_turn_end = full.action_mask.index(0, first_sampled)  # after the first turn's <|im_end|>
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    [cut] = rollout(picture_agent(qwen_tokenizer, backend, max_context_tokens=first_turn_end + 5), [{"question": "q?"}])
    assert cut.finish_reason == "max_context" and cut.token_ids == full.token_ids[:first_turn_end]
    assert cut.images == full.images[:1] and len(full.images) == 2


def test_backends_that_do_not_take_images_fail_the_chain_with_a_clear_error(qwen_tokenizer):
    class TextOnlyBackend(FakeScriptedBackend):
        supports_images = False

    backend = TextOnlyBackend(qwen_tokenizer, scripted(["hi"]))
    [trajectory] = rollout(picture_agent(qwen_tokenizer, backend), [{"question": "q?"}])
    assert trajectory.finish_reason == "error" and backend.calls == []
    assert "holds 1 images but the backend TextOnlyBackend does not take images" in trajectory.metrics["error"]


def test_a_vision_pad_the_policy_samples_ends_its_chain_as_a_counted_error(qwen_tokenizer):
    """A vision-language policy that writes <|image_pad|> itself: the pad would stand for image features nobody
    sent (the next prompt's pads no longer match its images; the update could not place them), so the chain ends
    as a chain error (dropped from the batch, counted) with a message saying why. A text policy's backend is not
    checked: there the token is just text."""
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["It is <|image_pad|> grey.", "Grey."]))
    vision_agent = picture_agent(qwen_tokenizer, backend)
    [trajectory] = rollout(vision_agent, [{"question": "What colour?"}])
    assert trajectory.finish_reason == "error" and trajectory.chain_error and len(backend.calls) == 1
    assert vision_agent.last_run_stats["chain_errors"] == 1
    assert f"sampled a vision pad token (ids [{IMAGE_PAD_ID}]) in turn 1" in trajectory.metrics["error"]

    class TextPolicyBackend(FakeScriptedBackend):
        supports_images = False

    text_backend = TextPolicyBackend(qwen_tokenizer, scripted(["It is <|image_pad|> grey."]))
    agent = ToolCallingAgent(text_backend, qwen_tokenizer, tools=[look], chat_template="qwen2.5", max_turns=2)
    [plain] = rollout(agent, [{"question": "What colour?"}])
    assert plain.finish_reason == "stop" and not plain.chain_error and IMAGE_PAD_ID in plain.token_ids


def test_agent_pixel_settings_size_the_images(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["Grey."]))
    [trajectory] = rollout(picture_agent(qwen_tokenizer, backend, max_pixels=28 * 28 * 4), [{"question": "q?"}])
    height, width = hf_smart_resize(60, 90, 28, 56 * 56, 28 * 28 * 4)
    assert [image.num_tokens for image in trajectory.images] == [height * width // 28**2] == [2]
    [trajectory] = rollout(picture_agent(qwen_tokenizer, backend, min_pixels=28 * 28 * 100, max_pixels=28 * 28 * 200),
                           [{"question": "q?"}])
    assert trajectory.images[0].num_tokens >= 100
    with pytest.raises(ValueError, match="min_pixels=5000 is more than max_pixels=4000"):
        picture_agent(qwen_tokenizer, backend, min_pixels=5000, max_pixels=4000)


def test_bad_prompt_images_fail_the_rollout_at_start(qwen_tokenizer):
    class BrokenPictureAgent(PictureAgent):
        def build_messages(self, task):
            return [{"role": "user", "content": [{"type": "image", "image": b"junk"}, "q"]}]

    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["hi"]))
    agent = BrokenPictureAgent(backend, qwen_tokenizer, chat_template="qwen2.5")
    with pytest.raises(ValueError, match="tasks\\[0\\]: cannot build its prompt: ImageError: the 4 bytes: not an image"):
        rollout(agent, [{"question": "q?"}])
