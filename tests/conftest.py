"""Test-wide setup: 8 fake CPU devices (sharding tests), fp32 matmuls, and tiny HF reference checkpoints."""
import os

import pytest

# Must happen before jax is imported anywhere: the sharding tests need a mesh of 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def search_subset_cache(tmp_path_factory):
    """A search cache directory over ~1,500 real Wikipedia summaries (tests/environments/search/subset.py):
    the dense and hybrid tests embed these instead of the whole corpus, once per test session."""
    from tests.environments.search.subset import build_subset_cache

    return build_subset_cache(tmp_path_factory.mktemp("search-subset"))
