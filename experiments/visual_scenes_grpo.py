"""Visual question answering with a zoom tool: a Qwen2.5-VL policy learns to look closer (environments/visual_scenes).

    agentfly-train --config experiments/visual_scenes_grpo.py          # one GPU (about 8 minutes on an H200)
    agentfly-train --config experiments/visual_scenes_grpo.py:cpu      # plumbing run on a CPU (well under a minute
                                                                        # after start-up and compiles)
    agentfly-train --config experiments/visual_scenes_grpo.py \\
        --config.model.hf_path=/path/to/Qwen2.5-VL-3B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-VL-3B-Instruct \\
        --config.tokenizer.kind="" --config.optimizer.learning_rate=1e-6   # a released checkpoint instead

Each task shows a generated scene of coloured shapes (some tiny, 5-7 pixels: their outline is lost at the image's
resolution) with one question about it ("How many red triangles are in the image?"); the `zoom(x0, y0, x1, y1)`
tool returns a region enlarged from a finer canvas, as an image. Exact-match reward (1.0 / 0.0). The first user
message carries the scene image then the question (the agent builds it from the row's `images`); every zoom
result comes back as a tool message with its image.

The GPU run: a small vision-language policy of Qwen2.5-VL's architecture, random-initialised (no checkpoint is
needed: 512-wide, 8 layers, a 4-block vision tower; the Qwen2.5 tokenizer with its vision tokens), is warm-started
by SFT on the environment's demonstrations (`sft.stages`: first every demonstration zooms on the tiny shapes the
answer depends on, then half of them answer at a glance, guessing tiny shapes), so that the warm-started policy
zooms some of the time; GRPO then has groups whose chains differ (zoom or glance) to learn from. On one H200 the
run takes about 8 minutes and raised held-out success from 0.32 to 0.41, but by giving up the zoom tool (see
docs/vision.md, "A GPU learning run"). Success is measured on 200 held-out test scenes (greedy, one chain each) before SFT, after
SFT (= before RL) and after RL: `summary.json` holds success_before_sft, success_before and success_after, and
TensorBoard `update/image_patches` and `rollout/images` show the images each step trained on.

The `:cpu` variant is the plumbing check the test suite runs (tests/trainer/test_vision_experiment.py): a tiny
random policy of the same architecture, 64-pixel scenes and every image resized to 56 x 56 pixels (4 tokens), one
SFT step on two demonstrations (their zoom images included), one GRPO step of one task x 2 chains on the JAX
sampler with the scene in the prompt, and the final export.
"""
from experiments.common import base, cpu_plumbing

#: The image processor's pixel range for the GPU run: a 224-pixel scene is 64 tokens, a zoom at most 64.
GPU_MAX_PIXELS = 224 * 224


def vl_policy(c, *, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vision_depth: int,
              vision_hidden: int, vision_heads: int, vision_mlp: int, fullatt=(1,)) -> None:
    """A random-initialised Qwen2.5-VL-architecture policy (family 'qwen2_5_vl'): the language model's shape, and
    a vision tower of `vision_depth` blocks (window attention, whole-image attention in `fullatt`) whose output is
    the language model's width; the offline Qwen2.5 tokenizer (it has the vision tokens) and the qwen2.5 template."""
    c.model.update(dict(hf_path="", family="qwen2_5_vl", hidden_size=hidden, intermediate_size=mlp,
                        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, qkv_bias=True,
                        tie_word_embeddings=True))
    c.model.vision.update(dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_mlp,
                               num_heads=vision_heads, window_size=112, fullatt_block_indexes=tuple(fullatt)))
    c.tokenizer.kind = "qwen2.5"
    c.chat_template = "qwen2.5"


def get_config(arg: str | None = None):
    c = base("runs/visual_scenes_grpo", "visual_scenes", image_size=224, num_objects=(4, 8), num_tiny=(1, 3),
             train_size=2000, dev_size=200, test_size=200, max_turns=5)
    c.algorithm = "grpo"
    vl_policy(c, hidden=512, layers=8, heads=8, kv_heads=2, mlp=1536, vision_depth=4, vision_hidden=256,
              vision_heads=4, vision_mlp=768, fullatt=(1, 3))
    c.model.update(dict(dtype="bfloat16", param_dtype="float32", remat=True))
    c.task.update(dict(num_train=2000, num_eval=200))
    c.agent.update(dict(max_turns=5, max_new_tokens=64, max_context_tokens=1536, max_pixels=GPU_MAX_PIXELS))
    c.seq_buckets = (768, 1024, 1536)
    c.jax_sampler.update(dict(max_slots=128, max_len=1536, steps_per_call=16, prefill_patches=4096))
    # the tool format and where to zoom first, then a mix in which half the answers come at a glance
    c.sft.update(dict(stages=((300, 1.0), (150, 0.5)), batch_size=16))
    c.sft.optimizer.update(dict(learning_rate=3e-4, warmup_steps=20, decay_steps=450, schedule="cosine",
                                end_lr_ratio=0.1))
    c.rl.update(dict(steps=60, tasks_per_step=16, chains_per_task=8, ppo_epochs=1, mini_batches=2, micro_batches=1,
                     micro_batch_tokens=4096))  # the vision tower attends densely over a micro-batch's patches
    c.optimizer.update(dict(learning_rate=2e-5, warmup_steps=0, schedule="constant"))
    c.loss.clip_eps_high = 0.28
    c.checkpoint.update(dict(every=0, keep=1))
    c.eval.update(dict(every=20, num_tasks=200, num_chains=1, temperature=0.0, top_p=1.0, sampled_chains=0))
    if arg == "cpu":
        c.env.options.update(dict(image_size=64, num_objects=(2, 4), num_tiny=(1, 1), train_size=8, dev_size=2,
                                  test_size=2, max_turns=3))
        vl_policy(c, hidden=64, layers=2, heads=2, kv_heads=1, mlp=128, vision_depth=2, vision_hidden=32,
                  vision_heads=2, vision_mlp=64)
        c.model.update(dict(dtype="float32", remat=False))
        cpu_plumbing(c, context=640, buckets=(640,), turns=2, steps=1, tasks_per_step=1, new_tokens=16, slots=2)
        c.task.num_train = 8
        c.agent.update(dict(min_pixels=56 * 56, max_pixels=56 * 56))  # every image 56 x 56 pixels: 4 tokens
        c.jax_sampler.update(dict(steps_per_call=8, prefill_patches=256, min_patch_bucket=64))
        c.sft.update(dict(stages=((1, 1.0),), batch_size=2))
        c.sft.optimizer.update(dict(warmup_steps=0, decay_steps=1))
        c.rl.micro_batch_tokens = None
    elif arg:
        raise ValueError(f"experiments/visual_scenes_grpo.py takes no argument or 'cpu', got {arg!r}")
    return c
