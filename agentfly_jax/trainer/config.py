"""The experiment config, typed: each section a frozen dataclass, built and validated once at start-up.

Experiment files (`experiments/*.py`) write ml-collections ConfigDicts (`get_config(arg)`); `TrainConfig.build`
turns one into typed sections before any model or data work. Unknown keys (with a suggestion), wrong types
and out-of-range values are refused in one line naming the key and what is allowed (`ConfigError`).
`default_config()` is the ConfigDict of all defaults: keys whose default is unset (None) are ml-collections
placeholders of their type, so `--config.loss.logprob_chunk=256` works from the command line.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from agentfly_jax.algorithms.losses import AGGREGATION_MODES
from agentfly_jax.models.config import GPU_GEMMS


class ConfigError(ValueError):
    """A config key is unknown, of the wrong type or out of range; the message is one line naming it."""


def knob(default: Any = None, check: Callable[[Any], bool] | None = None, allowed: str = "", *,
         factory: Callable[[], Any] | None = None):
    """A config field: its default, and a range check with the words for what is allowed."""
    meta = {"check": check, "allowed": allowed}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _positive(v):
    return v > 0


def _non_negative(v):
    return v >= 0


def _one_of(*options):
    return (lambda v: v in options), "one of " + ", ".join(repr(o) for o in options)


def _sharding_rules_ok(v) -> bool:
    """True, or a ConfigError naming the rule that `models.sharding.override_rules` refuses."""
    from agentfly_jax.models.sharding import override_rules  # models import jax; the config module does not

    try:
        override_rules(v)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.sharding_rules: {e}") from None
    return True


POSITIVE, NON_NEGATIVE = (_positive, "> 0"), (_non_negative, ">= 0")
PROBABILITY = (lambda v: 0.0 < v <= 1.0), "in (0, 1]"


# ============================================================================================= sections
@dataclasses.dataclass(frozen=True)
class EnvSection:
    """The environment plugin (agentfly_jax.envs.spec): its registered name or 'module:env_spec', and the
    options its `env_spec(**options)` takes. Empty name: tasks come from task.train_path/eval_path and the
    agent's tools/reward from agent.tools/agent.reward (a user's own task)."""

    name: str = ""
    options: dict = knob(factory=dict)


@dataclasses.dataclass(frozen=True)
class TaskSection:
    num_train: int = knob(0, *NON_NEGATIVE)  # rows of the train split (0: all)
    num_eval: int = knob(64, *NON_NEGATIVE)  # held-out rows (0: none)
    eval_split: str = "test"
    train_path: str = ""  # a user's JSON/JSONL dataset (when env.name is empty)
    eval_path: str = ""


@dataclasses.dataclass(frozen=True)
class TokenizerSection:
    """An HF tokenizer directory (`path`, e.g. the checkpoint's), or, when no path is given, a built one
    (`kind`: "env" the environment's own, "qwen2.5" the offline Qwen2.5 tokenizer)."""

    path: str = ""
    kind: str = knob("", *_one_of("", "env", "qwen2.5"))


@dataclasses.dataclass(frozen=True)
class VisionSection:
    """The vision tower of a random-initialised Qwen2.5-VL policy (`model.family="qwen2_5_vl"` without
    `model.hf_path`; a checkpoint brings its own). Its patch geometry is Qwen2.5-VL's (14-pixel patches, 2 frames
    deep, 2 x 2 patches merged into one token), the one the rollout's image processing cuts images into; its output
    size is the language model's `model.hidden_size`. Defaults: a tiny tower for plumbing runs."""

    depth: int = knob(2, *POSITIVE)
    hidden_size: int = knob(64, *POSITIVE)
    intermediate_size: int = knob(128, *POSITIVE)
    # the head dim (hidden_size / num_heads) must be a multiple of 4: the 2-D rotary embedding turns a quarter of
    # it with the patch's row and a quarter with its column
    num_heads: int = knob(2, *POSITIVE)
    # side of the attention windows in pixels (a multiple of 28, one merged token); blocks in
    # fullatt_block_indexes attend over the whole image instead
    window_size: int = knob(112, lambda v: v >= 28, ">= 28 (one merged token is 28 pixels)")
    fullatt_block_indexes: tuple[int, ...] = knob((1,), lambda v: all(i >= 0 for i in v), "block indexes >= 0")


OPTIMIZER_FUSED = ("off", "per_leaf", "stacked", "hybrid")  # config.optimizer.fused (state.py: make_optimizer)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    hf_path: str = ""  # start from this HF checkpoint (the fields below then come from it)
    # "qwen2_5_vl": a vision-language policy (Qwen2.5-VL: `vision` below, mRoPE); a checkpoint of
    # Qwen2_5_VLForConditionalGeneration at hf_path is one whatever this says
    family: str = knob("qwen2", *_one_of("qwen2", "llama", "qwen2_5_vl"))
    hidden_size: int = knob(128, *POSITIVE)
    intermediate_size: int = knob(384, *POSITIVE)
    num_layers: int = knob(2, *POSITIVE)
    num_heads: int = knob(4, *POSITIVE)
    num_kv_heads: int = knob(2, *POSITIVE)
    head_dim: int | None = knob(None, lambda v: v is None or v > 0, "None (hidden_size / num_heads) or > 0")
    vocab_size: int | None = None  # None: the tokenizer's size
    qkv_bias: bool = True
    tie_word_embeddings: bool = True
    max_position_embeddings: int = knob(4096, *POSITIVE)
    rope_theta: float = knob(10000.0, *POSITIVE)
    dtype: str = knob("float32", *_one_of("float32", "bfloat16", "float16"))
    # storage dtype of the trained parameters: fp32 master weights by default whatever the compute dtype
    # (mixed precision): Adam steps at RL learning rates are below bf16's resolution. None = `dtype`.
    param_dtype: str | None = knob("float32", *_one_of(None, "float32", "bfloat16", "float16"))
    remat: bool = False
    # each decoder layer on N independent groups of the rows, so one group's tensor-parallel collectives overlap
    # another's matrix products (models/config.py); 1: off
    layer_row_splits: int = knob(1, *POSITIVE)
    attention_impl: str = knob("auto", *_one_of("auto", "xla", "cudnn"))
    # cuDNN attention over packed rows: up to N segments a row (the padding's run counted) described to cuDNN as
    # starts and lengths instead of a dense [T, T] mask; a batch with a fuller row uses the mask (models/config.py).
    # 0: always the mask. 8 took the update step from 308 to 296 ms at Qwen2.5-3B on an H200 (docs/benchmarks.md)
    attention_segments: int = knob(8, *NON_NEGATIVE)
    # how XLA emits the matrix products of the update phase's programs (prepare, the RL and SFT steps) on a GPU:
    # "cublas" (library GEMMs, faster for the training step on an H200), "triton" (XLA's own Triton GEMM fusions,
    # XLA's default) or "triton_exhaustive" (those with every tiling tried by the autotuner: longer compilations).
    # The JAX sampler has its own (jax_sampler.gpu_gemm, docs/benchmarks.md). No effect off GPUs
    gpu_gemm: str = knob("cublas", *_one_of(*GPU_GEMMS))
    # LoRA: rank-r adapters on `lora_targets`, trained with the base frozen (0: full fine-tuning); weight sync
    # and the exported policy carry the merged weights
    lora_rank: int = knob(0, *NON_NEGATIVE)
    lora_alpha: float = knob(16.0, *POSITIVE)
    lora_targets: tuple[str, ...] = knob(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"),
                                         lambda v: len(v) > 0 and set(v) <= {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj"},
                                         "a non-empty subset of q_proj k_proj v_proj o_proj gate_proj up_proj "
                                         "down_proj")
    # family "qwen2_5_vl" only: the vision tower, and how mRoPE splits the head_dim / 2 rotary frequencies between
    # the temporal, height and width positions (None: a quarter temporal, the rest halved, e.g. Qwen2.5-VL's
    # (16, 24, 24) for head_dim 128)
    vision: VisionSection = knob(factory=VisionSection)
    mrope_section: tuple[int, int, int] | None = knob(None, lambda v: v is None or min(v) > 0,
                                                      "None or three positive sizes")


@dataclasses.dataclass(frozen=True)
class AgentSection:
    """Empty/None fields come from the environment spec."""

    type: str = ""  # "tool_calling" | "react" | "code" | "package.module:AgentClass"
    tools: tuple[str, ...] = ()  # registered tool names or "package.module:tool"
    reward: str = ""  # registered reward name or "package.module:reward"
    system_prompt: str | None = None
    # a chain with reward >= this counts as a success (success/rate, eval/success); None: the environment's
    success_threshold: float | None = knob(None, lambda v: v is None or math.isfinite(v),
                                           "None (the environment's) or a finite number")
    max_turns: int | None = knob(None, lambda v: v is None or v >= 1, ">= 1")
    max_new_tokens: int = knob(512, *POSITIVE)
    max_context_tokens: int = knob(4096, *POSITIVE)
    max_observation_chars: int | None = knob(None, lambda v: v is None or v >= 1, "None (no limit) or >= 1")
    temperature: float = knob(1.0, *NON_NEGATIVE)
    top_p: float = knob(1.0, *PROBABILITY)
    top_k: int = -1
    parallel_tool_calls: bool = True
    tool_timeout: float | None = knob(None, lambda v: v is None or v > 0, "None or positive seconds")
    # seconds a reward without its own @reward(timeout=) may take (None: 300 s, inf: no limit)
    reward_timeout: float | None = knob(None, lambda v: v is None or v > 0, "None or positive seconds")
    max_concurrency: int | None = knob(None, lambda v: v is None or v >= 1, "None (no limit) or >= 1")
    stop_token_ids: tuple[int, ...] | None = knob(  # None: the tokenizer's end-of-turn tokens
        None, lambda v: v is None or all(i >= 0 for i in v), "None or token ids >= 0")
    # vision-language policies: the pixel range images are resized into (None: the Qwen2-VL processor's 56*56 and
    # 28*28*1280); an image takes pixels / 784 tokens of max_context_tokens
    min_pixels: int | None = knob(None, lambda v: v is None or v >= 1, "None or >= 1")
    max_pixels: int | None = knob(None, lambda v: v is None or v >= 1, "None or >= 1")


@dataclasses.dataclass(frozen=True)
class JaxSamplerSection:
    max_slots: int = knob(64, *POSITIVE)
    # tokens a sequence holds, prompt included; None: config.agent.max_context_tokens (a chain's conversation never
    # grows past it, so a smaller value is refused)
    max_len: int | None = knob(None, lambda v: v is None or v >= 2, "None (config.agent.max_context_tokens) or >= 2")
    steps_per_call: int = knob(8, *POSITIVE)
    prefill_tokens: int = knob(8192, *POSITIVE)
    min_bucket: int = knob(16, *POSITIVE)
    # vision-language policies: image patches per prompt pass (the vision tower attends densely over a pass's
    # patches), and the smallest patch bucket (a power of two) of a pass with images
    prefill_patches: int = knob(8192, *POSITIVE)
    min_patch_bucket: int = knob(256, lambda v: v > 0 and v & (v - 1) == 0, "a power of two")
    # prefix caching (docs/generation.md): a finished sequence's KV stays in its slot until a new sequence needs the
    # slot, and a prompt that starts with its tokens (a chain's next turn) computes only the rest; identical
    # prompts admitted together (a GRPO group's first turn) share one prompt pass. Outputs equal those without it;
    # weight syncs drop the cached KV. Prompts with images are never cached. prefix_min_tokens: the shortest shared
    # prefix worth reusing
    prefix_caching: bool = True
    prefix_min_tokens: int = knob(16, *POSITIVE)
    # where the Gumbel noise of sampling comes from: "hash" (counter-based, fused into the sampling kernel) or
    # "threefry" (jax.random: a [slots, vocab] draw every step); both are seeded per sequence
    sampling_noise: str = knob("hash", *_one_of("hash", "threefry"))
    # attention of decode steps over the KV cache: "auto" = "xla" (the einsum over a window bucket; on an H200 as
    # fast as the Pallas kernel at 64 slots and faster at 256), "pallas" (jax's Pallas GPU decode kernel, reading
    # each slot's keys up to its length; one device), "pallas_interpret" (the same, interpreted: CPU tests)
    decode_attention: str = knob("auto", *_one_of("auto", "xla", "pallas", "pallas_interpret"))
    # serve each layer's q/k/v projections as one GEMM and gate/up as another (weights joined at every sync):
    # "auto" = "on" on one device, "off" under tensor_parallel > 1 (where "on" is refused)
    fuse_projections: str = knob("auto", *_one_of("auto", "on", "off"))
    # how the sampler's programs compile their matrix products on a GPU: "triton" (XLA's default), "cublas" or
    # "triton_exhaustive" (every Triton tiling tried: longer compilations, decode 8% faster at 64 slots on an H200)
    # (models/config.py: gpu_compiler_options; the update's own is config.model.gpu_gemm)
    gpu_gemm: str = knob("triton", *_one_of(*GPU_GEMMS))
    # the sampler on the last device and the training mesh on the others (>= 2 devices): generation and
    # updates then never queue behind each other on one device (asynchronous training on a GPU box)
    separate_device: bool = False
    # the sampler split over this many of the process's devices (tensor parallel: heads, MLP, vocab and the KV
    # cache's kv heads; docs/generation.md): the first ones, shared with the training mesh, or with
    # separate_device=True the last ones, the training mesh on the others (>= tensor_parallel + 1 devices)
    tensor_parallel: int = knob(1, *POSITIVE)


@dataclasses.dataclass(frozen=True)
class VLLMSection:
    urls: tuple[str, ...] = ()
    launch: bool = False  # start num_servers local servers on the initial policy
    num_servers: int = knob(1, *POSITIVE)
    server_args: tuple[str, ...] = ()
    weight_sync: str = knob("memory", *_one_of("memory", "file"))
    weight_dir: str = ""  # weight_sync="file": a directory the servers can read ("": a local temp dir)
    served_model_name: str | None = None
    request_timeout: float = knob(600.0, *POSITIVE)
    update_timeout: float = knob(900.0, *POSITIVE)
    max_retries: int = knob(3, *NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warmup + decay schedule."""

    learning_rate: float = knob(1e-6, *POSITIVE)
    warmup_steps: int = knob(0, *NON_NEGATIVE)
    decay_steps: int = knob(0, *NON_NEGATIVE)  # 0: constant after warmup
    schedule: str = knob("constant", *_one_of("constant", "cosine", "linear"))
    end_lr_ratio: float = knob(0.0, lambda v: 0 <= v <= 1, "in [0, 1] (the decay's end, a fraction of learning_rate)")
    weight_decay: float = knob(0.0, *NON_NEGATIVE)
    b1: float = knob(0.9, lambda v: 0 <= v < 1, "in [0, 1)")
    b2: float = knob(0.999, lambda v: 0 <= v < 1, "in [0, 1)")
    eps: float = knob(1e-8, *POSITIVE)
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    # how the clip + AdamW step is computed (the same maths; trainer/fused_adamw.py): "off" optax's
    # chain(clip_by_global_norm, adamw); the fused fp32 pass "per_leaf" leaf by leaf, "stacked" on same-role leaves
    # stacked across layers (moments kept stacked), "hybrid" stacking only leaves of <= 2**18 values (the default:
    # the fastest on an H200, docs/benchmarks.md). The optimiser state's layout follows it: a checkpoint resumes
    # only under the setting it was saved with
    fused: str = knob("hybrid", *_one_of(*OPTIMIZER_FUSED))
    # what `policy/update_norm` (and sft/, critic/) measures: "applied" the change of the stored parameters (with
    # fp32 parameters the update itself up to rounding; with bf16 ones what the step really changed), "exact" the
    # fp32 update before rounding, "off" not computed nor logged. Each is a pass over the parameters that XLA does
    # not fuse into the optimiser's: at the Qwen2.5-3B shape on an H200 (bf16) the fused step took 31.0 ms with
    # "exact", 25.6 with "applied", 20.4 with "off" (docs/benchmarks.md)
    update_norm: str = knob("applied", *_one_of("applied", "exact", "off"))


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised warm start: `stages` ((steps, expert_fraction), ...) of the environment's demonstrations,
    or `steps` on `data_path` (JSONL of {"messages": [...]}), or none (steps 0, no stages)."""

    stages: tuple[tuple[int, float], ...] = knob((), lambda v: all(len(s) == 2 and s[0] >= 1 and 0 <= s[1] <= 1
                                                                  for s in v),
                                                   "(steps >= 1, expert fraction in [0, 1]) pairs")
    steps: int = knob(0, *NON_NEGATIVE)
    expert_fraction: float | None = knob(None, lambda v: v is None or 0 <= v <= 1, "in [0, 1]")  # with steps
    batch_size: int = knob(16, *POSITIVE)
    data_path: str = ""
    # demonstrations longer than the largest seq bucket (found when a step first draws them: each is encoded then):
    # False leaves them out (counted in sft/stage*_dropped_too_long at the stage's end), True trains on their first
    # tokens (the prompt and the turns that fit)
    cut_long: bool = False
    optimizer: OptimizerConfig = knob(factory=lambda: OptimizerConfig(learning_rate=1e-5))


@dataclasses.dataclass(frozen=True)
class RLSection:
    steps: int = knob(100, *NON_NEGATIVE)
    tasks_per_step: int = knob(8, *POSITIVE)
    chains_per_task: int = knob(8, *POSITIVE)
    ppo_epochs: int = knob(1, *POSITIVE)
    mini_batches: int = knob(1, *POSITIVE)
    micro_batches: int = knob(1, *POSITIVE)
    # where the old log-probabilities (the policy before this update: PPO's ratio, the IS correction) come from.
    # "auto": when the update is one optimiser step (ppo_epochs 1, mini_batches 1) and no KL enters the reward,
    # from the train step's own forward pass (the same parameters, so the ratio is exactly 1 and no gradient flows
    # through them): one forward pass of the policy less per step. "prepare": always from a forward pass of their
    # own before the update (the same values up to rounding; what every run did before this knob).
    old_logprobs: str = knob("auto", *_one_of("auto", "prepare"))
    # upper bound on rows x row length of one micro-batch: a step with more tokens is split into more
    # micro-batches (counts rounded to 1, 2, 3, 4, 6, 8, 12, ... so shapes repeat). None: `micro_batches` only.
    micro_batch_tokens: int | None = knob(65536, lambda v: v is None or v > 0, "> 0")
    # DAPO dynamic sampling: groups whose chains all got the same reward (no signal) are dropped and more tasks
    # (tasks_per_step a round, at most `dynamic_sampling_max_rounds` extra rounds) are rolled out until
    # tasks_per_step groups with signal are in hand; short of that, dropped groups fill the batch
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = knob(3, *NON_NEGATIVE)
    # DAPO overlong shaping: reward += factor * overlong_penalty(sampled tokens of the chain, max_len, buffer_len)
    # (0 up to max_len - buffer_len, then down to -factor at max_len); max_len defaults to the most tokens a
    # chain can sample (agent.max_new_tokens * agent.max_turns). None: off.
    overlong_buffer_len: int | None = knob(None, lambda v: v is None or v > 0, "> 0")
    overlong_max_len: int | None = knob(None, lambda v: v is None or v > 0, "> 0")
    overlong_penalty_factor: float | None = knob(None, lambda v: v is None or v > 0, "> 0")
    # asynchronous off-policy training (trainer/async_rollouts.py): step s's rollout starts once the served policy
    # is at version >= s - max_staleness and runs while earlier steps update, so no trajectory trains a policy
    # more than max_staleness versions newer than its oldest token. 0: the synchronous loop. Needs loss.is_cap
    # (the behaviour-policy correction of decoupled PPO).
    max_staleness: int = knob(0, *NON_NEGATIVE)
    # at a weight sync, sequences in flight go on with the new weights (each token records its version) instead
    # of finishing on the old ones first; with max_staleness > 0 only
    partial_rollouts: bool = False


@dataclasses.dataclass(frozen=True)
class CriticSection:
    """The value model of recipes that train one (ppo); other recipes build no critic and never read this."""

    optimizer: OptimizerConfig = knob(factory=lambda: OptimizerConfig(learning_rate=1e-5))
    value_clip_eps: float | None = 0.2
    value_coef: float = knob(1.0, *POSITIVE)


@dataclasses.dataclass(frozen=True)
class LossSection:
    """Policy-loss knobs; None = the recipe's default (a set knob the recipe ignores is refused)."""

    aggregation: str | None = knob(None, *_one_of(None, *AGGREGATION_MODES))
    norm_len: int | None = knob(None, lambda v: v is None or v > 0, "> 0")
    clip_eps: float | None = knob(None, lambda v: v is None or v > 0, "> 0")
    clip_eps_high: float | None = knob(None, lambda v: v is None or v > 0, "> 0")
    dual_clip: float | None = knob(None, lambda v: v is None or v > 1, "> 1")
    kl_loss_coef: float | None = knob(None, lambda v: v is None or v >= 0, ">= 0")
    kl_loss_estimator: str | None = None
    entropy_coef: float | None = None
    temperature: float | None = knob(None, lambda v: v is None or v > 0, "> 0")
    # positions per chunk of the fp32 log-softmax (only [rows, chunk, vocab] logits exist at once, forward and
    # backward); None: the whole sequence at once (a real vocabulary then needs [rows, length, vocab] fp32)
    logprob_chunk: int | None = knob(256, lambda v: v is None or v > 0, "> 0")
    is_cap: float | None = knob(None, lambda v: v is None or v > 0, "> 0")


@dataclasses.dataclass(frozen=True)
class AdvantageSection:
    """Advantage-estimator knobs; None = the recipe's default (a set knob the recipe ignores is refused)."""

    normalize_std: bool | None = None
    eps: float | None = None
    gamma: float | None = knob(None, lambda v: v is None or 0 <= v <= 1, "in [0, 1]")
    lam: float | None = knob(None, lambda v: v is None or 0 <= v <= 1, "in [0, 1]")
    kl_in_reward_coef: float | None = knob(None, lambda v: v is None or v >= 0, ">= 0")
    kl_in_reward_estimator: str | None = None
    whiten: bool | None = None  # GAE (ppo): whiten the advantages over the batch's action tokens


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = knob(1, *POSITIVE)
    fsdp: int = knob(-1, lambda v: v == -1 or v >= 1, ">= 1, or -1 (every remaining device)")
    tensor: int = knob(1, *POSITIVE)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = knob(20, *NON_NEGATIVE)  # 0: only the final one
    keep: int = knob(2, *POSITIVE)


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out success: a headline pass at (temperature, top_p; temperature 0 is greedy) with num_chains per
    task, and `sampled_chains` > 0 adds plain temperature-1 sampling beside it (eval/*_sampled)."""

    every: int = knob(20, *NON_NEGATIVE)
    num_tasks: int = knob(64, *NON_NEGATIVE)
    num_chains: int = knob(1, *POSITIVE)
    temperature: float = knob(1.0, *NON_NEGATIVE)
    top_p: float = knob(1.0, *PROBABILITY)
    sampled_chains: int = knob(0, *NON_NEGATIVE)
    before_sft: bool = True  # with an SFT warm start, also evaluate before it (eval_before_sft/* scalars)


def _host_port(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return v == "" or (bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536)


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Several processes (a TPU pod's hosts, GPU nodes) in one run through jax.distributed, started before anything
    touches a device (trainer/distributed.py; walk-through: docs/tpu.md). All unset: one process, unless the process
    runs where jax.distributed.initialize() finds its values itself (a TPU slice of several hosts, a SLURM step or
    an Open MPI job of several tasks); a value set here wins over the detected one. Plain ssh launches set all
    three; num_processes=1 forces one process (with a coordinator_address: a jax.distributed cluster of one
    process, whose collectives, gloo's on CPU, add in the same order as those of several processes). Every process
    must start with the same config and code (compared at start); this section may differ between processes
    (process_id does) and is left out of that comparison.

    When a process fails (docs/tpu.md "When a process fails"): one that dies (killed, out of memory, its host
    gone) or freezes sends no heartbeat, and after `heartbeat_timeout` s every other process stops with an error
    naming it; one whose code raises tells the others at once, and they stop with its reason. A process stuck
    inside a device collective is ended `heartbeat_timeout` s after that, so every process is gone within about
    2 x heartbeat_timeout. A process that still sends heartbeats but does not arrive at a host exchange within
    `exchange_timeout` s (it hangs in its own code) is named by those waiting for it. Restart every process with
    the same command and resume=True to continue from the last checkpoint."""

    coordinator_address: str = knob("", _host_port, "'' (auto-detect) or 'host:port' of process 0, reachable "
                                                    "from every process")
    num_processes: int | None = knob(None, lambda v: v is None or v >= 1, "None (auto-detect) or >= 1")
    process_id: int | None = knob(None, lambda v: v is None or v >= 0, "None (auto-detect) or >= 0")
    # seconds to wait for every process: to connect, then to publish its config/code digests
    initialization_timeout: int = knob(300, *POSITIVE)
    # seconds without a heartbeat from a process (dead, killed, out of memory, frozen, its host or network gone)
    # after which every other process stops with an error naming it
    heartbeat_timeout: int = knob(120, *POSITIVE)
    # seconds a process waits at a host exchange (a step's counts, rewards, scalars) for another process that
    # still sends heartbeats: its share of the step's rollouts may take longer, or it hangs in its own code
    exchange_timeout: int = knob(3600, *POSITIVE)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = knob(0, *NON_NEGATIVE)  # numpy's generators refuse negative seeds
    workdir: str = "runs/experiment"
    algorithm: str = "grpo"  # a registered recipe (agentfly_jax.algorithms.recipes)
    resume: bool = False
    progress: bool = True
    log_every: int = knob(1, *POSITIVE)
    seq_buckets: tuple[int, ...] = knob((1024, 2048, 4096), lambda v: len(v) > 0 and min(v) > 0,
                                        "a non-empty tuple of positive lengths")
    row_bucket: int = knob(8, *POSITIVE)  # packed row counts round up to a multiple of this
    # XLA's persistent compilation cache (agentfly-train): a program compiled once is loaded, not compiled, by later
    # runs with the same shapes, code and flags (restarts, resume=True, config sweeps); "" turns it off. Least
    # recently used programs are evicted beyond compilation_cache_max_gb. The environment's JAX_COMPILATION_CACHE_DIR,
    # where set, is used instead, as JAX's variables set it up (JAX_COMPILATION_CACHE_MAX_SIZE; unbounded by default).
    # Trusted: do not point it at a directory others can write to.
    compilation_cache_dir: str = "~/.cache/agentfly_jax/xla"
    compilation_cache_max_gb: float = knob(10.0, *POSITIVE)
    # an optimiser step with a non-finite loss/gradient is skipped (counted as */nonfinite_updates); this many
    # SFT or RL steps in a row with such a skip stop the run with an error
    max_nonfinite_steps: int = knob(3, *POSITIVE)
    backend: str = knob("jax", *_one_of("jax", "vllm"))
    chat_template: str = ""  # "": the tokenizer's own; a template name such as "qwen2.5"
    # (logical name, mesh axes) pairs replacing agentfly_jax.models.sharding.DEFAULT_RULES by name (a name left
    # out keeps its default; None replicates), e.g. (("act_residual_batch", ("data", "fsdp", "tensor")),):
    # sequence parallelism for tensor-parallel meshes
    sharding_rules: tuple = knob((), _sharding_rules_ok, "(logical name, mesh axes) pairs, the axes None, one of "
                                 "'data', 'fsdp', 'tensor' or a sequence of them")
    env: EnvSection = knob(factory=EnvSection)
    task: TaskSection = knob(factory=TaskSection)
    tokenizer: TokenizerSection = knob(factory=TokenizerSection)
    model: ModelSection = knob(factory=ModelSection)
    agent: AgentSection = knob(factory=AgentSection)
    envs: dict = knob(factory=dict)  # extra resource-manager pools {name: pool config} (beyond the env's)
    jax_sampler: JaxSamplerSection = knob(factory=JaxSamplerSection)
    vllm: VLLMSection = knob(factory=VLLMSection)
    sft: SFTSection = knob(factory=SFTSection)
    rl: RLSection = knob(factory=RLSection)
    optimizer: OptimizerConfig = knob(factory=OptimizerConfig)
    critic: CriticSection = knob(factory=CriticSection)
    loss: LossSection = knob(factory=LossSection)
    advantage: AdvantageSection = knob(factory=AdvantageSection)
    mesh: MeshSection = knob(factory=MeshSection)
    checkpoint: CheckpointSection = knob(factory=CheckpointSection)
    eval: EvalSection = knob(factory=EvalSection)
    distributed: DistributedSection = knob(factory=DistributedSection)

    @classmethod
    def build(cls, config: Mapping[str, Any]) -> "TrainConfig":
        """Typed, validated config from an experiment's ConfigDict (or dict); ConfigError on the first
        problem. Cross-section rules (recipe knobs, task source, backend) are checked here too."""
        built = build_section(cls, config, "config")
        built._check()
        return built

    def _check(self) -> None:
        try:
            self.resolved_algorithm()
        except ValueError as e:
            message = str(e)
            if message.startswith("unknown algorithm"):
                message = f"config.algorithm: {message}"
            raise ConfigError(message) from None
        if not self.env.name:
            if not self.task.train_path:
                raise ConfigError("config.env.name is empty and config.task.train_path is empty: name an "
                                  "environment (e.g. env.name='arithmetic') or give your own JSONL tasks")
            if not self.agent.reward:
                raise ConfigError("a task from files (config.task.train_path) needs config.agent.reward "
                                  "('package.module:reward_fn' or a registered reward name)")
            if self.task.num_eval and not self.task.eval_path:
                raise ConfigError("config.task.num_eval > 0 needs config.task.eval_path (held-out JSONL tasks); "
                                  "or set config.task.num_eval=0 and config.eval.num_tasks=0")
            if self.env.options:
                raise ConfigError(f"config.env.options {sorted(self.env.options)} have no effect without "
                                  "config.env.name (a task from files has no environment plugin)")
        else:
            for key in ("train_path", "eval_path"):
                if getattr(self.task, key):
                    raise ConfigError(f"config.task.{key} has no effect with config.env.name={self.env.name!r} "
                                      "(its tasks come from the environment): unset one of them")
        if self.eval.num_tasks > self.task.num_eval:
            raise ConfigError(f"config.eval.num_tasks={self.eval.num_tasks} but config.task.num_eval="
                              f"{self.task.num_eval} held-out rows are loaded: lower eval.num_tasks or raise num_eval")
        for name, opt in (("optimizer", self.optimizer), ("sft.optimizer", self.sft.optimizer),
                          ("critic.optimizer", self.critic.optimizer)):
            if opt.schedule == "constant" and (opt.decay_steps or opt.end_lr_ratio):
                raise ConfigError(f"config.{name}.decay_steps / end_lr_ratio have no effect with schedule='constant': "
                                  f"set config.{name}.schedule='cosine' or 'linear', or unset them")
            if opt.end_lr_ratio and not opt.decay_steps:
                raise ConfigError(f"config.{name}.end_lr_ratio has no effect without config.{name}.decay_steps > 0")
        if self.backend == "vllm":
            if self.vllm.launch and self.vllm.urls:
                raise ConfigError("config.vllm.launch=True starts its own servers: leave config.vllm.urls empty")
            if not self.vllm.launch and not self.vllm.urls:
                raise ConfigError("config.backend='vllm' needs config.vllm.urls (e.g. "
                                  "\"('http://127.0.0.1:8000',)\") or config.vllm.launch=True")
        if not self.tokenizer.path and not self.tokenizer.kind:
            raise ConfigError("set config.tokenizer.path (an HF tokenizer directory) or config.tokenizer.kind "
                              "('env': the environment's own, 'qwen2.5': the offline Qwen2.5 tokenizer)")
        if self.sft.steps and self.sft.stages:
            raise ConfigError("set config.sft.steps (with data_path) or config.sft.stages, not both")
        if self.sft.stages and self.sft.data_path:
            raise ConfigError("config.sft.stages generate the environment's demonstrations; config.sft.data_path "
                              "is read for config.sft.steps instead")
        if self.sft.steps and not self.sft.data_path and not self.env.name:
            raise ConfigError("config.sft.steps > 0 needs config.sft.data_path (JSONL of {'messages': [...]}) "
                              "or an environment with demonstrations (config.sft.stages)")
        if self.sft.data_path and not self.sft.steps:
            raise ConfigError("config.sft.data_path is set but config.sft.steps=0: set the number of SFT steps")
        if self.sft.expert_fraction is not None and (self.sft.stages or self.sft.data_path or not self.sft.steps):
            raise ConfigError("config.sft.expert_fraction only applies to config.sft.steps on the environment's "
                              "demonstrations (stages carry their own fractions; data_path has none): unset it")
        if self.rl.tasks_per_step * self.rl.chains_per_task < self.rl.mini_batches:
            raise ConfigError(f"config.rl.mini_batches={self.rl.mini_batches} is more than the "
                              f"{self.rl.tasks_per_step * self.rl.chains_per_task} chains of a step")
        from agentfly_jax.algorithms.recipes import get_recipe

        if self.rl.chains_per_task == 1 and get_recipe(self.algorithm).group_baseline:
            raise ConfigError(f"config.rl.chains_per_task=1 with algorithm {self.algorithm!r}: its baseline is the "
                              "task's group of chains, and a group of one gets advantage 0 (nothing is learned); "
                              "use chains_per_task >= 2, or an algorithm without a group baseline "
                              "('reinforce_pp', 'ppo')")
        if (self.agent.temperature == 0 and self.rl.steps and self.rl.chains_per_task > 1
                and get_recipe(self.algorithm).group_baseline):
            raise ConfigError(f"config.agent.temperature=0 samples greedily, so the {self.rl.chains_per_task} chains "
                              f"of a task are the same and algorithm {self.algorithm!r} (a group baseline) gets "
                              "advantage 0 everywhere: train at temperature > 0 (e.g. 1.0); config.eval.temperature "
                              "sets the evaluation's")
        if self.rl.dynamic_sampling and self.rl.chains_per_task == 1:
            raise ConfigError("config.rl.dynamic_sampling=True with config.rl.chains_per_task=1: every group of one "
                              "has equal rewards and would be dropped; use chains_per_task >= 2")
        if self.rl.max_staleness and self.loss.is_cap is None:
            raise ConfigError(f"config.rl.max_staleness={self.rl.max_staleness} trains on trajectories sampled by "
                              "older policies: set config.loss.is_cap (e.g. 2.0), the cap of the behaviour-policy "
                              "importance weights that correct for it (decoupled PPO), or use max_staleness=0")
        if self.jax_sampler.separate_device and self.backend != "jax":
            raise ConfigError("config.jax_sampler.separate_device=True is for the JAX sampler: with "
                              f"config.backend={self.backend!r} generation runs on the servers; unset it")
        if self.jax_sampler.tensor_parallel > 1 and self.backend != "jax":
            raise ConfigError(f"config.jax_sampler.tensor_parallel={self.jax_sampler.tensor_parallel} is for the JAX "
                              f"sampler: with config.backend={self.backend!r} generation runs on the servers (their "
                              "own --tensor-parallel-size in config.vllm.server_args); set it to 1")
        if self.jax_sampler.tensor_parallel > 1 and self.jax_sampler.fuse_projections == "on":
            raise ConfigError("config.jax_sampler.fuse_projections='on' runs on one device; with "
                              f"config.jax_sampler.tensor_parallel={self.jax_sampler.tensor_parallel} set it to "
                              "'auto' or 'off'")
        if self.jax_sampler.tensor_parallel > 1 and self.jax_sampler.decode_attention.startswith("pallas"):
            raise ConfigError(f"config.jax_sampler.decode_attention={self.jax_sampler.decode_attention!r} runs on one "
                              "device; with config.jax_sampler.tensor_parallel > 1 use 'auto' or 'xla'")
        if self.rl.partial_rollouts and not self.rl.max_staleness:
            raise ConfigError("config.rl.partial_rollouts=True has no effect with config.rl.max_staleness=0 (the "
                              "synchronous loop syncs weights when no sequence is in flight): set max_staleness "
                              ">= 1 or unset partial_rollouts")
        if not self.rl.overlong_buffer_len:
            for key in ("overlong_max_len", "overlong_penalty_factor"):
                if getattr(self.rl, key) is not None:
                    raise ConfigError(f"config.rl.{key} has no effect without config.rl.overlong_buffer_len "
                                      "(the length over which the penalty ramps up): set it or unset this")
        elif self.rl.overlong_buffer_len > self.overlong_max_len():
            raise ConfigError(f"config.rl.overlong_buffer_len={self.rl.overlong_buffer_len} is longer than the "
                              f"overlong max_len {self.overlong_max_len()} (config.rl.overlong_max_len, default "
                              "agent.max_new_tokens * agent.max_turns): lower it")
        dist = self.distributed
        if dist.num_processes is not None and dist.process_id is not None and dist.process_id >= dist.num_processes:
            raise ConfigError(f"config.distributed.process_id={dist.process_id} with num_processes="
                              f"{dist.num_processes}: process ids run from 0 to num_processes - 1")
        self._check_model()
        longest = self.agent.max_context_tokens
        if longest > max(self.seq_buckets):
            raise ConfigError(f"config.agent.max_context_tokens={longest} does not fit the largest of "
                              f"config.seq_buckets={self.seq_buckets}: raise the buckets or lower the context")
        if (self.backend == "jax" and self.jax_sampler.max_len is not None
                and self.jax_sampler.max_len < self.agent.max_context_tokens):
            raise ConfigError(f"config.jax_sampler.max_len={self.jax_sampler.max_len} is shorter than "
                              f"config.agent.max_context_tokens={self.agent.max_context_tokens}: a chain's "
                              "conversation grows up to the context, and its later turns would not fit the sampler; "
                              "raise max_len, lower the context, or leave max_len None (= the context)")

    def _check_model(self) -> None:
        """The random-initialised policy's shape (a checkpoint at model.hf_path brings its own)."""
        m = self.model
        if m.hf_path:
            return
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"config.model.num_kv_heads={m.num_kv_heads} must divide num_heads={m.num_heads} "
                              "(grouped-query attention: each kv head serves the same number of query heads)")
        if m.head_dim is None and m.hidden_size % m.num_heads:
            raise ConfigError(f"config.model.hidden_size={m.hidden_size} is not a multiple of num_heads={m.num_heads}: "
                              "change one, or set config.model.head_dim")
        if m.family != "qwen2_5_vl":
            if m.mrope_section is not None:
                raise ConfigError(f"config.model.mrope_section applies to family 'qwen2_5_vl' (a vision-language "
                                  f"policy) only; config.model.family={m.family!r}: unset it")
            return
        heads = m.num_heads
        if m.hidden_size % heads or (m.head_dim is not None and m.head_dim != m.hidden_size // heads):
            raise ConfigError(f"config.model.hidden_size={m.hidden_size} with num_heads={heads} and head_dim="
                              f"{m.head_dim}: Qwen2.5-VL's head dim is hidden_size / num_heads (a whole number); "
                              "leave head_dim unset")
        if not m.qkv_bias:
            raise ConfigError("config.model.qkv_bias=False: Qwen2.5-VL's language model always has qkv biases; "
                              "set it to True")
        half = m.hidden_size // heads // 2
        if m.mrope_section is not None and sum(m.mrope_section) != half:
            raise ConfigError(f"config.model.mrope_section={m.mrope_section} must sum to head_dim / 2 = {half}")
        v = m.vision
        if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
            raise ConfigError(f"config.model.vision.hidden_size={v.hidden_size} with num_heads={v.num_heads}: the "
                              "head dim (hidden_size / num_heads) must be a whole multiple of 4")
        if any(i >= v.depth for i in v.fullatt_block_indexes):
            raise ConfigError(f"config.model.vision.fullatt_block_indexes={v.fullatt_block_indexes} name blocks "
                              f"past the tower's depth={v.depth} (blocks are 0..{v.depth - 1})")
        if self.resolved_algorithm().recipe.needs_critic:
            raise ConfigError(f"config.algorithm={self.algorithm!r} trains a critic, which would not see the images "
                              "of a vision-language policy (config.model.family='qwen2_5_vl'): use a critic-free "
                              "algorithm (grpo, rloo, reinforce_pp, ...)")

    def overlong_max_len(self) -> int:
        """The length at which DAPO's overlong penalty reaches its full size (sampled tokens of a chain)."""
        return self.rl.overlong_max_len or self.agent.max_new_tokens * self.agent.max_turns

    def resolved_algorithm(self):
        """The recipe of `algorithm` with this config's advantage/loss knobs decided (RecipeError if one does
        not fit). Dr.GRPO's horizon defaults to the agent's context length."""
        from agentfly_jax.algorithms.recipes import get_recipe

        recipe = get_recipe(self.algorithm)
        loss = dataclasses.asdict(self.loss)
        resolved = recipe.resolve(dataclasses.asdict(self.advantage), loss)
        if resolved.aggregation == "seq-mean-token-sum-norm" and resolved.norm_len is None:
            resolved = dataclasses.replace(resolved, norm_len=self.agent.max_context_tokens)
        one_step = self.rl.ppo_epochs == 1 and self.rl.mini_batches == 1
        # a KL term in the reward (only recipes that take one accept the coefficient) is computed by prepare from
        # the old log-probs
        if self.rl.old_logprobs == "auto" and one_step and not resolved.kl_in_reward_coef:
            resolved = dataclasses.replace(resolved, old_logprobs_in_step=True)
        return resolved


# ============================================================================================= building
def _plain(value):
    if isinstance(value, ml_collections.ConfigDict):
        return value.to_dict()
    if isinstance(value, config_dict.FieldReference):
        return value.get()
    return value


def build_section(cls, mapping: Mapping[str, Any] | None, where: str):
    """`cls(**mapping)` with every field coerced to its annotated type and range-checked."""
    mapping = _plain(mapping)
    if mapping is None:
        mapping = {}
    if dataclasses.is_dataclass(mapping):  # an instance is checked like its fields would be
        if not isinstance(mapping, cls):
            raise ConfigError(f"{where}: expected {cls.__name__}, got {type(mapping).__name__}")
        mapping = {f.name: getattr(mapping, f.name) for f in dataclasses.fields(mapping)}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where}: expected a section (mapping of keys), got {type(mapping).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in mapping:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}.{key}: unknown key{hint}; {where} has: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        key = f"{where}.{name}"
        if name in mapping:
            value = _coerce(mapping[name], hints[name], key)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()
        check, allowed = f.metadata.get("check"), f.metadata.get("allowed", "")
        if check is not None and not check(value):
            raise ConfigError(f"{key}={value!r} is out of range; allowed: {allowed}")
        values[name] = value
    return cls(**values)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, where: str):
    value = _plain(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        return _coerce(value, arms[0], where)
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected True or False")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r}: expected a string")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}={value!r}: expected a mapping")
        return {k: _plain(v) for k, v in value.items()}
    if tp is tuple or origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r}: expected a tuple, e.g. \"(1, 2)\" on the command line")
        if not args:
            return tuple(_plain(v) for v in value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}={value!r}: expected {len(args)} items "
                              f"({', '.join(_type_name(a) for a in args)})")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    raise TypeError(f"{where}: config type {tp!r} is not supported")  # a bug in this module, not the user's


# ====================================================================================== default ConfigDict
def default_config() -> ml_collections.ConfigDict:
    """Every key of TrainConfig at its default, as a ConfigDict; unset (None) keys are placeholders of their
    type, so the command line can set them."""
    return _to_config_dict(TrainConfig())


def _to_config_dict(section) -> ml_collections.ConfigDict:
    out = ml_collections.ConfigDict()
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _to_config_dict(value)
        elif isinstance(value, dict):
            out[f.name] = ml_collections.ConfigDict(value)
        elif value is None:
            arms = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            arm = arms[0] if arms else object
            out[f.name] = config_dict.placeholder(typing.get_origin(arm) or arm)  # tuple[int, ...] -> tuple
        elif type(None) in typing.get_args(hints[f.name]):  # optional with a default: may be set to None
            arm = next(a for a in typing.get_args(hints[f.name]) if a is not type(None))
            out[f.name] = config_dict.FieldReference(value, field_type=typing.get_origin(arm) or arm)
        else:
            out[f.name] = value
    return out
