"""Model configuration shared by the Flax decoder, the HF checkpoint I/O and the sharding rules."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# HF `architectures` entry -> our family name. Both families share one decoder; they differ in defaults
# (qkv bias, tied embeddings, rope scaling) that live in the config, not in code paths.
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_FAMILY_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_ROPE_TYPES = ("default", "linear", "llama3")

# Keys of an HF config.json that we interpret; everything else is carried through `extra` unchanged so a
# saved checkpoint keeps e.g. bos/eos token ids.
_INTERPRETED_KEYS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "hidden_act", "use_sliding_window", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "layer_types", "max_window_layers", "sliding_window", "attention_dropout", "pretraining_tp",
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(dtype: Any):
    """Accepts a jnp dtype or its name ('float32', 'bfloat16')."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (Qwen2/Qwen2.5 and Llama 3 families).

    `dtype` is the compute dtype, `param_dtype` the storage dtype of the parameters.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    family: str = "qwen2"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False  # recompute layer activations in the backward pass (saves memory)
    # "auto": cuDNN fused attention on GPU in bf16/fp16, else "xla" (einsum, fp32 softmax, exact in fp32)
    attention_impl: str = "auto"
    # LoRA (models/lora.py): rank-r adapters beside the kernels of `lora_targets`, scaled by alpha / r; 0: none
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    extra: dict = dataclasses.field(default_factory=dict)  # HF config keys carried through unchanged

    def __post_init__(self):
        if self.family not in _FAMILY_TO_ARCH:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {sorted(_FAMILY_TO_ARCH)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} (grouped-query attention)")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                             "set head_dim explicitly")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {_ROPE_TYPES}")
        if self.attention_impl not in ("auto", "xla", "cudnn"):
            raise ValueError(f"attention_impl={self.attention_impl!r}; expected 'auto', 'xla' or 'cudnn'")
        if self.lora_rank < 0 or self.lora_alpha <= 0:
            raise ValueError(f"lora_rank must be >= 0 and lora_alpha > 0, got {self.lora_rank} and {self.lora_alpha}")
        known = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        unknown = [t for t in self.lora_targets if t not in known]
        if unknown:
            raise ValueError(f"lora_targets {unknown} are not projections of this decoder; known: {known}")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "param_dtype", as_dtype(self.param_dtype))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def replace(self, **kwargs) -> "ModelConfig":
        return dataclasses.replace(self, **kwargs)

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def lora_on(self, name: str) -> int:
        """The adapter rank of projection `name` (0: none)."""
        return self.lora_rank if name in self.lora_targets else 0

    @property
    def num_params(self) -> int:
        """Parameter count of the causal LM (embeddings included once when tied)."""
        h, d, v = self.hidden_size, self.resolved_head_dim, self.vocab_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h

    # ----------------------------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> "ModelConfig":
        """Builds a config from a transformers `config.json` dict; raises on what we cannot compute exactly."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            family = {"qwen2": "qwen2", "llama": "llama"}.get(hf.get("model_type", ""))
            if family is None:
                raise ValueError(
                    f"unsupported architecture {archs or hf.get('model_type')!r}; agentfly_jax.models supports "
                    f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type 'qwen2' or 'llama')")
        else:
            family = SUPPORTED_ARCHITECTURES[arch]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; the decoder implements SwiGLU (silu)")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported by agentfly_jax.models")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported; set it to false (Qwen2.5 ships it off)")

        # transformers 5 moved rope settings into `rope_parameters`; older files use rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling")
        if scaling:
            rope.update(scaling)
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        n_heads = hf["num_attention_heads"]
        cfg = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim"),
            family=family,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", family == "qwen2")),
            extra={k: v for k, v in hf.items() if k not in _INTERPRETED_KEYS},
        )
        cfg.update(overrides)
        return cls(**cfg)

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict:
        """The transformers `config.json` for this model."""
        arch = _FAMILY_TO_ARCH[self.family]
        out = dict(self.extra)
        out.update(
            architectures=[arch],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.resolved_head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            # transformers 5 reads `rope_parameters`; `rope_theta` is kept for readers of the older layout.
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            dtype=torch_dtype,
        )
        if self.family == "llama":
            out.update(attention_bias=self.qkv_bias, mlp_bias=False)
        elif not self.qkv_bias:
            raise ValueError("Qwen2 checkpoints always carry qkv biases; a qwen2 config must have qkv_bias=True")
        else:
            out.update(use_sliding_window=False)
        return out
