"""Entry point: `python -m agentfly_jax.train --config experiments/NAME.py [--config.key=value ...]`.

Each experiment file's docstring holds its exact command. `--config.workdir` chooses where TensorBoard
events, checkpoints and `summary.json` go; `--config.resume=True` continues from the last checkpoint there.
"""
from __future__ import annotations

import json
import logging
import sys

from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (experiments/*.py)",
                                          lock_config=True)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go through --config.key=value")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
    for noisy in ("absl", "jax", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=experiments/quickstart.py")
    from agentfly_jax.trainer.loop import train  # after flag parsing: keeps --help fast

    summary = train(config)
    print(json.dumps(summary, indent=2))
    if summary.get("success_after") is not None:
        print(f"\n{summary['algorithm']}: success {summary['success_before']:.2f} -> {summary['success_after']:.2f} "
              f"in {summary['steps']} RL steps, {summary['wall_seconds']:.0f}s. TensorBoard: "
              f"tensorboard --logdir {summary['workdir']}/tensorboard")


if __name__ == "__main__":
    app.run(main)
