"""The visual_scenes GRPO experiment with a Qwen2.5-VL policy: its configs build, a vision-language policy is
configured with typed, checked knobs, and the `:cpu` variant trains end to end through `agentfly_jax.train` (a
short SFT on demonstrations with images, one GRPO step on the JAX sampler with the scene in every prompt, the
export), images reaching the model at every stage."""
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from agentfly_jax.models import Qwen2_5_VLCausalLM, load_pretrained
from agentfly_jax.images import ImageSettings, prepare_image
from agentfly_jax.rollout.tokenizers import build_llama3_style_tokenizer, build_qwen2_5_tokenizer
from agentfly_jax.trainer import builders
from agentfly_jax.trainer.config import ConfigError, TrainConfig
from experiments import visual_scenes_grpo
from tests.trainer.test_smollm2_recipes import train_cpu_variant

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen"))


def test_configs_build():
    gpu = TrainConfig.build(visual_scenes_grpo.get_config())
    cpu = TrainConfig.build(visual_scenes_grpo.get_config("cpu"))
    for cfg in (gpu, cpu):
        assert cfg.env.name == "visual_scenes" and cfg.algorithm == "grpo" and cfg.model.family == "qwen2_5_vl"
        assert cfg.tokenizer.kind == "qwen2.5" and cfg.chat_template == "qwen2.5" and cfg.backend == "jax"
        assert cfg.agent.max_context_tokens <= max(cfg.seq_buckets)
    assert cpu.rl.steps == 1 and cpu.sft.stages == ((1, 1.0),) and cpu.agent.max_pixels == 56 * 56
    assert gpu.rl.steps > 1 and gpu.eval.num_tasks == gpu.task.num_eval == 200 and gpu.task.eval_split == "test"
    with pytest.raises(ValueError, match="takes no argument or 'cpu'"):
        visual_scenes_grpo.get_config("gpu")


def _vl(**model):
    c = visual_scenes_grpo.get_config("cpu")
    for key, value in model.items():
        node = c.model
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return c


