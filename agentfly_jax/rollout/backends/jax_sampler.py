"""JaxSampler: the embedded generation engine, continuous batching over a fixed set of KV-cache slots.

    model, params = load_pretrained(path)
    sampler = JaxSampler(model, params, max_slots=64, max_len=2048)
    [completion] = await sampler.generate(prompt_ids, max_tokens=256, temperature=1.0, stop_token_ids=[eos])

How it runs. Every sampled sequence occupies one of `max_slots` rows of a preallocated KV cache. A background
asyncio task (started by the first `generate`) repeats: admit waiting sequences into free slots (batched prompt
passes per prompt-length bucket; see Prefix caching), then dispatch one jitted decode call that advances every
occupied slot by `steps_per_call` tokens. Sequences join and leave between calls; a finished sequence's slot is
free for the next call. The next call is dispatched before the previous one's tokens are read back, so host
bookkeeping overlaps device work, and reading back happens in a worker thread so the event loop keeps serving
agents and tools meanwhile.

Shapes are bucketed so XLA compiles a handful of programs: prompt passes per prompt-length bucket (powers of
two; with prefix caching per (length bucket of the tokens computed, attention-window bucket) pair, at most
b(b+1)/2 for b buckets), one program that starts sequences in their slots, decode calls per attention-window
bucket (the cache prefix long enough for every occupied slot: powers of two and the midpoints 1.5x between them,
so a window reads at most 1.5x the longest live sequence) and per whether any slot uses top-p/top-k.
`compile_counts` tells how many were traced.

Prefix caching (`prefix_caching=True`, the default). The agent runtime sends each turn of each chain as its own
request whose prompt is the whole conversation so far, and a GRPO group's n chains as n requests with the same
first prompt. So a finished text sequence keeps its keys/values in its slot: the slot is "parked" with the token
ids they belong to (the prompt and all sampled tokens but the last, which was never fed). Parked slots count as
free: admission takes empty slots first, then parked ones least recently parked first (`stats["prefix_evictions"]`),
so parking never delays a request nor uses memory beyond the `max_slots` rows. A text prompt is matched against
every parked and every running text sequence (host numpy, longest common prefix of token ids); the longest match
of at least min(prefix_min_tokens, prompt length - 1) tokens is reused: a parked slot holding it becomes the
prompt's own slot (its later positions are overwritten), a running sequence's row is copied into the new slot;
then a prompt pass (`decode.prefill_rows`) computes only the tokens after the match, in place in the slot's row,
attending to the reused keys. Identical prompts admitted in one round (a request's n samples, or separate
requests) share one pass; their other slots get copies of the first one's row. Device work per admission: copies
from cached prefixes (reading rows as they were), the passes, then one call copying rows to the group members and
starting every admitted sequence. Counters: `stats["prompt_tokens"]` (tokens the admitted sequences' prompt passes
cover: their prompt less the last token), `stats["prefill_tokens"]` (those actually computed),
`prefix_tokens_reused` (the difference), `prefix_hits` (distinct prompts that reused cached KV), `prefix_shared`
(sequences served by another's pass in the same round), `prefix_copies`, `prefix_evictions`,
`prefix_invalidated`; `health()["parked_slots"]`. The reused keys/values are those the same weights computed for
the same tokens at the same positions, so outputs equal a full prompt pass up to float rounding (greedy tokens
equal and logprobs within 1e-5 in fp32, tests/backends/test_jax_sampler_prefix.py); prefix_caching=False runs
every prompt whole (a fresh-cache pass per length bucket copied into its slots), as before. Under slot pressure
(more chains than slots) a parked slot is often reclaimed before the chain's next turn arrives, and caching then
saves less (about half of the prompt tokens with 2 to 8 times more chains than slots, docs/benchmarks.md). Prompts with images are never matched nor parked (their prompt passes run the vision tower and
mRoPE positions; see Images); text prompts of a vision-language model are.

Sampling and logprobs. Logits are scaled by 1/temperature; top-k, then top-p (on the top-k renormalised
distribution) restrict the candidates; the token is drawn with the Gumbel-max trick from a per-sequence key
derived from (seed, sample index, token index), so a seeded request gives the same tokens whatever else is in
the batch. The logprob returned for each token is log_softmax(logits / temperature) at that token, taken BEFORE
top-p/top-k truncation: exactly what the trainer recomputes (`token_logprobs(..., temperature=T)`), so the
importance ratio trainer/sampler is 1 on-policy. (vLLM returns the truncated, renormalised logprob instead when
top-p/top-k are active; see VLLMBackend.) temperature=0 means greedy; its logprobs are at temperature 1.

Weights. `update_weights(params, version, interrupt=...)` swaps the parameter tree between two decode calls; the
jitted programs take params as an argument, so same shapes and dtypes mean no recompilation. The sampler keeps
its own copy of the params (on its device, in the dtypes it started with): the trainer may donate its buffers.
  interrupt=False (the default): waiting sequences are no longer admitted; the decode loop runs on until the
    sequences in flight have finished on the old weights (the update awaits an event set when the last occupied
    slot is released, or the loop failing or closing); then the params are swapped, `weight_version` bumped and
    admission resumes, so every completion is sampled by one version. `stats["drain_wait_s"]` sums the time
    updates waited, `stats["drained_sequences"]` the sequences they waited for.
  interrupt=True (partial rollouts): the params are swapped at once; sequences in flight continue on the new
    weights from the next decode call (`stats["interrupted_sequences"]` counts them). Their KV cache stays as it
    was computed (prompt and earlier tokens by the old weights): the logprob recorded for each token is that of
    the distribution that actually sampled it, so the trainer's importance correction against it is exact.
  Cached prefixes (prefix caching): every update drops them (`stats["prefix_invalidated"]` counts the parked
    slots dropped), and a sequence in flight across an interrupting update is neither parked when it finishes
    nor copied from meanwhile (its KV mixes both weights), so by default every prompt admitted after an update is computed by the new weights
    alone, as without caching. `update_weights(..., keep_prefix_cache=True)` keeps them: a later prompt that
    continues a conversation then reuses keys/values the old weights computed, as a partial rollout (interrupt=True)
    continues its own (sequences in flight stay reusable too). Its logprobs are still those of the distribution that sampled each token (what the
    trainer's importance correction needs), but they are not what the new weights alone give for the whole
    conversation, and any prompt sharing a cached prefix (another task with the same system prompt) reuses it too.
    The trainer does not pass it.
Each Completion carries `token_versions`, the version whose params the decode call that sampled each token used.
Since the next call is dispatched before the previous one is read back, the version is taken when a call is
dispatched, together with the slot owners of that call, not when its tokens are collected. `weight_version` is
the first token's. Updates run one at a time, in the order they were called.
Runs on one device (the first, or `device=`), or tensor-parallel over several (see Tensor parallelism).

Tensor parallelism (`tensor_parallel=N`: the first N local devices; or `mesh=`: a Mesh whose only axis of more
than one device is "tensor", e.g. `sharding.make_mesh({"tensor": N}, devices)`). For a model that does not fit
one device, or to decode faster on several. The params are placed by the model's logical axis rules
(`sharding.DEFAULT_RULES`, Megatron style): q heads, kv heads, MLP hidden units and the vocab split over the
devices, norms replicated, and any dimension the axis does not divide (14 heads on 4 devices) replicated. The KV
cache is split over kv heads like the k/v projections; where the queries split further than the kv heads (2 kv
heads on 4 devices) each kv head is computed and cached once per device that reads it (`decode` module docstring),
so each device holds only the max(K / N, 1) kv heads its queries read (the whole cache only where the query heads
do not divide and attention is replicated). Every program (prompt passes, starts, inserts, decode calls, prompt
passes with images) is traced under the mesh with the activation layouts of `decode.extend`'s
constraints and runs SPMD: XLA all-reduces the hidden state after o_proj and down_proj, as the training model does,
and reduces the vocab-split logits for the softmax and the sampled token; the cache never moves. Its outputs keep
the cache's and state's layouts (given as out_shardings), so the donated cache is updated in place call after call.
`update_weights` places the new params (from the trainer's mesh, another device or the host) on the sampler's
layouts, always as a copy. Outputs equal the single-device sampler's up to float rounding (the all-reduces sum
in another order): greedy tokens equal and logprobs within 1e-5 in fp32 (tests/backends/test_jax_sampler_sharded.py).

Images (a `Qwen2_5_VLCausalLM` policy; `supports_images` is True only then). `generate(prompt, ...,
images=[PreparedImage, ...])` takes all of the prompt's images in order, one per run of `<|image_pad|>` ids (the
chain resends a conversation's earlier images with every turn). The request is checked when it is made: the
prompt's pad count must equal the images' tokens, run by run (`mrope_positions` on the host gives each prompt
token its 3-D rotary position, and the row's rotary offset: its largest position + 1 - its length). A prompt pass
with images embeds the prompts through the model's `embed`: the vision tower runs over the pass's images, their
patches padded with zero rows to a power-of-two patch bucket (at least `min_patch_bucket`), so one program serves
each (prompt bucket, patch bucket); passes hold as many of a bucket's prompts as fit `prefill_patches` patches
(the vision tower attends densely over a pass's patches). Decoding then rotates each token by its cache index
plus the row's offset, the same on all three axes, as transformers' generate does. Prompts without images take
the text path, on a vision-language model too (offset 0), and text models compile exactly the programs they
always did. Prompts with images are never prefix-cached (a prompt's `n` samples share its one pass), so a later
turn's prompt encodes its earlier images again from their pixels, with the current weights.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentfly_jax.models import decode, sharding
from agentfly_jax.models.config import gpu_compiler_options
from agentfly_jax.models.qwen2_5_vl import Qwen2_5_VLCausalLM, mrope_positions, pad_patches, vision_layout
from agentfly_jax.models.transformer import CausalLM
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.images import PreparedImage

log = logging.getLogger(__name__)


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from `lo` up to the first >= hi, capped at `hi` (which is always included)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _window_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Attention windows of decode calls: the powers of two from `lo` and the midpoints 1.5x between them, capped at
    `hi` (always included). Two per octave, so a window over-reads the live length by at most 1.5x (a power of two
    alone: up to 2x, on average ~1.4x), for at most twice the decode programs."""
    out = []
    for b in _pow2_buckets(lo, hi):  # ascending, so the midpoints keep the order
        out += [b, b + b // 2] if b + b // 2 < hi and b % 2 == 0 else [b]
    return tuple(out)


def _pow2_at_least(n: int, lo: int) -> int:
    """The smallest power of two >= max(n, lo)."""
    return 1 << (max(n, lo) - 1).bit_length()


#: the sampler's logical axis rules: the model split over "tensor" (Megatron), nothing over data or fsdp
_SAMPLER_RULES = sharding.DEFAULT_RULES


def _sampler_mesh(device, tensor_parallel: int, mesh: Mesh | None) -> Mesh | None:
    """The mesh of a JaxSampler's options (None: one device); raises on conflicting or unusable ones."""
    if isinstance(tensor_parallel, bool) or int(tensor_parallel) != tensor_parallel or tensor_parallel < 1:
        raise ValueError(f"JaxSampler needs tensor_parallel >= 1 (an int), got {tensor_parallel!r}")
    given = [name for name, on in (("device", device is not None), ("mesh", mesh is not None),
                                   ("tensor_parallel", tensor_parallel > 1)) if on]
    if len(given) > 1:
        raise ValueError(f"JaxSampler takes one of device=, mesh= and tensor_parallel > 1, got {' and '.join(given)}"
                         "; a mesh over chosen devices: mesh=sharding.make_mesh({'tensor': N}, devices)")
    if tensor_parallel > 1:
        local = jax.local_devices()
        if tensor_parallel > len(local):
            raise ValueError(f"JaxSampler(tensor_parallel={tensor_parallel}) needs that many devices; this process "
                             f"has {len(local)} ({local[0].platform})")
        return sharding.make_mesh({"tensor": int(tensor_parallel)}, local[:tensor_parallel])
    if mesh is None:
        return None
    wide = {axis: size for axis, size in mesh.shape.items() if size > 1 and axis != "tensor"}
    if wide:
        raise ValueError(f"JaxSampler splits the model over a mesh's 'tensor' axis only; this mesh also has "
                         f"{wide}: give it those devices on 'tensor' (e.g. sharding.make_mesh({{'tensor': N}}, "
                         "devices)), or run one sampler per group of devices")
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
        raise ValueError("JaxSampler's mesh must hold devices of this process only (jax.local_devices())")
    # Auto axes: the activation constraints are GSPMD sharding hints (Explicit axes would disable propagation)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def _shares_buffers(src, out) -> bool:
    """Whether jax arrays `src` and `out` have a device buffer in common (device_put handed a shard over)."""
    if not isinstance(src, jax.Array) or not isinstance(out, jax.Array):
        return False
    try:
        mine = {shard.data.unsafe_buffer_pointer() for shard in src.addressable_shards}
        return any(shard.data.unsafe_buffer_pointer() in mine for shard in out.addressable_shards)
    except (NotImplementedError, RuntimeError):  # no buffer pointers here: copy wherever they could be shared
        return bool(src.devices() & out.devices())


def _bucket(buckets: Sequence[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")


# ------------------------------------------------------------------------------------------------ sampling
def filter_top_k_top_p(scaled, top_k, top_p):
    """Masks (to -inf) tokens outside top-k, then outside top-p of the renormalised top-k distribution.

    scaled [B, V] fp32 (logits / temperature); top_k [B] int (<= 0: off); top_p [B] float (1: off). The most
    likely token is always kept; tokens tied with the last kept one are kept too.
    """
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    ranks = jnp.arange(vocab)[None]
    in_top_k = (top_k[:, None] <= 0) | (ranks < top_k[:, None])  # [B, V] over sorted positions
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly above each sorted position
    keep = in_top_k & ((before < top_p[:, None]) | (ranks == 0))
    num_kept = jnp.sum(keep, axis=-1)  # [B] >= 1
    threshold = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: the Weyl increment between a row's counters


def _mix32(x):
    """A bijective avalanche mix of uint32 values (xor-shift-multiply rounds, MurmurHash3's finaliser)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def hash_uniform(seed, sample_index, step, vocab: int):
    """Uniforms in (0, 1) [B, vocab], one per (row, token id), from counters: each row's key mixes its (seed,
    sample index, step) [B]; element j is mix(key + (j + 1) * golden) (a Weyl sequence through an avalanche mix,
    as SplitMix does), 24 bits. Elementwise integer work that XLA fuses into its consumer: no random state and
    no [B, vocab] buffer of noise in memory, unlike a threefry draw per row."""
    key = _mix32(_mix32(_mix32(seed.astype(jnp.uint32) ^ jnp.uint32(0x2545F491)) ^ sample_index.astype(jnp.uint32))
                 + step.astype(jnp.uint32) * jnp.uint32(_GOLDEN))
    counters = (jnp.arange(1, vocab + 1, dtype=jnp.uint32) * jnp.uint32(_GOLDEN))[None]
    bits = _mix32(_mix32(key[:, None] + counters))
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


NOISES = ("hash", "threefry")


def sample_tokens(logits, cfg, count, *, filtered: bool, noise: str = "hash"):
    """(tokens [B], logprobs [B]) for one decode step. logits [B, V]; cfg: per-slot sampling arrays; count [B]:
    tokens each slot has sampled so far (the step index of its random stream). noise: where the Gumbel noise's
    uniforms come from, "hash" (`hash_uniform`, the default) or "threefry" (jax.random, one key per row and step:
    a [B, V] draw each step)."""
    logits = logits.astype(jnp.float32)
    greedy = cfg["temperature"] <= 0
    scaled = logits / jnp.where(greedy, 1.0, cfg["temperature"])[:, None]  # [B, V]
    # the trainer's distribution, before truncation: log_softmax at the chosen token
    log_norm = jax.nn.logsumexp(scaled, axis=-1)  # [B]
    candidates = filter_top_k_top_p(scaled, cfg["top_k"], cfg["top_p"]) if filtered else scaled
    if noise == "hash":
        gumbel = -jnp.log(-jnp.log(hash_uniform(cfg["seed"], cfg["sample_index"], count, scaled.shape[-1])))
    elif noise == "threefry":
        def draw(seed, sample_index, step):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample_index), step)
            return jax.random.gumbel(key, scaled.shape[-1:], jnp.float32)

        gumbel = jax.vmap(draw)(cfg["seed"], cfg["sample_index"], count)  # [B, V]
    else:
        raise ValueError(f"unknown sampling noise {noise!r}; expected one of {NOISES}")
    sampled = jnp.argmax(candidates + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    token_logprobs = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - log_norm
    return tokens, token_logprobs


# ------------------------------------------------------------------------------------------------ requests
@dataclasses.dataclass(eq=False)
class _Request:
    prompt: list[int]
    n: int
    budget: int  # max new tokens: min(max_tokens, max_len - len(prompt))
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset
    seed: int
    future: asyncio.Future
    images: tuple = ()  # PreparedImage of the prompt, in order (vision-language models only)
    rope: np.ndarray | None = None  # [3, len(prompt) - 1] mRoPE positions of the prompt pass, with images
    rope_offset: int = 0  # rotary position - cache index of every later token (0 for text)
    tokens: list = dataclasses.field(default_factory=list)  # per sample
    logprobs: list = dataclasses.field(default_factory=list)
    finish: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)  # per sample: the version served when admitted
    token_versions: list = dataclasses.field(default_factory=list)  # per sample: the version of each token
    remaining: int = 0  # samples not finished

    def __post_init__(self):
        self.tokens = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.finish = [None] * self.n
        self.versions = [None] * self.n
        self.token_versions = [[] for _ in range(self.n)]
        self.remaining = self.n

    @property
    def dead(self) -> bool:
        return self.future.done()  # cancelled by the caller (or already answered)


class JaxSampler(GenerationBackend):
    """Embedded continuous-batching sampler for a `CausalLM` or `Qwen2_5_VLCausalLM` and its params
    (`load_pretrained` output).

    Options:
      max_slots: sequences decoded together (the decode batch); more wait for a free slot.
      max_len: tokens per sequence, prompt included (default min(max_position_embeddings, 2048)).
      steps_per_call: decode steps per jitted call (fewer host round trips; a finished sequence's slot idles
        for up to about twice this many steps before it is reused, since the next call is already queued).
      prefill_tokens: prompt tokens per batched prompt pass (rows = prefill_tokens // bucket length, <= 16, and
        no more than max_slots rounded up to a power of two).
      min_bucket: the smallest prompt / attention-window bucket.
      max_stop_tokens: stop ids a request may give (a static shape).
      prefill_patches: image patches per prompt pass (vision-language models): a pass takes prompts while their
        images fit; a prompt with more goes alone.
      min_patch_bucket: the smallest patch bucket (a power of two) of a prompt pass with images.
      cache_dtype: KV cache dtype (default: the model's compute dtype).
      prefix_caching: keep a finished sequence's KV in its slot ("parked") and start a later prompt that begins
        with the same tokens from it, prefilling only the rest; identical prompts admitted together share one
        prompt pass (see the module docstring). Greedy outputs equal those without it.
      prefix_min_tokens: the shortest shared prefix worth reusing (a prompt shorter than this reuses only a full
        match).
      seed: seeds requests that give none (each then gets a fresh draw from this generator).
      sampling_noise: "hash" (counter-based Gumbel noise, fused into the sampling kernel) or "threefry"
        (jax.random, a [slots, vocab] draw every step); both seeded per sequence and token.
      decode_attention: attention of decode steps over the KV cache: "auto" or "xla" (einsum over the
        attention-window bucket; the faster on an H200, docs/benchmarks.md), "pallas" (jax's Pallas GPU decode kernel,
        reading each slot's keys up to its own length; the cache is then a multiple of 256 positions long, one
        decode program per steps/filter pair instead of one per window bucket) or "pallas_interpret" (the same
        kernel interpreted: CPU tests). Prompt passes always use the einsum.
      fuse_projections: serve the weights with each layer's q/k/v projections joined into one GEMM and the
        MLP's gate/up into another (`decode.fuse_projections`, redone at every weight update): fewer, larger
        GEMMs per decode step (on an H200 at the Qwen2.5-0.5B shape, 7-10% faster decode steps at 64 and 256
        slots, docs/benchmarks.md). True runs on one device only; "auto" (the default): True on one device, False
        on a tensor-parallel mesh (a joined kernel's heads would mix q, k and v across the shards).
      gpu_gemm: how every program's matrix products compile on a GPU (`models.config.gpu_compiler_options`):
        "triton" (XLA's default: its Triton GEMM fusions where the autotuner picks them), "cublas", or
        "triton_exhaustive" (the autotuner tries every tiling: longer compilations; on an H200 decode steps at 64
        slots took 8% less GPU time, docs/benchmarks.md); no effect on other backends.
      device: the jax device to run on (default: the first).
      tensor_parallel: run over this many local devices (the first ones), the model split over them (module
        docstring); 1: one device.
      mesh: or the mesh to run on, its "tensor" axis its only one of more than one device (its devices local to
        this process). At most one of device, mesh and tensor_parallel > 1.
    """

    def __init__(self, model: CausalLM | Qwen2_5_VLCausalLM, params, *, max_slots: int = 64,
                 max_len: int | None = None, steps_per_call: int = 8, prefill_tokens: int = 8192, min_bucket: int = 16,
                 max_stop_tokens: int = 8, prefill_patches: int = 8192, min_patch_bucket: int = 256,
                 cache_dtype=None, prefix_caching: bool = True, prefix_min_tokens: int = 16, seed: int = 0,
                 sampling_noise: str = "hash", decode_attention: str = "auto", fuse_projections: bool | str = "auto",
                 gpu_gemm: str = "triton", device=None, tensor_parallel: int = 1, mesh: Mesh | None = None):
        if not isinstance(model, (CausalLM, Qwen2_5_VLCausalLM)):
            raise TypeError(f"JaxSampler needs an agentfly_jax CausalLM or Qwen2_5_VLCausalLM, got "
                            f"{type(model).__name__}")
        config = model.config
        self.model = model
        #: whether generate takes images (the backend contract of chains with images): a vision-language policy
        self.supports_images = isinstance(model, Qwen2_5_VLCausalLM)
        if min_patch_bucket < 1 or min_patch_bucket & (min_patch_bucket - 1) or prefill_patches < 1:
            raise ValueError(f"JaxSampler needs min_patch_bucket a power of two and prefill_patches >= 1; got "
                             f"{min_patch_bucket}, {prefill_patches}")
        self.prefill_patches = int(prefill_patches)
        self.min_patch_bucket = max(int(min_patch_bucket), config.vision.merge_unit if config.vision else 1)
        self.max_slots = int(max_slots)
        self.max_len = int(max_len or min(config.max_position_embeddings, 2048))
        self.steps_per_call = int(steps_per_call)
        self.max_stop_tokens = int(max_stop_tokens)
        if self.max_slots < 1 or self.max_len < 2 or self.steps_per_call < 1 or min_bucket < 1:
            raise ValueError(f"JaxSampler needs max_slots >= 1, max_len >= 2, steps_per_call >= 1, "
                             f"min_bucket >= 1;"
                             f" got {max_slots}, {max_len}, {steps_per_call}, {min_bucket}")
        if prefix_min_tokens < 1:
            raise ValueError(f"JaxSampler needs prefix_min_tokens >= 1, got {prefix_min_tokens}")
        self.prefix_caching = bool(prefix_caching)
        if sampling_noise not in NOISES:
            raise ValueError(f"JaxSampler sampling_noise must be one of {NOISES}, got {sampling_noise!r}")
        self.sampling_noise = sampling_noise
        # "auto" is the einsum: on an H200 it was as fast as the Pallas kernel at 64 slots and faster at 256
        # (docs/benchmarks.md, "Embedded sampler decode")
        decode_attention = "xla" if decode_attention == "auto" else decode_attention
        if decode_attention not in decode.ATTENTIONS:
            raise ValueError(f"JaxSampler decode_attention must be 'auto' or one of {decode.ATTENTIONS}, got "
                             f"{decode_attention!r}")
        if decode_attention != "xla" and (mesh is not None or tensor_parallel > 1):
            raise ValueError(f"JaxSampler decode_attention={decode_attention!r} runs on one device; a tensor-parallel "
                             "sampler takes 'xla' (or 'auto')")
        self.decode_attention = decode_attention
        if fuse_projections not in (True, False, "auto"):
            raise ValueError(f"JaxSampler fuse_projections must be True, False or 'auto', got {fuse_projections!r}")
        if fuse_projections is True and (mesh is not None or tensor_parallel > 1):
            raise ValueError("JaxSampler fuse_projections=True runs on one device: under a tensor-parallel mesh a "
                             "joined kernel's heads would mix q, k and v across the shards (use 'auto' or False)")
        #: how the programs' matrix products compile on a GPU (`models.config.GPU_GEMMS`)
        self.gpu_gemm = gpu_gemm
        self._compiler_options = gpu_compiler_options(gpu_gemm)  # checks the name too
        self.prefix_min_tokens = int(prefix_min_tokens)
        #: the mesh the programs run on (None: one device); its "tensor" axis splits the model
        self.mesh = _sampler_mesh(device, tensor_parallel, mesh)
        self.tensor_parallel = 1 if self.mesh is None else self.mesh.shape.get("tensor", 1)
        #: whether the served weights have q/k/v and gate/up joined (`decode.fuse_projections`)
        self.fuse_projections = self.mesh is None if fuse_projections == "auto" else fuse_projections
        self.device = device or (jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0])
        # where host inputs go: the device, or replicated over the mesh
        self._inputs = self.device if self.mesh is None else NamedSharding(self.mesh, P())
        self._param_target = (self.device if self.mesh is None else
                              sharding.param_shardings(model, params, self.mesh, _SAMPLER_RULES))
        self.buckets = _pow2_buckets(min(min_bucket, self.max_len), self.max_len)  # prompt lengths and windows
        #: attention windows of decode calls (einsum attention): half an octave apart (`_window_buckets`)
        self.window_buckets = _window_buckets(self.buckets[0], self.max_len)
        self.prefill_tokens = int(prefill_tokens)
        self.weight_version = 0
        self.compile_counts: collections.Counter = collections.Counter()
        # decode_calls, decode_steps, prefill_calls, images (encoded by prompt passes), tokens, weight_updates, ...
        # interrupted_sequences, drain_wait_s, prompt_tokens, prefill_tokens, prefix_hits, prefix_tokens_reused, ...
        self.stats = collections.Counter()
        self._param_ref = None  # shapes and dtypes of the served tree as callers give it (unfused)
        self._params = self._place_params(params)
        self._rng = np.random.default_rng(seed)
        cache_dtype = cache_dtype or config.dtype

        b = self.max_slots

        def init_state():  # positions: cache index of each slot's next token; rope_offset: rotary position - that
            return {"tokens": jnp.zeros(b, jnp.int32), "positions": jnp.zeros(b, jnp.int32),
                    "rope_offset": jnp.zeros(b, jnp.int32), "count": jnp.zeros(b, jnp.int32),
                    "done": jnp.ones(b, bool)}

        # the Pallas kernel takes whole splits of the sequence: positions past max_len are never used
        self._cache_len = (self.max_len if self.decode_attention == "xla" else
                           decode.pallas_cache_length(self.max_len))
        if self.mesh is None:
            self._cache_sharding = None
            with jax.default_device(self.device):
                self._cache = decode.init_cache(config, b, self._cache_len, cache_dtype)
                self._state = init_state()
            # committed to the device, as every later cache and state (program outputs) is: else the first call of
            # a program would compile it for uncommitted inputs and the next call once more
            self._cache, self._state = jax.device_put((self._cache, self._state), self.device)
        else:  # made in place, split over kv heads: the whole cache never sits on one device
            with self._tracing():  # under the mesh the cache may hold each kv head several times (decode docstring)
                shape = jax.eval_shape(
                    lambda: decode.init_cache(config, b, self._cache_len, cache_dtype))["k"][0].shape
                self._cache_sharding = NamedSharding(self.mesh, sharding.spec_for_shape(
                    P(*decode.CACHE_AXES), shape, self.mesh, _SAMPLER_RULES))
                self._cache, self._state = jax.jit(
                    lambda: (decode.init_cache(config, b, self._cache_len, cache_dtype), init_state()),
                    out_shardings=(self._cache_sharding, self._inputs))()
        # Per-slot sampling settings, kept on the host and uploaded when they change.
        self._cfg = {"temperature": np.zeros(b, np.float32), "top_p": np.ones(b, np.float32),
                     "top_k": np.zeros(b, np.int32), "stops": np.full((b, self.max_stop_tokens), -1, np.int32),
                     "budget": np.zeros(b, np.int32), "seed": np.zeros(b, np.uint32),
                     "sample_index": np.zeros(b, np.int32), "alive": np.zeros(b, bool)}
        self._cfg_device = None
        self._owners: list[tuple[_Request, int] | None] = [None] * b
        self._pos_bound = np.zeros(b, np.int64)  # upper bound on each slot's device position
        self._waiting: collections.deque[tuple[_Request, int]] = collections.deque()
        self._open: set[_Request] = set()  # every request not answered yet, wherever it is
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._admission_paused = 0  # updates (interrupt=False) waiting for the sequences in flight to finish
        self._drained: asyncio.Event | None = None  # set when the last occupied slot is released
        self._update_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        # Prefix caching, on the host: the token ids whose keys/values each slot's cache row holds (positions
        # [0, _slot_valid) hold _slot_ids[:_slot_valid], computed by the params served now) where _slot_share is
        # set: a text sequence in flight, or a finished one parked (_parked: its LRU tick, -1 when not parked).
        self._slot_ids = np.zeros((b, self.max_len), np.int32)
        self._slot_valid = np.zeros(b, np.int64)
        self._slot_share = np.zeros(b, bool)
        self._parked = np.full(b, -1, np.int64)
        self._tick = 0
        self._build_programs()

    # ---------------------------------------------------------------------------------------- jitted programs
    def _build_programs(self):
        model, counts, max_len = self.model, self.compile_counts, self.max_len

        def prefill_images(params, tokens, rope_positions, pixel_values, layout):
            # tokens [P, T], rope_positions [3, P, T], pixel_values [N, patch_dim], layout: VisionLayout over N
            counts["prefill_images"] += 1
            _, prompt_cache = decode.prefill(model, params, tokens, cache_dtype=self._cache["k"][0].dtype,
                                             rope_positions=rope_positions, pixel_values=pixel_values,
                                             vision_layout=layout)
            return prompt_cache

        def insert(cache, state, prompt_cache, row, slot, last_token, position, rope_offset):
            counts["insert"] += 1
            cache = decode.copy_into(cache, prompt_cache, row, slot)
            state = {"tokens": state["tokens"].at[slot].set(last_token),
                     "positions": state["positions"].at[slot].set(position),
                     "rope_offset": state["rope_offset"].at[slot].set(rope_offset),
                     "count": state["count"].at[slot].set(0), "done": state["done"].at[slot].set(False)}
            return cache, state

        def decode_call(params, cache, state, cfg, kv_len, filtered, steps):
            counts["decode"] += 1

            def step(carry, _):
                cache, st = carry
                active = cfg["alive"] & ~st["done"]  # [B]
                logits, cache = decode.decode_step(model, params, cache, st["tokens"], st["positions"],
                                                   kv_len=kv_len, rope_positions=st["positions"] + st["rope_offset"],
                                                   attention=self.decode_attention)
                with jax.named_scope("sampling"):
                    tokens, logprobs = sample_tokens(logits, cfg, st["count"], filtered=filtered,
                                                     noise=self.sampling_noise)
                count = st["count"] + active.astype(jnp.int32)
                stopped = jnp.any(cfg["stops"] == tokens[:, None], axis=-1)
                done = st["done"] | (active & (stopped | (count >= cfg["budget"])))
                st = {"tokens": jnp.where(active, tokens, st["tokens"]),
                      "positions": jnp.minimum(st["positions"] + active.astype(jnp.int32), max_len - 1),
                      "rope_offset": st["rope_offset"], "count": count, "done": done}
                return (cache, st), (tokens, logprobs, active)

            (cache, state), (tokens, logprobs, valid) = jax.lax.scan(step, (cache, state), None, length=steps)
            return cache, state, {"tokens": tokens, "logprobs": logprobs, "valid": valid}  # each [steps, B]

        def prefill(params, cache, tokens, rows, starts, kv_len):  # text prompts, straight into their slots' rows
            counts["prefill"] += 1  # runs only while tracing: one per compiled shape
            return decode.prefill_rows(model, params, cache, tokens, rows, starts, kv_len=kv_len)

        def prefill_fresh(params, tokens):  # tokens [P, T]; text prompts without prefix caching
            counts["prefill"] += 1
            _, prompt_cache = decode.prefill(model, params, tokens, cache_dtype=self._cache["k"][0].dtype)
            return prompt_cache

        def start(cache, state, src, dst, copies, slots, last_token, position, rope_offset):
            # [max_slots] each: copies cache row src[i] -> dst[i] for i < copies, one row at a time (one program
            # whatever the count), then starts decoding in `slots` (padding: max_slots, dropped)
            counts["start"] += 1
            cache = jax.lax.fori_loop(0, copies, lambda i, c: decode.copy_row(c, src[i], dst[i]), cache)
            state = {"tokens": state["tokens"].at[slots].set(last_token, mode="drop"),
                     "positions": state["positions"].at[slots].set(position, mode="drop"),
                     "rope_offset": state["rope_offset"].at[slots].set(rope_offset, mode="drop"),
                     "count": state["count"].at[slots].set(0, mode="drop"),
                     "done": state["done"].at[slots].set(False, mode="drop")}
            return cache, state

        cache, rep = self._cache_sharding, self._inputs
        self._prefill = self._jit(prefill, cache, static_argnums=(5,), donate_argnums=(1,))
        self._prefill_fresh = self._jit(prefill_fresh, cache)
        self._start = self._jit(start, (cache, rep), donate_argnums=(0, 1))
        self._prefill_images = self._jit(prefill_images, cache)
        self._insert = self._jit(insert, (cache, rep), donate_argnums=(0, 1))
        self._decode = self._jit(decode_call, (cache, rep, rep), static_argnums=(4, 5, 6), donate_argnums=(1, 2))

    def _jit(self, fn, out_shardings, **options):
        """jax.jit of a program; on a mesh, traced with the mesh and the logical axis rules active (the activation
        constraints of `decode.extend` and the model) and its outputs pinned to the cache's and state's layouts
        (so a donated cache is updated in place and no call reshards it). Every program compiles its matrix
        products as `gpu_gemm` says."""
        options = dict(options, compiler_options=self._compiler_options)
        if self.mesh is None:
            return jax.jit(fn, **options)

        @functools.wraps(fn)
        def on_mesh(*args):
            with self._tracing():
                return fn(*args)

        return jax.jit(on_mesh, out_shardings=out_shardings, **options)

    @contextlib.contextmanager
    def _tracing(self):
        """The sampler's mesh (abstract: usable inside jit) and logical axis rules, active while tracing."""
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), sharding.axis_rules(_SAMPLER_RULES):
            yield

    @property
    def num_compiles(self) -> int:
        """Programs traced so far (prompt passes, slot inserts and decode calls)."""
        return sum(self.compile_counts.values())

    # ---------------------------------------------------------------------------------------- public API
    async def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: Sequence[int] = (), n: int = 1,
                       seed: int | None = None, images: Sequence[PreparedImage] = ()) -> list[Completion]:
        """Samples `n` continuations; see the module docstring for the sampling and logprob conventions.

        images: the prompt's images in order, one per run of `<|image_pad|>` ids (vision-language models only).
        """
        request = self._make_request(prompt_token_ids, max_tokens, temperature, top_p, top_k, stop_token_ids,
                                     n, seed, images)
        self._ensure_running()
        self._open.add(request)
        request.future.add_done_callback(lambda _: self._open.discard(request))
        self._waiting.extend((request, i) for i in range(request.n))
        self._wakeup.set()
        return await request.future

    async def update_weights(self, params, version: int, *, interrupt: bool = False,
                             keep_prefix_cache: bool = False) -> None:
        """Serves `params` as `version` (same tree, shapes and dtypes: no recompilation); see the module docstring.

        interrupt=False waits until the sequences in flight have finished on the old weights (admitting none
        meanwhile) and returns at once when none are; interrupt=True swaps before the next decode call and the
        sequences in flight go on with the new weights. Raises RuntimeError if the decode loop fails while this
        waits; if the sampler is closed meanwhile, the new params are installed and this returns.
        keep_prefix_cache=False (the default) drops every cached prefix (their keys/values are the old weights');
        True keeps them for later prompts to continue, as a partial rollout continues its KV (module docstring).
        """
        loop = asyncio.get_running_loop()
        if self._update_lock is None or self._update_lock[0] is not loop:
            self._update_lock = (loop, asyncio.Lock())
        async with self._update_lock[1]:  # one update at a time, in call order
            if interrupt:
                self.stats["interrupted_sequences"] += self._in_flight()
            else:
                await self._drain(loop)
            self._install(params, version, keep_prefix_cache)

    def _install(self, params, version: int, keep_prefix_cache: bool = False):
        self._params = self._place_params(params)
        self.weight_version = int(version)
        self.stats["weight_updates"] += 1
        if not keep_prefix_cache:  # computed by the old weights: no later prompt may continue them
            self.stats["prefix_invalidated"] += int((self._parked >= 0).sum())
            self._slot_share[:] = False
            self._slot_valid[:] = 0
            self._parked[:] = -1

    def _in_flight(self) -> int:
        """Sequences holding a slot whose caller still waits for them."""
        return sum(1 for owner in self._owners if owner is not None and not owner[0].dead)

    def _occupied(self) -> bool:
        return any(owner is not None for owner in self._owners)

    async def _drain(self, loop):
        """Stops admission and waits until no slot is occupied, the decode loop has stopped or the sampler closed.
        Raises RuntimeError when the decode loop failed meanwhile."""
        task = self._task
        if not self._occupied() or task is None or task.done() or self._closed:
            return  # nothing in flight, or no decode loop that could still advance it
        if task.get_loop() is not loop:
            if task.get_loop().is_closed():
                return  # the event loop that ran those sequences is gone: none of them advances any more
            raise RuntimeError("JaxSampler is serving another running event loop; call update_weights from the "
                               "loop that runs its generate calls")
        self.stats["drained_sequences"] += self._in_flight()
        started = time.perf_counter()
        self._admission_paused += 1
        self._drained = asyncio.Event()
        try:
            while self._occupied() and not task.done() and not self._closed:
                self._drained.clear()
                drained = loop.create_task(self._drained.wait())
                try:  # the loop task ends (failure, close, cancellation) without releasing: never wait forever
                    await asyncio.wait([drained, task], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    drained.cancel()
        finally:
            self._admission_paused -= 1
            if not self._admission_paused:
                self._drained = None
                if self._wakeup is not None:
                    self._wakeup.set()  # admit the sequences that waited
            self.stats["drain_wait_s"] += time.perf_counter() - started
        if self._failure is not None:
            raise RuntimeError(f"JaxSampler decode loop failed while update_weights waited for the sequences in "
                               f"flight: {self._failure!r}") from self._failure

    async def health(self) -> dict:
        return {"ok": self._failure is None and not self._closed, "weight_version": self.weight_version,
                "active_slots": int(self._cfg["alive"].sum()), "waiting": len(self._waiting),
                "admission_paused": bool(self._admission_paused),
                "parked_slots": int((self._parked >= 0).sum()),
                "compiles": dict(self.compile_counts), "tensor_parallel": self.tensor_parallel,
                **({"error": repr(self._failure)} if self._failure else {})}

    async def close(self) -> None:
        """Stops the decode loop; requests still running get their tokens so far with finish_reason 'abort'."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._abort_all("abort")

    # ---------------------------------------------------------------------------------------- requests
    def _make_request(self, prompt, max_tokens, temperature, top_p, top_k, stop_ids, n, seed,
                      images=()) -> _Request:
        if self._closed:
            raise RuntimeError("JaxSampler is closed")
        if self._failure is not None:
            raise RuntimeError(f"JaxSampler's decode loop failed earlier: {self._failure!r}") from self._failure
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt_token_ids is empty; a prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}); got min {min(prompt)}, "
                             f"max {max(prompt)}")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_len={self.max_len}; "
                             "shorten it or build the sampler with a larger max_len")
        if max_tokens < 1 or n < 1:
            raise ValueError(f"max_tokens and n must be >= 1, got max_tokens={max_tokens}, n={n}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        stop_ids = frozenset(int(t) for t in stop_ids)
        if len(stop_ids) > self.max_stop_tokens:
            raise ValueError(f"{len(stop_ids)} stop token ids given; this sampler allows {self.max_stop_tokens} "
                             "(option max_stop_tokens)")
        images, rope, rope_offset = self._check_images(prompt, images)
        if seed is None:
            seed = int(self._rng.integers(0, 2 ** 32))
        return _Request(prompt=prompt, n=int(n), budget=min(int(max_tokens), self.max_len - len(prompt)),
                        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), stop_ids=stop_ids,
                        seed=int(seed) % 2 ** 32, future=asyncio.get_running_loop().create_future(),
                        images=images, rope=rope, rope_offset=rope_offset)

    def _check_images(self, prompt: list[int], images) -> tuple[tuple, np.ndarray | None, int]:
        """(images, mRoPE positions [3, len(prompt) - 1] of the prompt pass, rotary offset) of a prompt; (), None,
        0 for a text prompt. Raises when the images do not fit the model or the prompt's image pad tokens."""
        images = tuple(images or ())
        vision = self.model.config.vision
        if not self.supports_images:
            if images:
                raise ValueError(f"this JaxSampler serves a text-only {type(self.model).__name__}, which cannot see "
                                 f"images; got {len(images)} with the prompt. Serve a Qwen2.5-VL policy "
                                 "(load_pretrained of a Qwen2_5_VLForConditionalGeneration checkpoint) or send the "
                                 "prompt without images")
            return (), None, 0
        for i, image in enumerate(images):
            if not isinstance(image, PreparedImage):
                raise TypeError(f"images[{i}] is a {type(image).__name__}; JaxSampler takes PreparedImage "
                                "(agentfly_jax.images.prepare_image)")
            geometry = (image.patch_size, image.temporal_patch_size, image.merge_size)
            expected = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
            if geometry != expected:
                raise ValueError(f"images[{i}] is cut into patches of (patch_size, temporal_patch_size, merge_size)"
                                 f" = {geometry} but the model's vision tower takes {expected}; prepare the images "
                                 "with ImageSettings matching the model's vision config")
        pads = prompt.count(vision.image_token_id)
        needed = [image.num_tokens for image in images]
        if pads != sum(needed):
            raise ValueError(f"the prompt holds {pads} image pad tokens (<|image_pad|>, id {vision.image_token_id})"
                             f" but its {len(images)} image(s) take {sum(needed)} ({needed}); pass all of the "
                             "prompt's images, in order, prepared with the settings that expanded its pads")
        if not images:
            return (), None, 0
        if prompt[-1] == vision.image_token_id:
            raise ValueError("the prompt ends inside an image (its last token is <|image_pad|>); an image's pads "
                             "are followed by <|vision_end|> and the generation prompt")
        grid = np.array([image.grid_thw for image in images], np.int64)
        positions = mrope_positions(self.model.config, np.asarray(prompt)[None], grid)[:, 0]  # [3, L]
        return images, positions[:, :-1], int(positions.max()) + 1 - len(prompt)

    def _place_params(self, params):
        """Params on the sampler's device (fused with `fuse_projections`); after the first call, checks the
        structure and shapes against the first tree's and casts to its dtypes."""
        reference = self._param_ref
        if reference is not None:
            ref_tree = jax.tree.structure(reference)
            new_flat, new_tree = jax.tree.flatten(params)
            if ref_tree != new_tree:
                raise ValueError("update_weights got a param tree of a different structure than the sampler's")
            for path_ref, new in zip(jax.tree_util.tree_leaves_with_path(reference), new_flat):
                path, ref = path_ref
                if tuple(ref.shape) != tuple(new.shape):
                    raise ValueError(f"update_weights: param {jax.tree_util.keystr(path)} has shape "
                                     f"{tuple(new.shape)}, the sampler's has {tuple(ref.shape)}")
            params = jax.tree.map(lambda new, ref: jnp.asarray(new, dtype=ref.dtype), params, reference)
        # Always a copy: the trainer donates its param buffers to the next update step. `device_put` copies a
        # single-device array, but hands over existing shards where it can (may_alias or not): an array replicated
        # on several devices including the sampler's, or sharded on the trainer's mesh as the sampler's mesh splits
        # it on the same devices. Leaves sharing a buffer with their source are copied explicitly, else the
        # trainer's next update would delete the sampler's weights while it decodes (asynchronous training).
        placed = jax.device_put(params, self._param_target, may_alias=False)
        placed = jax.tree.map(lambda src, out: out.copy() if _shares_buffers(src, out) else out, params, placed)
        if reference is None:
            self._param_ref = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)
        # the placed copies are the sampler's own: each layer's joined parts are freed as soon as they are joined
        return decode.fuse_projections(placed, free_parts=True) if self.fuse_projections else placed

    # ---------------------------------------------------------------------------------------- the decode loop
    def _ensure_running(self):
        loop = asyncio.get_running_loop()
        if self._task is not None and self._task.get_loop() is loop and not self._task.done():
            return
        if self._task is not None and self._task.get_loop() is not loop:
            if not self._task.get_loop().is_closed():
                raise RuntimeError("JaxSampler is already serving another running event loop")
            log.warning("JaxSampler: the event loop of its decode task is gone; dropping its requests")
            self._abort_all("abort")
        self._wakeup = asyncio.Event()
        self._task = loop.create_task(self._run(), name="JaxSampler.decode_loop")

    async def _run(self):
        pending = None  # (outputs, owners) of the decode call dispatched last, not yet read back
        try:
            while True:
                self._admit()
                dispatched = self._dispatch() if self._cfg["alive"].any() else None
                if pending is not None:
                    outputs = await asyncio.to_thread(jax.device_get, pending[0])
                    self._collect(outputs, *pending[1:])
                pending = dispatched
                if pending is None and (not self._waiting or self._admission_paused):
                    self._wakeup.clear()
                    await self._wakeup.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every waiting caller must learn about it
            log.exception("JaxSampler decode loop failed")
            self._failure = exc
            self._abort_all(exc)

    def _free_slots(self) -> list[int]:
        return [s for s, owner in enumerate(self._owners) if owner is None]

    def _release_dead(self):
        for slot, owner in enumerate(self._owners):
            if owner is not None and owner[0].dead:
                self._release(slot)
        while self._waiting and self._waiting[0][0].dead:
            self._waiting.popleft()

    def _release(self, slot: int, park: bool = False):
        """Frees a slot. park=True keeps its cached prefix for later prompts (a finished text sequence whose
        keys/values are all the current weights'); otherwise the slot holds nothing reusable."""
        if park and self._slot_share[slot]:
            self._parked[slot] = self._tick
            self._tick += 1
        else:
            self._slot_share[slot] = False
            self._slot_valid[slot] = 0
            self._parked[slot] = -1
        self._owners[slot] = None
        self._cfg["alive"][slot] = False
        self._cfg_device = None
        if self._drained is not None and not self._occupied():
            self._drained.set()  # an update waiting for the sequences in flight can swap now

    def _admit(self):
        """Moves waiting sequences into free slots (parked ones count as free: least recently parked first). With
        prefix caching, text prompts go through `_admit_text`; prompts with images, and every prompt without it,
        through `_admit_fresh`."""
        self._release_dead()
        if self._admission_paused:
            return  # a weight update waits for the sequences in flight; the waiting ones start on the new weights
        free = self._free_slots()
        if not free or not self._waiting:
            return
        admitted: list[tuple[_Request, int]] = []
        while len(admitted) < len(free) and self._waiting:
            request, sample = self._waiting.popleft()
            if not request.dead:
                admitted.append((request, sample))
        if not self.prefix_caching:
            self._admit_fresh([(request, sample, slot) for (request, sample), slot in zip(admitted, free)])
            return
        pool = self._admit_text([a for a in admitted if not a[0].images], free)
        with_images = [a for a in admitted if a[0].images]
        if with_images:  # never cached: their prompt passes run the vision tower (module docstring)
            self._admit_fresh([(request, sample, self._take(pool)) for request, sample in with_images])

    def _admit_fresh(self, admitted: list[tuple[_Request, int, int]]):
        """Prompt passes on fresh caches, one per length bucket (and patch budget, with images; a request's samples
        share one), then a KV copy into each sequence's slot."""
        by_prompt: dict[int, list] = {}
        for request, sample, slot in admitted:
            by_prompt.setdefault(id(request), []).append((request, sample, slot))
        groups = sorted(by_prompt.values(), key=lambda g: len(g[0][0].prompt))
        by_bucket: dict[tuple[int, bool], list] = {}
        for group in groups:
            need = len(group[0][0].prompt) - 1
            self.stats["prompt_tokens"] += need * len(group)
            self.stats["prefill_tokens"] += need
            self.stats["prefix_shared"] += len(group) - 1
            self.stats["prefix_tokens_reused"] += need * (len(group) - 1)
            # The prompt pass covers all but the last prompt token; the first decode step feeds that one.
            prefix = max(need, 1)
            by_bucket.setdefault((_bucket(self.buckets, prefix), bool(group[0][0].images)), []).append(group)
        for (length, with_images), bucket_groups in by_bucket.items():
            rows = self._prefill_rows_per_pass(length)
            if not with_images:
                for start in range(0, len(bucket_groups), rows):
                    self._prefill_and_insert(bucket_groups[start:start + rows], length, rows)
                continue
            passes: list[list] = [[]]
            patches = 0
            for group in bucket_groups:
                need = sum(image.num_patches for image in group[0][0].images)
                if passes[-1] and (len(passes[-1]) == rows or patches + need > self.prefill_patches):
                    passes.append([])
                    patches = 0
                passes[-1].append(group)
                patches += need
            for groups_of_pass in passes:
                self._prefill_and_insert(groups_of_pass, length, rows)

    def _prefill_rows_per_pass(self, length: int) -> int:
        """Rows of a prompt pass over `length`-token prompts: as many as `prefill_tokens` holds (at most 16), a
        power of two (one compiled shape per bucket), and never more than the slots can take (a pass holds one row
        per admitted prompt, and no more prompts are admitted at once than there are slots: rows past that would
        be padding computed for nothing)."""
        rows = max(1, min(16, self.prefill_tokens // length))
        rows = 1 << (rows.bit_length() - 1)
        return min(rows, _pow2_at_least(self.max_slots, 1))

    # ---------------------------------------------------------------------------------------- prefix caching
    def _take(self, pool: list[int]) -> int:
        """The next slot of an admission's pool (empty slots first, then parked ones, least recently parked
        first); a parked one loses its cached prefix."""
        slot = pool.pop(0)
        if self._parked[slot] >= 0:
            self.stats["prefix_evictions"] += 1
        self._parked[slot] = -1
        self._slot_share[slot] = False
        self._slot_valid[slot] = 0
        return slot

    def _longest_prefix(self, prompt: list[int], need: int, candidates: np.ndarray,
                        owned: np.ndarray) -> tuple[int, int]:
        """(slot, length) of the longest cached prefix of prompt[:need] among `candidates` (slots whose KV is
        tracked), parked slots first on ties; (-1, 0) when none reaches min(prefix_min_tokens, need)."""
        if need == 0 or candidates.size == 0:
            return -1, 0
        valid = self._slot_valid[candidates]
        width = int(min(need, valid.max()))
        if width == 0:
            return -1, 0
        equal = self._slot_ids[candidates, :width] == np.asarray(prompt[:width], np.int32)
        common = np.minimum(np.where(equal.all(axis=1), width, equal.argmin(axis=1)), valid)
        best = int(np.argmax(2 * common + ~owned[candidates]))
        length = int(common[best])
        if length < min(self.prefix_min_tokens, need):
            return -1, 0
        return int(candidates[best]), length

    def _admit_text(self, admitted: list[tuple[_Request, int]], free: list[int]) -> list[int]:
        """Starts text sequences with prefix caching; returns the free slots left (the pool).

        Identical prompts share one prompt pass (a request's n samples, and a GRPO group sent as separate
        requests). Each distinct prompt starts from the longest cached prefix among the parked and running
        sequences: a parked slot holding it becomes the prompt's own slot (nothing copied), a running one is
        copied; then a prompt pass computes only the rest (`decode.prefill_rows`, positions after the prefix).
        Device work runs in this order: copies from the cached prefixes (they read slots as they were before this
        admission), prompt passes, then one call copying each prompt's slot into the slots of its other
        sequences and starting them all.
        """
        groups: dict[tuple, list[tuple[_Request, int]]] = {}
        for request, sample in admitted:
            groups.setdefault(tuple(request.prompt), []).append((request, sample))
        candidates = np.flatnonzero(self._slot_share)  # none without prefix caching
        owned = np.array([owner is not None for owner in self._owners])
        plans = []
        for members in groups.values():
            prompt = members[0][0].prompt
            need = len(prompt) - 1  # the first decode step feeds the last prompt token
            plans.append((members, prompt, need, *self._longest_prefix(prompt, need, candidates, owned)))
        reserved = {src for *_, src, _ in plans if src >= 0 and not owned[src]}  # parked slots read this round
        pool = sorted((s for s in free if s not in reserved), key=lambda s: (self._parked[s] >= 0, self._parked[s]))
        claimed: set[int] = set()
        copies_before, passes, copies_after, started = [], [], [], []
        for members, prompt, need, src, length in plans:
            if src in reserved and src not in claimed:
                primary = src  # the prompt continues the parked sequence in its own slot
                claimed.add(src)
            else:
                primary = self._take(pool)
                if src >= 0:
                    copies_before.append((src, primary))
            slots = [primary] + [self._take(pool) for _ in members[1:]]
            if length < need:
                passes.append((primary, prompt[length:need], length))
            copies_after += [(primary, slot) for slot in slots[1:]]
            started += [(request, sample, slot) for (request, sample), slot in zip(members, slots)]
            self.stats["prompt_tokens"] += need * len(members)
            self.stats["prefill_tokens"] += need - length
            self.stats["prefix_tokens_reused"] += need * len(members) - (need - length)
            self.stats["prefix_hits"] += int(length > 0)
            self.stats["prefix_shared"] += len(members) - 1
        self._start_sequences(copies_before, [])  # before the passes overwrite any slot read here
        self._prefill_suffixes(passes)
        self._start_sequences(copies_after, started)
        for request, sample, slot in started:
            need = len(request.prompt) - 1
            self._slot_ids[slot, :need + 1] = request.prompt
            self._slot_valid[slot] = need
            self._slot_share[slot] = self.prefix_caching
            self._parked[slot] = -1
            self._assign(slot, request, sample)
        return pool

    def _prefill_suffixes(self, passes: list[tuple[int, list[int], int]]):
        """Prompt passes continuing slots: (slot, tokens, start) writes tokens at positions start... of the
        slot's row. Batched per suffix-length bucket (rows as for fresh prompts); the attention window of a pass
        is the bucket of its longest start + length."""
        by_length: dict[int, list] = {}
        for item in passes:
            by_length.setdefault(_bucket(self.buckets, max(len(item[1]), 1)), []).append(item)
        for length, items in by_length.items():
            rows = self._prefill_rows_per_pass(length)
            items.sort(key=lambda item: item[2] + len(item[1]))
            for first in range(0, len(items), rows):
                chunk = items[first:first + rows]
                tokens = np.zeros((rows, length), np.int32)
                slots = np.zeros(rows, np.int32)
                starts = np.full(rows, self._cache_len, np.int32)  # padding rows write nothing
                for r, (slot, suffix, start) in enumerate(chunk):
                    tokens[r, :len(suffix)] = suffix
                    slots[r], starts[r] = slot, start
                kv_len = _bucket(self.buckets, max(start + len(suffix) for _, suffix, start in chunk))
                self._cache = self._prefill(self._params, self._cache,
                                                 *jax.device_put((tokens, slots, starts), self._inputs), kv_len)
                self.stats["prefill_calls"] += 1

    def _start_sequences(self, copies: list[tuple[int, int]], started: list[tuple[_Request, int, int]]):
        """One call: copies whole cache rows (src, dst), then sets each started slot's decode state (its prompt's
        last token at position len(prompt) - 1, nothing sampled yet)."""
        if not copies and not started:
            return
        b = self.max_slots
        src, dst = np.zeros(b, np.int32), np.zeros(b, np.int32)
        if copies:
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
        slots = np.full(b, b, np.int32)  # padding: dropped
        last, position, rope = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, (request, _, slot) in enumerate(started):
            slots[i], last[i] = slot, request.prompt[-1]
            position[i], rope[i] = len(request.prompt) - 1, request.rope_offset
        self._cache, self._state = self._start(
            self._cache, self._state, *jax.device_put((src, dst, np.int32(len(copies)), slots, last, position, rope),
                                                      self._inputs))
        self.stats["prefix_copies"] += len(copies)

    def _prefill_and_insert(self, groups, length: int, rows: int):
        tokens = np.zeros((rows, length), np.int32)
        for r, group in enumerate(groups):
            prefix = group[0][0].prompt[:-1]
            tokens[r, :len(prefix)] = prefix
        requests = [group[0][0] for group in groups]
        if requests[0].images:
            prompt_cache = self._prefill_images(self._params, *self._vision_inputs(tokens, requests))
        else:
            prompt_cache = self._prefill_fresh(self._params, jax.device_put(tokens, self._inputs))
        self.stats["prefill_calls"] += 1
        for r, group in enumerate(groups):
            for request, sample, slot in group:
                prompt = request.prompt
                self._cache, self._state = self._insert(self._cache, self._state, prompt_cache, np.int32(r),
                                                        np.int32(slot), np.int32(prompt[-1]),
                                                        np.int32(len(prompt) - 1), np.int32(request.rope_offset))
                self._assign(slot, request, sample)

    def _vision_inputs(self, tokens: np.ndarray, requests: list[_Request]):
        """Device inputs of a prompt pass with images, after the params: tokens [rows, T], mRoPE positions
        [3, rows, T] (0 on padding), pixel values [N, patch_dim] of every row's images in row order (zero rows up
        to the power-of-two bucket N) and their VisionLayout."""
        rope = np.zeros((3, *tokens.shape), np.int32)
        for r, request in enumerate(requests):
            rope[:, r, :request.rope.shape[1]] = request.rope
        images = [image for request in requests for image in request.images]
        pixel_values = np.concatenate([image.pixel_values() for image in images])
        num_patches = _pow2_at_least(pixel_values.shape[0], self.min_patch_bucket)
        layout = vision_layout(self.model.config.vision, np.array([image.grid_thw for image in images]), num_patches)
        self.stats["images"] += len(images)
        return jax.device_put((tokens, rope, pad_patches(pixel_values, num_patches), layout), self._inputs)

    def _assign(self, slot: int, request: _Request, sample: int):
        cfg = self._cfg
        cfg["temperature"][slot] = request.temperature
        cfg["top_p"][slot] = request.top_p
        cfg["top_k"][slot] = request.top_k
        cfg["stops"][slot] = -1
        cfg["stops"][slot, :len(request.stop_ids)] = sorted(request.stop_ids)
        cfg["budget"][slot] = request.budget
        cfg["seed"][slot] = request.seed
        cfg["sample_index"][slot] = sample
        cfg["alive"][slot] = True
        self._cfg_device = None
        self._owners[slot] = (request, sample)
        self._pos_bound[slot] = len(request.prompt) - 1
        request.versions[sample] = self.weight_version

    def _dispatch(self):
        """Queues one decode call (steps_per_call steps) on the device; returns (outputs, owners snapshot, weight
        version of the params it runs), all taken now: by collect time the owners or the params may have changed."""
        alive = self._cfg["alive"]
        steps = self.steps_per_call
        need = int(self._pos_bound[alive].max()) + steps  # every position this call may touch is < need
        # the Pallas kernel reads each slot's keys up to its length whatever the window: one program for all
        kv_len = (self.max_len if self.decode_attention != "xla" else
                  _bucket(self.window_buckets, min(need, self.max_len)))
        filtered = bool(((self._cfg["top_p"] < 1.0) | (self._cfg["top_k"] > 0))[alive].any())
        if self._cfg_device is None:
            self._cfg_device = jax.device_put(self._cfg, self._inputs)
        self._cache, self._state, outputs = self._decode(self._params, self._cache, self._state, self._cfg_device,
                                                         kv_len, filtered, steps)
        self._pos_bound[alive] = np.minimum(self._pos_bound[alive] + steps, self.max_len - 1)
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += steps
        return outputs, list(self._owners), self.weight_version

    def _collect(self, outputs, owners, version):
        """Hands each slot's new tokens to its request, each marked with `version` (the params that sampled it);
        answers requests whose samples all finished."""
        tokens, logprobs, valid = outputs["tokens"], outputs["logprobs"], outputs["valid"]  # [steps, B]
        for slot in np.flatnonzero(valid.any(axis=0)):
            owner = owners[slot]
            if owner is None:
                continue
            request, sample = owner
            if request.finish[sample] is not None:
                raise AssertionError(f"slot {slot} produced tokens after its sequence finished")
            out_tokens, out_logprobs = request.tokens[sample], request.logprobs[sample]
            out_versions = request.token_versions[sample]
            before = len(out_tokens)
            for step in np.flatnonzero(valid[:, slot]):
                if request.finish[sample] is not None:
                    raise AssertionError(f"slot {slot} produced tokens after its sequence finished")
                token = int(tokens[step, slot])
                out_tokens.append(token)
                out_logprobs.append(float(logprobs[step, slot]))
                out_versions.append(version)
                if token in request.stop_ids:
                    request.finish[sample] = "stop"
                elif len(out_tokens) >= request.budget:
                    request.finish[sample] = "length"
            self.stats["tokens"] += int(valid[:, slot].sum())
            if self._slot_share[slot] and self._owners[slot] is owner:  # its cached prefix grows
                start = len(request.prompt) + before
                self._slot_ids[slot, start:start + len(out_tokens) - before] = out_tokens[before:]
                self._slot_valid[slot] = len(request.prompt) + len(out_tokens) - 1
            if request.finish[sample] is not None:
                if self._owners[slot] is owner:
                    self._release(slot, park=True)
                request.remaining -= 1
                if request.remaining == 0 and not request.future.done():
                    request.future.set_result(self._completions(request))

    @staticmethod
    def _completions(request: _Request, default_finish: str = "abort") -> list[Completion]:
        return [Completion(token_ids=list(request.tokens[i]), logprobs=list(request.logprobs[i]),
                           finish_reason=request.finish[i] or default_finish,
                           weight_version=(request.token_versions[i] or [request.versions[i]])[0],
                           token_versions=list(request.token_versions[i]))
                for i in range(request.n)]

    def _abort_all(self, reason):
        """Answers every open request: partial completions ('abort') or, given an exception, that error."""
        for request in list(self._open):
            if request.future.done() or request.future.get_loop().is_closed():
                continue
            if isinstance(reason, BaseException):
                request.future.set_exception(RuntimeError(f"JaxSampler decode loop failed: {reason!r}"))
            else:
                request.future.set_result(self._completions(request))
        self._open.clear()
        self._waiting.clear()
        for slot in range(self.max_slots):
            self._release(slot)


__all__ = ["JaxSampler", "filter_top_k_top_p", "sample_tokens"]
