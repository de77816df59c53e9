"""Fixtures of the trainer's tests."""
import pytest


@pytest.fixture
def faked_cli(monkeypatch):
    """`agentfly-train`'s main on the quickstart's :cpu config, its run faked: `faked_cli(train, start=None)`
    replaces `loop.train` (and `distributed.start`, by default a no-op) and calls the CLI's main."""
    from absl import flags

    from agentfly_jax import train as cli
    from agentfly_jax.trainer import distributed, loop
    from experiments.quickstart import get_config

    flags.FLAGS.mark_as_parsed()
    monkeypatch.setattr(flags.FLAGS["config"], "value", get_config("cpu"))

    def run(train, start=None):
        monkeypatch.setattr(distributed, "start", start or (lambda _config: None))
        monkeypatch.setattr(loop, "train", train)
        cli.main(["agentfly-train"])

    return run
