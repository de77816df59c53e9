"""Flax decoder models (Qwen2/Qwen2.5, Llama 3, Qwen2.5-VL), value model, HF checkpoint I/O and sharding rules."""
from agentfly_jax.models import lora
from agentfly_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, VisionConfig
from agentfly_jax.models.hf_io import (
    hf_to_params,
    load_pretrained,
    load_value_model,
    params_to_hf,
    read_hf_tensors,
    save_pretrained,
)
from agentfly_jax.models.qwen2_5_vl import (
    Qwen2_5_VLCausalLM,
    VisionLayout,
    mrope_positions,
    pad_patches,
    vision_layout,
)
from agentfly_jax.models.transformer import CausalLM, Decoder, ValueModel, attention_mask, init_params, logical_axes

__all__ = [
    "SUPPORTED_ARCHITECTURES", "ModelConfig", "VisionConfig", "CausalLM", "Decoder", "ValueModel",
    "Qwen2_5_VLCausalLM", "VisionLayout", "vision_layout", "mrope_positions", "pad_patches", "attention_mask",
    "init_params", "logical_axes", "load_pretrained", "load_value_model", "save_pretrained", "params_to_hf",
    "hf_to_params", "read_hf_tensors", "lora",
]
