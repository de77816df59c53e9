"""Model configuration shared by the Flax decoder, the HF checkpoint I/O and the sharding rules."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# How XLA compiles matrix products on a GPU backend (`config.model.gpu_gemm`, `config.jax_sampler.gpu_gemm`):
# "cublas" turns XLA's Triton GEMM fusions off so that every product goes to cuBLAS; "triton" keeps XLA's default
# (Triton fusions where its autotuner picks them); "triton_exhaustive" lets that autotuner try every tiling
# (longer compilations; on an H200 decode steps at 64 slots took 8% less GPU time, docs/benchmarks.md)
GPU_GEMMS = ("cublas", "triton", "triton_exhaustive")
_GPU_GEMM_OPTIONS = {"cublas": {"xla_gpu_enable_triton_gemm": False}, "triton": None,
                     "triton_exhaustive": {"xla_gpu_exhaustive_tiling_search": True}}


def gpu_compiler_options(gpu_gemm: str) -> dict | None:
    """XLA compiler options for a jitted program whose matrix products follow `gpu_gemm` (one of GPU_GEMMS), on a
    GPU backend: "cublas" `{"xla_gpu_enable_triton_gemm": False}`, "triton_exhaustive"
    `{"xla_gpu_exhaustive_tiling_search": True}`, "triton" None (XLA's defaults); None on other backends. Pass the
    result as `jax.jit(..., compiler_options=...)`."""
    if gpu_gemm not in GPU_GEMMS:
        raise ValueError(f"gpu_gemm={gpu_gemm!r}: expected one of {', '.join(GPU_GEMMS)}")
    return _GPU_GEMM_OPTIONS[gpu_gemm] if jax.default_backend() == "gpu" else None


def run_once_compiler_options() -> dict | None:
    """XLA compiler options for a program that runs once or rarely (random parameter initialisation, the finite
    check before a save): on a CPU backend `{"xla_backend_optimization_level": 0}`, else None (XLA's defaults).

    XLA's CPU backend optimises every fusion with LLVM, about half a second each, and a random initialisation has
    one threefry hash per parameter: a 2-layer model's `init` took 11 s to compile at the default level and 4 s at
    level 0, for a run of 0.05 s -> 0.4 s (values equal up to float rounding of the normal transform, 1 ulp).
    On other backends the default level stays: their compilations are faster and a large model's initialisation
    runs long enough to matter."""
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


def jit_run_once(fun, *args):
    """`fun(*args)` as one jitted program compiled with `run_once_compiler_options`. Staged into an outer trace (a
    caller's jit, grad or eval_shape), where JAX takes compiler options from the outermost jit alone and refuses
    them on an inner one, it is a plain jit: the program then compiles as part of the caller's."""
    options = run_once_compiler_options()
    if options:
        try:
            return jax.jit(fun, compiler_options=options)(*args)
        except ValueError as error:
            if "can only be passed to top-level" not in str(error):
                raise
    return jax.jit(fun)(*args)


# HF `architectures` entry -> our family name. The text families share one decoder; they differ in defaults
# (qkv bias, tied embeddings, rope scaling) that live in the config, not in code paths. "qwen2_5_vl" is that
# decoder with multimodal rotary positions (`ModelConfig.mrope_section`) behind a vision tower
# (`ModelConfig.vision`, models/qwen2_5_vl.py).
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
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


# Keys of a Qwen2.5-VL `vision_config` that we interpret (the rest is carried through `VisionConfig.extra`).
_VISION_KEYS = {
    "depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "in_channels", "in_chans",
    "patch_size", "spatial_patch_size", "temporal_patch_size", "spatial_merge_size", "window_size",
    "fullatt_block_indexes", "tokens_per_second", "hidden_act", "rope_parameters", "rope_theta", "model_type",
    "torch_dtype", "dtype", "transformers_version", "_name_or_path", "initializer_range",
}
# Top-level keys of a Qwen2.5-VL config.json that name special tokens (kept in VisionConfig).
_VL_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The Qwen2.5-VL vision tower (models/qwen2_5_vl.py) and the special tokens through which its features
    enter the token sequence. Defaults are transformers' `Qwen2_5_VLVisionConfig` defaults, so a
    `vision_config` that omits a key means what it means to transformers.

    Geometry: an image is cut into `patch_size` x `patch_size` pixel patches (`temporal_patch_size` frames
    deep, a still image repeated); `spatial_merge_size`^2 neighbouring patches merge into one language-model
    token. Blocks in `fullatt_block_indexes` attend over a whole frame, the others within windows of
    `window_size` pixels (`window_size // spatial_merge_size // patch_size` merged tokens a side).
    """

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    out_hidden_size: int = 3584
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple = (7, 15, 23, 31)
    tokens_per_second: int = 4
    rope_theta: float = 10000.0
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    extra: dict = dataclasses.field(default_factory=dict)  # vision_config keys carried through unchanged

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head dim {self.head_dim} must be divisible by 4 (the 2-D rotary embedding "
                             "rotates a quarter of it by the row and a quarter by the column)")
        if self.window_merged < 1:
            raise ValueError(f"vision window_size={self.window_size} is smaller than one merged token "
                             f"({self.spatial_merge_size} x {self.patch_size} px)")
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token (spatial_merge_size^2)."""
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        """Length of one row of the processor's pixel_values: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_merged(self) -> int:
        """Side of an attention window in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def num_params(self) -> int:
        e, f, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
        block = 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (3 * e * f + 2 * f + e)
        merger = e + (m * m + m) + (m * self.out_hidden_size + self.out_hidden_size)
        return self.patch_dim * e + self.depth * block + merger

    @classmethod
    def from_hf_dict(cls, vision: dict, top: dict) -> "VisionConfig":
        """From a `vision_config` dict and the top-level config (which holds the special token ids)."""
        act = vision.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"vision hidden_act={act!r} is not supported; the Qwen2.5-VL vision MLP is SwiGLU (silu)")
        rope = dict(vision.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type={rope['rope_type']!r} is not supported; Qwen2.5-VL uses 'axial'")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in vision.items() if k in fields and k != "extra"}
        # older configs spell two keys differently
        if "in_chans" in vision and "in_channels" not in vision:
            kw["in_channels"] = vision["in_chans"]
        if "spatial_patch_size" in vision and "patch_size" not in vision:
            kw["patch_size"] = vision["spatial_patch_size"]
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(kw.get(key, 0), int):
                raise ValueError(f"vision {key}={kw[key]!r} is not supported; expected one integer")
        kw["rope_theta"] = float(rope.get("rope_theta", vision.get("rope_theta", 10000.0)))
        kw.update({k: top[k] for k in _VL_TOKEN_KEYS if k in top})
        return cls(**kw, extra={k: v for k, v in vision.items() if k not in _VISION_KEYS})

    def to_hf_dict(self) -> dict:
        out = dict(self.extra)
        out.update(
            model_type="qwen2_5_vl_vision", depth=self.depth, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_heads=self.num_heads,
            out_hidden_size=self.out_hidden_size, in_channels=self.in_channels, patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size, spatial_merge_size=self.spatial_merge_size,
            window_size=self.window_size, fullatt_block_indexes=list(self.fullatt_block_indexes),
            tokens_per_second=self.tokens_per_second, hidden_act="silu",
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta},
        )
        return out


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
    # Each decoder layer runs on this many independent groups of the batch's rows (the same weights), so that
    # one group's tensor-parallel collectives can run while another group's matrix products do: under tensor
    # parallelism each all-reduce otherwise waits for the product before it and holds up the one after it. The
    # groups take every N-th row, so each device splits its own rows (moving none, where they divide by N).
    # 1: off. A batch whose rows N does not divide runs whole (the result is the same either way).
    layer_row_splits: int = 1
    # "auto": cuDNN fused attention on GPU in bf16/fp16, else "xla" (einsum, fp32 softmax, exact in fp32)
    attention_impl: str = "auto"
    # Packed rows (segment ids) under cuDNN attention: N > 0 hands cuDNN each row's segments as starts and
    # lengths (up to N runs of equal ids a row, the padding's included), so it skips the blocks across segments
    # and above the diagonal and reads no [B, T, T] bias; a batch with a row of more runs takes the dense-mask
    # kernel (same result; `lax.switch`). A batch whose rows hold at most 2 runs (one sequence and its padding)
    # is described with 2 slots instead (transformer.packed_bounds: cuDNN's cost grows with the bound). 0: always
    # the dense mask. No effect on the einsum path. The default, 8, is the trainer's
    # (`config.model.attention_segments`, docs/benchmarks.md).
    attention_segments: int = 8
    # LoRA (models/lora.py): rank-r adapters beside the kernels of `lora_targets`, scaled by alpha / r; 0: none
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # Qwen2.5-VL (family "qwen2_5_vl", models/qwen2_5_vl.py) only: the vision tower, and mRoPE's split of the
    # head_dim / 2 rotary frequencies between the temporal, height and width position axes (three sizes).
    # LoRA adapters (lora_targets) go on the language model's projections; the vision tower has none.
    vision: VisionConfig | None = None
    mrope_section: tuple | None = None
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
        if not isinstance(self.attention_segments, int) or self.attention_segments < 0:
            raise ValueError(f"attention_segments must be an integer >= 0 (0: the dense mask), got "
                             f"{self.attention_segments!r}")
        if not isinstance(self.layer_row_splits, int) or self.layer_row_splits < 1:
            raise ValueError(f"layer_row_splits must be an integer >= 1 (1: off), got {self.layer_row_splits!r}")
        if self.lora_rank < 0 or self.lora_alpha <= 0:
            raise ValueError(f"lora_rank must be >= 0 and lora_alpha > 0, got {self.lora_rank} and {self.lora_alpha}")
        known = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        unknown = [t for t in self.lora_targets if t not in known]
        if unknown:
            raise ValueError(f"lora_targets {unknown} are not projections of this decoder; known: {known}")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if (self.family == "qwen2_5_vl") != (self.vision is not None):
            raise ValueError(f"family {self.family!r} with vision={type(self.vision).__name__}: family 'qwen2_5_vl' "
                             "needs a VisionConfig in `vision`, and the text families take none")
        if self.vision is not None:
            self._check_vision_language()
        elif self.mrope_section is not None:
            raise ValueError("mrope_section is set but the family is not 'qwen2_5_vl'; multimodal rotary positions "
                             "belong to the vision-language model only")
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "param_dtype", as_dtype(self.param_dtype))

    def _check_vision_language(self):
        half = self.resolved_head_dim // 2
        if self.mrope_section is None or len(self.mrope_section) != 3 or sum(self.mrope_section) != half:
            raise ValueError(f"mrope_section={self.mrope_section!r} must be three sizes (temporal, height, width) "
                             f"summing to head_dim / 2 = {half}")
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        if self.head_dim not in (None, self.hidden_size // self.num_heads):
            raise ValueError(f"head_dim={self.head_dim}: the Qwen2.5-VL language model's head dim is hidden_size // "
                             f"num_heads = {self.hidden_size // self.num_heads}")
        if not self.qkv_bias:
            raise ValueError("Qwen2.5-VL's language model always has qkv biases; set qkv_bias=True")
        if self.rope_scaling:
            raise ValueError(f"rope_scaling={self.rope_scaling!r} is not supported with mRoPE (qwen2_5_vl)")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision out_hidden_size={self.vision.out_hidden_size} must equal the language model's "
                             f"hidden_size={self.hidden_size} (merged image features replace token embeddings)")

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
        vision = self.vision.num_params if self.vision is not None else 0
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h + vision

    # ----------------------------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> "ModelConfig":
        """Builds a config from a transformers `config.json` dict; raises on what we cannot compute exactly.

        Qwen2.5-VL configs come in two layouts, both read: transformers 5 nests the language model's keys in
        `text_config`; earlier files (the released checkpoints) keep them at the top level. Either way
        `vision_config` holds the vision tower and the top level the special token ids.
        """
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            family = {"qwen2": "qwen2", "llama": "llama", "qwen2_5_vl": "qwen2_5_vl"}.get(hf.get("model_type", ""))
            if family is None:
                raise ValueError(
                    f"unsupported architecture {archs or hf.get('model_type')!r}; agentfly_jax.models supports "
                    f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type 'qwen2', 'llama' or 'qwen2_5_vl')")
        else:
            family = SUPPORTED_ARCHITECTURES[arch]
        vl = family == "qwen2_5_vl"
        text = hf
        if vl:  # the language model's keys: nested (transformers 5) over the top level (older files)
            text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config", *_VL_TOKEN_KEYS)}
            text.update(hf.get("text_config") or {})
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; the decoder implements SwiGLU (silu)")
        if text.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported by agentfly_jax.models")
        if text.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported; set it to false (Qwen2.5 ships it off)")

        # transformers 5 moved rope settings into `rope_parameters`; older files use rope_theta + rope_scaling.
        rope = dict(text.get("rope_parameters") or {})
        scaling = text.get("rope_scaling")
        if scaling:
            rope.update(scaling)
        # transformers' defaults where a key is absent: Qwen2.5-VL's text config differs from Qwen2/Llama's
        rope_theta = float(rope.pop("rope_theta", text.get("rope_theta", 1e6 if vl else 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        mrope_section = None
        if vl:
            # "mrope" is the older name of the default frequencies split into sections
            mrope_section = tuple(rope.pop("mrope_section", (16, 24, 24)))
            rope_type = "default" if rope_type == "mrope" else rope_type
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        n_heads = text["num_attention_heads"]
        cfg = dict(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=text.get("num_key_value_heads") or n_heads,
            head_dim=text.get("head_dim"),
            family=family,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5 if vl else 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            # a pre-v5 nested file may keep tie_word_embeddings in text_config; transformers honours either
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False)),
            qkv_bias=True if vl else bool(hf.get("attention_bias", family == "qwen2")),
            extra={k: v for k, v in text.items() if k not in _INTERPRETED_KEYS},
        )
        if vl:
            cfg.update(vision=VisionConfig.from_hf_dict(hf.get("vision_config") or {}, hf),
                       mrope_section=mrope_section)
        cfg.update(overrides)
        return cls(**cfg)

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict:
        """The transformers `config.json` for this model (Qwen2.5-VL: the nested layout transformers 5 writes)."""
        arch = _FAMILY_TO_ARCH[self.family]
        if self.family == "qwen2_5_vl":
            return self._vl_hf_dict(torch_dtype)
        out = {**self.extra, **self._decoder_hf_fields()}
        out.update(
            architectures=[arch],
            model_type=self.family,
            head_dim=self.resolved_head_dim,
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
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

    def _decoder_hf_fields(self) -> dict:
        """The decoder's hyper-parameters under their HF config names (the text and the VL layouts share them).
        transformers 5 reads `rope_parameters` (set by each layout); `rope_theta` is kept for readers of the older
        layout."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )

    def _vl_hf_dict(self, torch_dtype: str) -> dict:
        text = {**self.extra, **self._decoder_hf_fields()}
        text.update(
            model_type="qwen2_5_vl_text",
            rope_parameters={"rope_type": "default", "mrope_section": list(self.mrope_section),
                             "rope_theta": self.rope_theta},
            use_sliding_window=False,
        )
        v = self.vision
        return dict(
            architectures=[_FAMILY_TO_ARCH[self.family]],
            model_type="qwen2_5_vl",
            text_config=text,
            vision_config=v.to_hf_dict(),
            tie_word_embeddings=self.tie_word_embeddings,
            image_token_id=v.image_token_id,
            video_token_id=v.video_token_id,
            vision_start_token_id=v.vision_start_token_id,
            vision_end_token_id=v.vision_end_token_id,
            dtype=torch_dtype,
        )
