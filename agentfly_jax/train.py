"""Train an agent: `agentfly-train --config experiments/NAME.py[:ARG] [--config.key=value ...]`
(the same as `python -m agentfly_jax.train ...`).

Each experiment file's docstring holds its exact commands; `:cpu` picks an experiment's small variant that runs
on a CPU in minutes. `--config.workdir` chooses where TensorBoard events, checkpoints and `summary.json` go;
`--config.resume=True` continues from the last checkpoint there. A config key that is unknown, of the wrong
type or out of range stops the run before any work, with one line naming it.
"""
from __future__ import annotations

import json
import logging
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (experiments/*.py[:arg])",
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
    from agentfly_jax.trainer import distributed
    from agentfly_jax.trainer.config import ConfigError, TrainConfig

    try:  # validated once, before the trainer imports JAX models or builds anything
        typed = TrainConfig.build(config)
        distributed.start(typed)  # jax.distributed before any device work; the same config and code everywhere
    except (ConfigError, distributed.DistributedError) as e:
        _die(str(e))
    except KeyboardInterrupt as e:  # the watchdog's interrupt can come as soon as it runs (the end of `start`)
        _stopped_by_another(e)
    from agentfly_jax.trainer.loop import NonFiniteTrainingError, train  # after validation: keeps --help fast

    try:
        summary = train(typed)
    except ConfigError as e:  # found while building the run (environment, tools, pools), before training
        _die(str(e))
    except NonFiniteTrainingError as e:  # the run stopped itself; its scalars and earlier checkpoints are kept
        _die(f"training stopped: {e}", code=1)
    except distributed.DistributedError as e:  # another process of the run was lost or failed (docs/tpu.md)
        _die(f"training stopped: {e}", code=1)
    except KeyboardInterrupt as e:  # ... also before the trainer's loop handles its own errors
        _stopped_by_another(e)
    print(json.dumps(summary, indent=2))
    if summary.get("success_after") is not None:
        print(f"\n{summary['algorithm']}: success {summary['success_before']:.2f} -> {summary['success_after']:.2f} "
              f"in {summary['steps']} RL steps, {summary['wall_seconds']:.0f}s. TensorBoard: "
              f"tensorboard --logdir {summary['workdir']}/tensorboard")


def _stopped_by_another(interrupt: KeyboardInterrupt) -> None:
    """A KeyboardInterrupt outside the trainer's loop: the watchdog's, when another process of the run was lost or
    failed (then the one-line ProcessLostError and status 1, as from inside the loop); else Ctrl-C, raised on."""
    from agentfly_jax.trainer import distributed

    lost = distributed.stopped_by(interrupt)
    if lost is None:
        raise interrupt
    _die(f"training stopped: {lost}", code=1)


def _die(message: str, code: int = 2) -> None:
    print(f"agentfly-train: {message}", file=sys.stderr)
    sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a config override that names an unknown key (or has a bad value) reported in
    one line instead of ml-collections' traceback."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _die(str(e).splitlines()[0])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        text = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'").replace("\n", " ")
        overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
        # ml-collections names only the last path component; point at the override that holds it
        named = re.match(r"'?([A-Za-z_][\w]*)'?", text)
        culprit = next((o for o in overrides if named and o.split(".")[-1] == named.group(1)), None)
        where = f"{culprit.lstrip('-')}: " if culprit else ""
        _die(f"{where}bad --config override ({text}); overrides given: {' '.join(overrides) or 'none'}")
    return argv


def cli() -> None:
    """The `agentfly-train` console script."""
    # absl's --help lists the main module's flags (a console-script wrapper has none) and exits 1.
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS["config"])
    sys.modules["__main__"].__doc__ = __doc__
    if any(a in ("--help", "-?", "--helpshort", "-h") for a in sys.argv[1:]):
        app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
