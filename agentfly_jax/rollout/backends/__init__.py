"""Generation backends behind one async interface (`GenerationBackend`)."""
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.rollout.backends.jax_sampler import JaxSampler
from agentfly_jax.rollout.backends.vllm import VLLMBackend, VLLMServerError
from agentfly_jax.rollout.backends.vllm_launcher import LocalVLLMServers, VLLMLaunchError

__all__ = ["Completion", "GenerationBackend", "JaxSampler", "LocalVLLMServers", "VLLMBackend", "VLLMLaunchError",
           "VLLMServerError"]
