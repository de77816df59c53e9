"""agentfly-jax: reinforcement learning for multi-turn, tool-using LLM agents on JAX."""

__version__ = "0.1.0"
