"""Test-wide setup: 8 fake CPU devices (sharding tests), fp32 matmuls, and tiny HF reference checkpoints."""
import os

# Must happen before jax is imported anywhere: the sharding tests need a mesh of 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
