"""Model smoke demo: build a tiny Qwen2-architecture checkpoint, reload it, print next-token logprobs.

    python -m agentfly_jax.models.demo [--out runs/demo_model]

Shows the checkpoint round trip a training run relies on (our params -> HF safetensors -> our params) and,
when torch is installed, the same logits from transformers.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from agentfly_jax.models import CausalLM, ModelConfig, init_params, load_pretrained, save_pretrained


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo_model", help="where to write the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                         num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True, family="qwen2")
    model = CausalLM(config)
    params = init_params(model, jax.random.PRNGKey(args.seed))
    save_pretrained(model, params, args.out)
    print(f"saved a {config.num_params / 1e6:.2f}M-parameter {config.family} model to {args.out}")

    model, params = load_pretrained(args.out)
    prompt = np.array([[1, 17, 42, 99, 7, 512]], np.int32)
    forward = jax.jit(model.apply)
    t0 = time.perf_counter()
    logits = forward({"params": params}, jnp.asarray(prompt))
    jax.block_until_ready(logits)
    print(f"forward (incl. compile) {time.perf_counter() - t0:.2f}s on {jax.devices()[0].platform}")
    logprobs = jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))
    top = np.argsort(-np.asarray(logprobs))[:5]
    print("next-token logprobs after", prompt[0].tolist())
    for tok in top:
        print(f"  token {int(tok):5d}  logprob {float(logprobs[tok]):+.4f}")

    try:
        import torch
        import transformers
    except ImportError:
        print("(torch/transformers not installed: skipping the cross-check)")
        return 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.as_tensor(prompt, dtype=torch.long)).logits.numpy()
    diff = float(np.abs(hf_logits - np.asarray(logits)).max())
    print(f"transformers logits on the same checkpoint: max |diff| = {diff:.2e}")
    return 0 if diff < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
