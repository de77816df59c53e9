"""Bad checkpoints and configs fail with errors that name what is wrong."""
import json

import pytest
from safetensors.numpy import load_file, save_file

from agentfly_jax.models import ModelConfig, load_pretrained
from tests.models import hf_reference as ref


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    ref.build(ref.qwen2_config(), str(path))
    return path


def _copy(src, dst, edit_config=None, edit_tensors=None):
    cfg = json.load(open(src / "config.json"))
    tensors = load_file(str(src / "model.safetensors"))
    if edit_config:
        edit_config(cfg)
    if edit_tensors:
        edit_tensors(tensors)
    dst.mkdir(exist_ok=True)
    json.dump(cfg, open(dst / "config.json", "w"))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_unsupported_architecture(qwen_dir, tmp_path):
    def edit(cfg):
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    with pytest.raises(ValueError, match="unsupported architecture.*Mixtral"):
        load_pretrained(_copy(qwen_dir, tmp_path / "x", edit_config=edit))


def test_missing_tensor_is_named(qwen_dir, tmp_path):
    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(160, 64\)"):
        load_pretrained(_copy(qwen_dir, tmp_path / "x", edit_tensors=drop))


def test_mismatched_shape_is_named(qwen_dir, tmp_path):
    def shrink(cfg):
        cfg["intermediate_size"] = 128
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape \(160, 64\).*\(128, 64\)"):
        load_pretrained(_copy(qwen_dir, tmp_path / "x", edit_config=shrink))


def test_unexpected_tensor_is_reported(qwen_dir, tmp_path):
    def extra(t):
        t["model.layers.0.mlp.extra_proj.weight"] = t["model.norm.weight"]
    with pytest.raises(ValueError, match="does not use.*extra_proj"):
        load_pretrained(_copy(qwen_dir, tmp_path / "x", edit_tensors=extra))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(ref.qwen2_config().to_dict()))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_pretrained(str(tmp_path))


def test_bad_configs():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        ModelConfig(**base, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        ModelConfig(**base, num_kv_heads=2, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_hf_dict({**ref.qwen2_config().to_dict(), "architectures": ["Qwen2ForCausalLM"],
                                  "hidden_act": "gelu"})
