"""Builds tiny random transformers checkpoints (the independent reference) inside the tests."""
import numpy as np
import torch
import transformers

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def qwen2_config(**kw):
    """Qwen2: qkv bias (always on in Qwen2), tied embeddings."""
    return transformers.Qwen2Config(**{**TINY, "tie_word_embeddings": True, "rope_theta": 1e6, **kw})


def llama3_config(**kw):
    """Llama 3 with llama3 rope scaling, untied embeddings, head_dim set explicitly."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    return transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1, "tie_word_embeddings": False,
                                       "rope_theta": 500000.0, "rope_scaling": scaling, **kw})


def build(config, path, seed=0, cls=transformers.AutoModelForCausalLM, **kwargs):
    """Random model saved to `path`; weights drawn large enough that every layer matters. `cls` is an auto class
    (`from_config`) or a model class (`_from_config`); `kwargs` go to it (e.g. attn_implementation)."""
    torch.manual_seed(seed)
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    model = make(config, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # RMSNorm scales (the VL merger's is `ln_q`) around 1, perturbed so a wrong norm is visible
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, input_ids, **kw):
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.array(input_ids)), **kw)  # a copy: a JAX array reads as read-only
    return out.logits.float().numpy()
