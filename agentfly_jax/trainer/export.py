"""The trained policy as a Hugging Face checkpoint that serves the way it was trained (`<workdir>/final_policy`).

`export_policy` writes:

- `config.json` + `model.safetensors` (`models.save_pretrained`), with `eos_token_id` set to the token id(s) that
  ended a turn in training (the agent's `stop_token_ids`, one int or a list) and `bos_token_id` /
  `pad_token_id` where the tokenizer has them;
- `generation_config.json` with the same `eos_token_id` list and bos/pad ids, and nothing else: no
  temperature, top_p, top_k, repetition penalty or length default, so transformers' `generate` and vLLM
  (which add these eos ids to every request's stop tokens) stop where training stopped, and sample however
  the caller asks (transformers' defaults otherwise: greedy, 20 new tokens);
- the tokenizer files, with the chat template used in training saved as the tokenizer's template
  (`chat_template.jinja`): the tokenizer's own template, the Jinja text given, or, for a named template such
  as "qwen2.5", its Jinja equivalent (`rollout.chat_templates`), which renders the text the Python renderer
  rendered in training;
- for a vision-language policy (Qwen2.5-VL), `preprocessor_config.json`: the Qwen2-VL image processor with the
  pixel range and patch geometry images were prepared with in training (`agentfly_jax.images.ImageSettings`), in the
  layout of the released Qwen2.5-VL checkpoints, so transformers' `AutoProcessor` and vLLM cut images into the
  same tokens.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from agentfly_jax.models import save_pretrained
from agentfly_jax.rollout.chat_templates import jinja_for_template
from agentfly_jax.images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageSettings

GENERATION_CONFIG_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _token_id(tokenizer: Any, attribute: str) -> int | None:
    value = getattr(tokenizer, attribute, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def special_token_ids(tokenizer: Any, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """`eos_token_id` (the stop ids: an int when there is one, else the list) and the tokenizer's bos and pad
    ids where it has them."""
    stops = [int(t) for t in stop_token_ids]
    if not stops:
        raise ValueError("exporting a policy needs at least one stop token id (the end-of-turn token)")
    ids: dict[str, Any] = {"eos_token_id": stops[0] if len(stops) == 1 else stops}
    for key, attribute in (("bos_token_id", "bos_token_id"), ("pad_token_id", "pad_token_id")):
        value = _token_id(tokenizer, attribute)
        if value is not None:
            ids[key] = value
    return ids


def write_generation_config(path: str, tokenizer: Any, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """`generation_config.json` with the special token ids only (eos as a list of every stop id)."""
    ids = special_token_ids(tokenizer, stop_token_ids)
    eos = ids["eos_token_id"]
    config = {**ids, "eos_token_id": eos if isinstance(eos, list) else [eos]}
    try:
        import transformers

        config["transformers_version"] = transformers.__version__
    except ImportError:  # transformers is a dependency; the file is valid without the version marker
        pass
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    return config


def save_tokenizer_with_template(tokenizer: Any, path: str, chat_template: str | None) -> str | None:
    """Saves `tokenizer` into `path` with the Jinja text of `chat_template` (see `jinja_for_template`) as its
    chat template; the tokenizer object itself is left as it was. Returns the Jinja text saved (None: the
    tokenizer has no template and none was named)."""
    jinja = jinja_for_template(tokenizer, chat_template)
    if jinja is None:
        tokenizer.save_pretrained(path)
        return None
    previous = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = jinja
    try:
        tokenizer.save_pretrained(path)
    finally:
        tokenizer.chat_template = previous
    return jinja


def write_preprocessor_config(path: str, settings: ImageSettings) -> dict[str, Any]:
    """`preprocessor_config.json` of the Qwen2-VL image processor with `settings` (the released checkpoints'
    layout: min/max pixels, patch geometry, CLIP normalisation)."""
    config = {"min_pixels": settings.min_pixels, "max_pixels": settings.max_pixels,
              "patch_size": settings.patch_size, "temporal_patch_size": settings.temporal_patch_size,
              "merge_size": settings.merge_size, "image_mean": list(OPENAI_CLIP_MEAN),
              "image_std": list(OPENAI_CLIP_STD), "do_convert_rgb": True, "do_resize": True, "do_rescale": True,
              "rescale_factor": 1 / 255, "do_normalize": True, "image_processor_type": "Qwen2VLImageProcessor",
              "processor_class": "Qwen2_5_VLProcessor"}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    return config


def export_policy(model, params, tokenizer, path: str, *, stop_token_ids: Sequence[int],
                  chat_template: str | None = None, dtype=None, image_settings: ImageSettings | None = None) -> None:
    """Writes the policy (`model`, host `params`) with `tokenizer` to `path` as described in the module
    docstring. `stop_token_ids`: the agent's `stop_token_ids`; `chat_template`: what training passed as
    `chat_template` ("qwen2.5", "llama3", Jinja text, or None for the tokenizer's own); `image_settings`: how a
    vision-language policy's images were prepared (default: the processor's defaults)."""
    save_pretrained(model, params, path, dtype=dtype)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as fh:
        hf_config = json.load(fh)
    hf_config.update(special_token_ids(tokenizer, stop_token_ids))
    with open(config_file, "w") as fh:
        json.dump(hf_config, fh, indent=2, sort_keys=True)
    write_generation_config(path, tokenizer, stop_token_ids)
    save_tokenizer_with_template(tokenizer, path, chat_template)
    if getattr(model.config, "vision", None) is not None:
        write_preprocessor_config(path, image_settings or ImageSettings())
