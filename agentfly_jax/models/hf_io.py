"""Hugging Face checkpoint I/O: config.json + safetensors (single file or sharded with an index).

The name/layout mapping lives in one table (`_layer_tensors`) used both ways, so what we load is exactly what
we save; weight sync to rollout engines reuses `params_to_hf`.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import traverse_util
from safetensors import safe_open
from safetensors.flax import save_file

from agentfly_jax.models.lora import has_adapters, merge_lora
from agentfly_jax.models.config import ModelConfig, VisionConfig, as_dtype
from agentfly_jax.models.qwen2_5_vl import Qwen2_5_VLCausalLM
from agentfly_jax.models.transformer import CausalLM, ValueModel, init_params

# Tensors a checkpoint may carry that carry no information for us (rotary caches written by old versions).
_IGNORABLE = re.compile(r".*rotary_emb\.inv_freq$")
_VALUE_ARCH = {"qwen2": "Qwen2ForTokenClassification", "llama": "LlamaForTokenClassification"}


def _linear(out_shape=None):
    """HF Linear weight [out, in] <-> our kernel [in, *out_shape] (out_shape splits `out` into heads)."""
    def to_ours(w):
        return w.T if out_shape is None else w.T.reshape((w.shape[1], *out_shape))

    def to_hf(k):
        return k.reshape(k.shape[0], -1).T
    return to_ours, to_hf


def _out_linear(in_shape):
    """HF o_proj weight [E, H*D] <-> our kernel [H, D, E]."""
    def to_ours(w):
        return w.T.reshape((*in_shape, w.shape[0]))

    def to_hf(k):
        return k.reshape(-1, k.shape[-1]).T
    return to_ours, to_hf


def _reshape(shape):
    return (lambda w: w.reshape(shape)), (lambda p: p.reshape(-1))


_IDENTITY = (lambda w: w), (lambda p: p)


def _tensor_table(c: ModelConfig, value_model: bool = False):
    """[(hf_name, our_path tuple, hf_shape, (to_ours, to_hf))] for every tensor of the model."""
    d, h, k, e, f, v = c.resolved_head_dim, c.num_heads, c.num_kv_heads, c.hidden_size, c.intermediate_size, c.vocab_size
    rows = [("model.embed_tokens.weight", ("model", "embed_tokens", "embedding"), (v, e), _IDENTITY)]
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", ("model", f"layers_{i}")
        rows += [
            (hf + "input_layernorm.weight", ours + ("input_layernorm", "scale"), (e,), _IDENTITY),
            (hf + "post_attention_layernorm.weight", ours + ("post_attention_layernorm", "scale"), (e,), _IDENTITY),
            (hf + "self_attn.q_proj.weight", ours + ("self_attn", "q_proj", "kernel"), (h * d, e), _linear((h, d))),
            (hf + "self_attn.k_proj.weight", ours + ("self_attn", "k_proj", "kernel"), (k * d, e), _linear((k, d))),
            (hf + "self_attn.v_proj.weight", ours + ("self_attn", "v_proj", "kernel"), (k * d, e), _linear((k, d))),
            (hf + "self_attn.o_proj.weight", ours + ("self_attn", "o_proj", "kernel"), (e, h * d), _out_linear((h, d))),
            (hf + "mlp.gate_proj.weight", ours + ("mlp", "gate_proj", "kernel"), (f, e), _linear()),
            (hf + "mlp.up_proj.weight", ours + ("mlp", "up_proj", "kernel"), (f, e), _linear()),
            (hf + "mlp.down_proj.weight", ours + ("mlp", "down_proj", "kernel"), (e, f), _linear()),
        ]
        if c.qkv_bias:
            rows += [
                (hf + "self_attn.q_proj.bias", ours + ("self_attn", "q_proj", "bias"), (h * d,), _reshape((h, d))),
                (hf + "self_attn.k_proj.bias", ours + ("self_attn", "k_proj", "bias"), (k * d,), _reshape((k, d))),
                (hf + "self_attn.v_proj.bias", ours + ("self_attn", "v_proj", "bias"), (k * d,), _reshape((k, d))),
            ]
    rows.append(("model.norm.weight", ("model", "norm", "scale"), (e,), _IDENTITY))
    if value_model:
        rows += [("score.weight", ("value_head", "kernel"), (1, e), _linear()),
                 ("score.bias", ("value_head", "bias"), (1,), _IDENTITY)]
    elif not c.tie_word_embeddings:
        rows.append(("lm_head.weight", ("lm_head", "kernel"), (v, e), _linear()))
    if c.vision is not None:
        rows += _vision_tensor_table(c.vision)
    return rows


def _vision_tensor_table(vc: VisionConfig):
    """Qwen2.5-VL's vision tower, in the names its released checkpoints (and transformers' save_pretrained) use."""
    e, f, h, d, p = vc.hidden_size, vc.intermediate_size, vc.num_heads, vc.head_dim, vc.patch_dim
    merged, out = e * vc.merge_unit, vc.out_hidden_size
    conv_shape = (e, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    # the patch embedding is a Conv3d whose stride equals its kernel: a linear map of each flattened patch
    conv = (lambda w: w.reshape(e, p).T), (lambda k: k.T.reshape(conv_shape))
    rows = [("visual.patch_embed.proj.weight", ("visual", "patch_embed", "kernel"), conv_shape, conv)]

    def dense(hf, ours, n_out, n_in):
        return [(hf + ".weight", ours + ("kernel",), (n_out, n_in), _linear()),
                (hf + ".bias", ours + ("bias",), (n_out,), _IDENTITY)]

    for i in range(vc.depth):
        hf, ours = f"visual.blocks.{i}.", ("visual", f"blocks_{i}")
        rows += [
            (hf + "norm1.weight", ours + ("norm1", "scale"), (e,), _IDENTITY),
            (hf + "norm2.weight", ours + ("norm2", "scale"), (e,), _IDENTITY),
            (hf + "attn.qkv.weight", ours + ("attn", "qkv", "kernel"), (3 * e, e), _linear((3 * h, d))),
            (hf + "attn.qkv.bias", ours + ("attn", "qkv", "bias"), (3 * e,), _reshape((3 * h, d))),
        ]
        rows += dense(hf + "attn.proj", ours + ("attn", "proj"), e, e)
        rows += dense(hf + "mlp.gate_proj", ours + ("mlp", "gate_proj"), f, e)
        rows += dense(hf + "mlp.up_proj", ours + ("mlp", "up_proj"), f, e)
        rows += dense(hf + "mlp.down_proj", ours + ("mlp", "down_proj"), e, f)
    rows.append(("visual.merger.ln_q.weight", ("visual", "merger", "ln_q", "scale"), (e,), _IDENTITY))
    rows += dense("visual.merger.mlp.0", ("visual", "merger", "mlp_0"), merged, merged)
    rows += dense("visual.merger.mlp.2", ("visual", "merger", "mlp_2"), out, merged)
    return rows


# transformers 5's in-memory names of Qwen2.5-VL tensors -> the checkpoint names of the table (both are read)
_VL_RENAMES = ((re.compile(r"^model\.language_model\."), "model."), (re.compile(r"^model\.visual\."), "visual."))


def _canonical_names(config: ModelConfig, tensors: dict) -> dict:
    if config.vision is None:
        return tensors
    out = {}
    for name, w in tensors.items():
        for pattern, repl in _VL_RENAMES:
            name = pattern.sub(repl, name)
        out[name] = w
    return out


# ------------------------------------------------------------------------------------------------ reading
def _read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}; expected a directory written by "
                                "transformers' save_pretrained (config.json + *.safetensors)")
    with open(cfg_file) as fh:
        return json.load(fh)


def _safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (PyTorch .bin checkpoints are not read; "
                                "re-save with transformers' save_pretrained(safe_serialization=True))")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(f"checkpoint {path!r} lists shard(s) {missing} in its index but they are missing")
    return [os.path.join(path, f) for f in files]


def read_hf_tensors(path: str) -> dict[str, jax.Array]:
    """All tensors of a safetensors checkpoint, on the host CPU."""
    tensors = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for file in _safetensor_files(path):
            with safe_open(file, framework="flax") as fh:
                for name in fh.keys():
                    tensors[name] = fh.get_tensor(name)
    return tensors


def hf_to_params(config: ModelConfig, tensors: dict, *, value_model: bool = False, source: str = "checkpoint",
                 allow_missing: tuple[str, ...] = ()) -> dict:
    """Maps HF tensor names/layouts to our param tree (cast to config.param_dtype).

    Raises naming the first missing tensor or shape mismatch; tensors not used are an error too (unless
    ignorable), so nothing is silently dropped. `allow_missing`: HF names that may be absent (returned absent).
    """
    tensors = _canonical_names(config, tensors)
    flat, used = {}, set()
    for hf_name, path, shape, (to_ours, _) in _tensor_table(config, value_model):
        if hf_name not in tensors:
            if hf_name in allow_missing:
                continue
            raise KeyError(f"{source} has no tensor {hf_name!r} (expected shape {shape}); is config.json the "
                           f"one these weights were saved with?")
        w = tensors[hf_name]
        if tuple(w.shape) != shape:
            raise ValueError(f"{source}: tensor {hf_name!r} has shape {tuple(w.shape)}, but config.json implies "
                             f"{shape}")
        flat[path] = jnp.asarray(to_ours(jnp.asarray(w)), dtype=config.param_dtype)
        used.add(hf_name)
    unused = [n for n in tensors if n not in used and not _IGNORABLE.match(n)]
    # Tied checkpoints sometimes also store lm_head.weight (a copy of the embedding); a policy checkpoint loaded
    # as a value model has an lm_head we do not need.
    unused = [n for n in unused if not (n == "lm_head.weight" and (config.tie_word_embeddings or value_model))]
    if unused:
        raise ValueError(f"{source} has {len(unused)} tensor(s) this {config.family} model does not use, e.g. "
                         f"{unused[:5]}; the checkpoint's architecture does not match its config.json")
    return traverse_util.unflatten_dict(flat)


def load_pretrained(path: str, dtype=jnp.float32, *, param_dtype=None, **config_overrides):
    """Loads a transformers Qwen2/Llama checkpoint directory -> (CausalLM, params); a Qwen2.5-VL one
    (`Qwen2_5_VLForConditionalGeneration`) -> (Qwen2_5_VLCausalLM, params).

    `dtype` is the compute dtype; parameters are stored in `param_dtype` (default: `dtype`).
    Extra keyword arguments override ModelConfig fields (e.g. remat=True, attention_impl="cudnn").
    """
    dtype = as_dtype(dtype)
    config = ModelConfig.from_hf_dict(_read_config(path), dtype=dtype,
                                      param_dtype=as_dtype(param_dtype or dtype), **config_overrides)
    params = hf_to_params(config, read_hf_tensors(path), source=f"checkpoint {path!r}")
    model = Qwen2_5_VLCausalLM(config) if config.vision is not None else CausalLM(config)
    return model, params


def load_value_model(path: str, dtype=jnp.float32, *, param_dtype=None, seed: int = 0, **config_overrides):
    """A ValueModel -> (model, params): trunk from a policy (or value) checkpoint; the head from `score.*`
    when present, else freshly initialised (zeros: the critic starts predicting 0)."""
    dtype = as_dtype(dtype)
    config = ModelConfig.from_hf_dict(_read_config(path), dtype=dtype,
                                      param_dtype=as_dtype(param_dtype or dtype), **config_overrides)
    if config.vision is not None:
        raise ValueError(f"{path!r} is a vision-language checkpoint ({config.family}); value models are built "
                         "on the text families only")
    model = ValueModel(config)
    tensors = read_hf_tensors(path)
    params = hf_to_params(config, tensors, value_model=True, source=f"checkpoint {path!r}",
                          allow_missing=("score.weight", "score.bias"))
    if "value_head" not in params:
        params["value_head"] = init_params(model, jax.random.PRNGKey(seed))["value_head"]
    return model, params


# ------------------------------------------------------------------------------------------------ writing
def params_to_hf(config: ModelConfig, params: dict, dtype=None, *,
                 value_model: bool = False) -> Iterator[tuple[str, jax.Array]]:
    """Yields (hf_name, array in HF layout) for every tensor, gathered to the host, in `dtype` if given.
    LoRA adapters (models/lora.py) are merged into their kernels first: the output is a plain checkpoint."""
    if has_adapters(params):
        if not config.lora_rank:  # their scale (alpha / rank) is unknown: refuse rather than drop or misscale them
            raise ValueError("params hold LoRA adapters but the model config has lora_rank=0: pass the LoRA model "
                             "(its config knows alpha / rank), or merge first with models.lora.merge_lora")
        params = merge_lora(params, config.lora_scale)
    flat = traverse_util.flatten_dict(params)
    for hf_name, path, shape, (_, to_hf) in _tensor_table(config, value_model):
        if path not in flat:
            raise KeyError(f"params have no entry {'/'.join(path)} (needed for {hf_name!r})")
        w = to_hf(jnp.asarray(jax.device_get(flat[path])))
        if dtype is not None:
            w = w.astype(as_dtype(dtype))
        assert tuple(w.shape) == shape, (hf_name, w.shape, shape)
        yield hf_name, w


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def save_pretrained(model, params, path: str, *, dtype=None, max_shard_bytes: int = 4 << 30) -> None:
    """Writes config.json + safetensors (sharded with an index above `max_shard_bytes`) that transformers'
    `AutoModelForCausalLM.from_pretrained` (a ValueModel: `AutoModelForTokenClassification` with one label;
    a Qwen2_5_VLCausalLM: `Qwen2_5_VLForConditionalGeneration`) loads to the same outputs. `dtype`: storage
    dtype (default: the params' dtype)."""
    config: ModelConfig = model.config
    value_model = isinstance(model, ValueModel)
    dtype = as_dtype(dtype or config.param_dtype)
    os.makedirs(path, exist_ok=True)
    hf_config = config.to_hf_dict(torch_dtype=_dtype_name(dtype))
    if value_model:
        hf_config.update(architectures=[_VALUE_ARCH[config.family]], num_labels=1,
                         id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    # Remove stale shards of an earlier save into the same directory so the index and files agree.
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))

    shards, current, size = [], {}, 0
    with jax.default_device(jax.devices("cpu")[0]):
        for name, w in params_to_hf(config, params, dtype, value_model=value_model):
            nbytes = w.size * w.dtype.itemsize
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name] = w
            size += nbytes
    shards.append(current)

    meta = {"format": "pt"}  # transformers expects this marker on safetensors files it loads into torch
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata=meta)
            for name, w in shard.items():
                weight_map[name] = fname
                total += w.size * w.dtype.itemsize
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf_config, fh, indent=2, sort_keys=True)