@pytest.mark.parametrize("change,message", [
    ({"mrope_section": (4, 6, 7)}, "config.model.mrope_section=(4, 6, 7) must sum to head_dim / 2 = 16"),
    ({"head_dim": 16}, "Qwen2.5-VL's head dim is hidden_size / num_heads"),
    ({"qkv_bias": False}, "always has qkv biases"),
    ({"vision.num_heads": 3}, "config.model.vision.hidden_size=32 with num_heads=3: the head dim"),
    ({"vision.num_heads": 16}, "config.model.vision.hidden_size=32 with num_heads=16: the head dim"),
    ({"vision.fullatt_block_indexes": (2,)}, "name blocks past the tower's depth=2"),
    ({"vision.window_size": 14}, "config.model.vision.window_size=14 is out of range; allowed: >= 28"),
    ({"family": "qwen2", "mrope_section": (4, 6, 6)}, "mrope_section applies to family 'qwen2_5_vl'"),
])
def test_vision_language_model_knobs_are_checked(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        TrainConfig.build(_vl(**change))


def test_a_critic_beside_a_vision_language_policy_is_refused():
    c = visual_scenes_grpo.get_config("cpu")
    c.algorithm = "ppo"
    with pytest.raises(ConfigError, match="trains a critic, which would not see the images"):
        TrainConfig.build(c)


def test_build_policy_makes_a_qwen2_5_vl_policy_with_the_tokenizers_vision_tokens(tokenizer, tmp_path):
    cfg = TrainConfig.build(visual_scenes_grpo.get_config("cpu"))
    model, params = builders.build_policy(cfg, tokenizer)
    assert isinstance(model, Qwen2_5_VLCausalLM) and set(params) == {"visual", "model"}
    config = model.config
    assert config.mrope_section == builders.default_mrope_section(32) == (4, 6, 6)
    assert builders.default_mrope_section(128) == (16, 24, 24)  # Qwen2.5-VL's own split
    assert sum(builders.default_mrope_section(18)) == 9
    assert config.vocab_size == len(tokenizer) and config.vision.out_hidden_size == config.hidden_size == 64
    assert (config.vision.depth, config.vision.hidden_size, config.vision.fullatt_block_indexes) == (2, 32, (1,))
    assert config.vision.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert config.vision.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    with pytest.raises(ConfigError, match="lacks <\\|image_pad\\|>, <\\|video_pad\\|>, <\\|vision_start"):
        builders.build_policy(cfg, build_llama3_style_tokenizer(tmp_path / "llama"))


def test_layer_row_splits_reach_the_policy_and_split_mrope_positions(tokenizer):
    """config.model.layer_row_splits reaches the built model; with mRoPE positions [3, B, T] the layers on two
    groups of rows give the unsplit model's hidden states."""
    import dataclasses

    import jax.numpy as jnp

    c = visual_scenes_grpo.get_config("cpu")
    c.model.layer_row_splits = 2
    model, params = builders.build_policy(TrainConfig.build(c), tokenizer)
    assert model.config.layer_row_splits == 2
    whole = Qwen2_5_VLCausalLM(dataclasses.replace(model.config, layer_row_splits=1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 12, model.config.hidden_size)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 12, (3, 4, 12)), jnp.int32)  # distinct per axis and row
    got, want = (m.apply({"params": params}, x, positions, method="hidden_from_embeddings") for m in (model, whole))
    assert not np.allclose(np.asarray(positions[:, 0]), np.asarray(positions[:, 1]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_cpu_variant_trains_on_images_end_to_end(tmp_path):
    workdir = tmp_path / "run"
    train_cpu_variant("visual_scenes_grpo.py", workdir, timeout=900)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["environment"] == "visual_scenes"

    rows = [json.loads(line) for line in (workdir / "tensorboard" / "metrics.jsonl").open()]
    [sft] = [r for r in rows if "sft/loss" in r]
    [rl] = [r for r in rows if "reward/mean" in r]
    # SFT: two demonstrations, each with its scene (and its zooms' images), through the vision tower
    assert math.isfinite(sft["sft/loss"]) and sft["sft/loss"] > 0 and sft["sft/images"] >= 2
    assert sft["sft/image_patches"] == 16 * sft["sft/images"]  # every image 56 x 56: 4 x 4 patches
    # RL: both chains saw their scene in the prompt, the sampler prefilled with images, the update read them
    assert rl["rollout/chains_finished"] == 2 and rl["rollout/finish/error"] == 0 and rl["rollout/images"] >= 2
    assert rl["sampler/compiles_prefill_images"] >= 1
    assert rl["update/images"] == rl["rollout/images"] and rl["update/image_patches"] == 16 * rl["update/images"]
    assert rl["update/image_patch_rows"] >= rl["update/image_patches"]
    for key in ("policy/loss", "policy/entropy", "policy/grad_norm", "policy/logprob_mean",
                "mismatch/sampler_vs_trainer_logprob_abs"):
        assert math.isfinite(rl[key]), key
    # the sampler and the trainer agree on the sampled tokens' logprobs (same weights, images and positions)
    assert rl["mismatch/sampler_vs_trainer_logprob_abs"] < 1e-3

    # the exported policy is a Qwen2.5-VL checkpoint whose processor cuts images as training did
    final = workdir / "final_policy"
    model, _ = load_pretrained(str(final))
    assert isinstance(model, Qwen2_5_VLCausalLM)
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(final))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 90, 3), dtype=np.uint8))
    out = processor(images=[image], return_tensors="np")
    prepared = prepare_image(image, ImageSettings(min_pixels=56 * 56, max_pixels=56 * 56))
    assert out["image_grid_thw"].tolist() == [list(prepared.grid_thw)]
    np.testing.assert_allclose(out["pixel_values"], prepared.pixel_values(), atol=1e-5)


def test_launched_vllm_servers_get_the_tokenizer_and_image_settings(tokenizer, tmp_path, monkeypatch):
    """vLLM's image processing reads the tokenizer and preprocessor_config.json from the served directory."""
    class Recorder:
        def __init__(self, model_dir, num_servers, *, extra_args, run_dir):
            self.model_dir = model_dir

        def start(self, *, wait=True):
            return ["http://127.0.0.1:1"]

    monkeypatch.setattr("agentfly_jax.rollout.backends.LocalVLLMServers", Recorder)
    config = visual_scenes_grpo.get_config("cpu")
    config.backend, config.vllm.launch = "vllm", True
    cfg = TrainConfig.build(config)
    model, params = builders.build_policy(cfg, tokenizer)
    builders.build_backend(cfg, model, params, workdir=str(tmp_path), tokenizer=tokenizer)
    served = tmp_path / "vllm_model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= set(os.listdir(served))
    settings = json.loads((served / "preprocessor_config.json").read_text())
    assert (settings["min_pixels"], settings["max_pixels"]) == (56 * 56, 56 * 56)
    assert settings["image_processor_type"] == "Qwen2VLImageProcessor"
    with pytest.raises(ValueError, match="needs its tokenizer"):
        builders.build_backend(cfg, model, params, workdir=str(tmp_path / "again"))
