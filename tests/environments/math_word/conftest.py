# The same per-module event loop and bwrap/docker backend parameters as the sandbox tests.
from tests.envs.conftest import backend, loop  # noqa: F401
