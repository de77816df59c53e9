"""Weight-sync methods mixed into each vLLM worker (`--worker-extension-cls`), called through `/collective_rpc`.

This module runs inside the vLLM server's own environment, which has torch and safetensors but not JAX or
agentfly_jax: it imports nothing from the package (scripts/start_vllm.sh loads a copy of this file under the
module name `agentfly_vllm_worker_ext`). `VLLMBackend` drives it:

  POST /collective_rpc {method: STAGE, kwargs: {payload}}  once per chunk: base64 safetensors bytes, HF names
                                                         (while the engine still runs: the model is not touched)
  POST /pause?mode=wait                                  finish running requests, hold new ones
       (or, interrupt=True, first: ?mode=keep freezes running requests; then IN_FLIGHT_LENGTHS, the tokens each
       has, then the STAGE calls)
  POST /collective_rpc {method: COMMIT, kwargs: {version}} load every staged tensor at once, record the version
  POST /reset_prefix_cache, then POST /resume            (cached KV blocks were computed with the old weights)

or, for models too large to push through HTTP, `RELOAD_FROM_PATH` with a directory written by save_pretrained.
`/collective_rpc` passes only JSON values, so payloads are base64 text and numbers travel as strings.

Tied word embeddings (Qwen2.5-0.5B, Qwen2.5-VL-3B, the test models): vLLM 0.32's in-place reload loads `embed_tokens` but
finds no checkpoint tensor for `lm_head` (the loader skips it when tied) and puts the OLD lm_head weight back,
silently untying the two; on CPU the lm_head's prepacked GEMM weights stay stale as well. After every reload we
tie lm_head to the new embedding again and redo its post-load processing (`_retie_word_embeddings`).
"""
from __future__ import annotations

import base64

STAGE = "agentfly_stage_weights"
COMMIT = "agentfly_commit_weights"
ABORT = "agentfly_abort_weight_update"
RELOAD_FROM_PATH = "agentfly_reload_weights_from_path"
WEIGHT_VERSION = "agentfly_weight_version"
IN_FLIGHT_LENGTHS = "agentfly_in_flight_lengths"


class WeightSyncExtension:
    """Methods added to vLLM's Worker; `self` is the worker (it provides `reload_weights`)."""

    def agentfly_stage_weights(self, payload: str) -> dict:
        """Decodes one chunk (base64 of a safetensors blob keyed by HF tensor names) into the staging area."""
        from safetensors.torch import load

        staged = self.__dict__.setdefault("_agentfly_staged", {})
        tensors = load(base64.b64decode(payload))
        staged.update(tensors)
        return {"staged": len(staged), "chunk_tensors": len(tensors)}

    def agentfly_commit_weights(self, version: str) -> dict:
        """Loads every staged tensor into the model in one `reload_weights` call and records `version`."""
        staged = self.__dict__.pop("_agentfly_staged", None)
        if not staged:
            raise RuntimeError("agentfly weight commit with nothing staged; stage the chunks first")
        self.reload_weights(weights_iterator=iter(staged.items()))
        retied = _retie_word_embeddings(self)
        self._agentfly_weight_version = int(version)
        return {"version": self._agentfly_weight_version, "tensors": len(staged), "retied_lm_head": retied}

    def agentfly_abort_weight_update(self) -> dict:
        """Drops staged chunks of an update that will not be committed."""
        staged = self.__dict__.pop("_agentfly_staged", None) or {}
        return {"dropped": len(staged)}

    def agentfly_reload_weights_from_path(self, path: str, version: str) -> dict:
        """Loads a safetensors checkpoint directory (config.json + *.safetensors) and records `version`."""
        self.reload_weights(weights_path=path)
        retied = _retie_word_embeddings(self)
        self._agentfly_weight_version = int(version)
        return {"version": self._agentfly_weight_version, "path": path, "retied_lm_head": retied}

    def agentfly_in_flight_lengths(self) -> dict:
        """{"lengths": {engine request id: output tokens sampled so far}} of every request this worker holds.

        Asked while the engine is paused with `mode=keep` (frozen: no step runs), right before new weights are
        loaded: these are the tokens each in-flight sequence sampled on the old weights. Placeholders (-1) that
        asynchronous scheduling appends for tokens not sampled yet are not counted.
        """
        requests = getattr(self.model_runner, "requests", {})
        return {"lengths": {str(rid): sum(1 for t in state.output_token_ids if t >= 0)
                            for rid, state in requests.items()}}

    def agentfly_weight_version(self) -> dict:
        """The version last committed through this extension (None: the weights the server started with)."""
        return {"version": getattr(self, "_agentfly_weight_version", None)}


def _retie_word_embeddings(worker) -> bool:
    """Ties lm_head to the (reloaded) input embedding when the model ties them; returns whether it did."""
    runner = worker.model_runner
    hf_config = runner.model_config.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    tied = getattr(text_config, "tie_word_embeddings", None)
    if tied is None:  # transformers 5 keeps a vision-language model's flag on its top-level config only
        tied = getattr(hf_config, "tie_word_embeddings", False)
    if not tied:
        return False
    model = runner.get_model()
    # A vision-language model (Qwen2.5-VL) holds the causal LM, with lm_head and embed_tokens, as its language model.
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    lm_head = getattr(model, "lm_head", None)
    try:
        embed = model.get_submodule("model.embed_tokens")
    except AttributeError:
        return False
    if lm_head is None or not hasattr(lm_head, "weight") or not hasattr(embed, "weight"):
        return False
    lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)  # on CPU: rebuilds the prepacked logits GEMM
    return True
