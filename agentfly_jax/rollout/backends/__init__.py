"""Generation backends behind one async interface (`GenerationBackend`)."""
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend

__all__ = ["Completion", "GenerationBackend"]
