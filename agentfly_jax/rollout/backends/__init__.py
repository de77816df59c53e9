"""Generation backends behind one async interface (`GenerationBackend`)."""
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.rollout.backends.jax_sampler import JaxSampler
from agentfly_jax.rollout.backends.vllm import VLLMBackend, VLLMServerError

__all__ = ["Completion", "GenerationBackend", "JaxSampler", "VLLMBackend", "VLLMServerError"]
