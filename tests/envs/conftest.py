import pytest

from tests.envs import sandbox_helpers


@pytest.fixture(scope="module")
def loop():
    """One event loop per module, so a module's docker tests share one pool of warm containers."""
    yield from sandbox_helpers.new_loop()


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def backend(request, loop):
    sandbox_helpers.require_backend(loop, request.param)
    return request.param


@pytest.fixture
def session(loop, backend):
    """A persistent Python session in the backend's sandbox, closed after the test."""
    session = loop.run_until_complete(sandbox_helpers.open_session(backend))
    yield session
    loop.run_until_complete(session.close())
