"""Train an agent: `agentfly-train --config experiments/NAME.py[:ARG] [--config.key=value ...]`
(the same as `python -m agentfly_jax.train ...`).

Each experiment file's docstring holds its exact commands; `:cpu` picks an experiment's small variant that runs
on a CPU in minutes. `--config.workdir` chooses where TensorBoard events, checkpoints and `summary.json` go;
`--config.resume=True` continues from the last checkpoint there. A config key that is unknown, of the wrong
type or out of range stops the run before any work, with one line naming it.
"""
from __future__ import annotations

import ast
import difflib
import json
import logging
import os
import re
import sys
import traceback

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
        if flags.FLAGS["config"].present:
            _die(f"--config={_config_spec(sys.argv)}: get_config() returned None (a missing return statement?)")
        raise app.UsageError("--config is required, e.g. --config=experiments/quickstart.py")
    if type(config).__name__ == "_ErrorConfig":  # ml-collections defers an OSError of loading the file
        error = object.__getattribute__(config, "_error")
        _die(f"--config={_config_spec(sys.argv)}: loading it failed: {type(error).__name__}: {error}")
    for arg in _none_overrides(sys.argv):  # ml-collections would parse "None" as the key's type: set here
        _set(config, arg[len("--config."):-len("=None")], None)
    from agentfly_jax.trainer import distributed
    from agentfly_jax.trainer.config import ConfigError, TrainConfig

    try:  # validated once, before the trainer imports JAX models or builds anything
        typed = TrainConfig.build(config)
        use_compilation_cache(typed)
        distributed.start(typed)  # jax.distributed before any device work; the same config and code everywhere
    except (ConfigError, distributed.DistributedError) as e:
        _die(str(e))
    except KeyboardInterrupt as e:  # the watchdog's interrupt can come as soon as it runs (the end of `start`)
        _stopped_by_another(e)
    from agentfly_jax.trainer.batch import NoChainsLeftError
    from agentfly_jax.trainer.loop import NonFiniteTrainingError, train  # after validation: keeps --help fast

    try:
        summary = train(typed)
    except ConfigError as e:  # found while building the run (environment, tools, pools), before training
        _die(str(e))
    except (NonFiniteTrainingError, NoChainsLeftError) as e:  # the run stopped itself; scalars, checkpoints kept
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


def use_compilation_cache(cfg) -> str | None:
    """Points XLA's persistent compilation cache at `cfg.compilation_cache_dir` (created; "~" expanded), bounded by
    `cfg.compilation_cache_max_gb`, unless the key is "" or the environment's JAX_COMPILATION_CACHE_DIR chose a
    cache: JAX read that at import, and JAX's own variables then set it up (JAX_COMPILATION_CACHE_MAX_SIZE, unbounded
    when unset), as for any JAX program sharing it (a bounded writer fails to add entries to a directory that
    unbounded ones wrote to). Before anything compiles. Returns the directory in use, or None."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        path = os.environ["JAX_COMPILATION_CACHE_DIR"]
        logging.getLogger(__name__).info("XLA compilation cache (from JAX_COMPILATION_CACHE_DIR): %s", path)
        return path
    if cfg.compilation_cache_dir:
        path = os.path.abspath(os.path.expanduser(cfg.compilation_cache_dir))
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            from agentfly_jax.trainer.config import ConfigError

            raise ConfigError(f"config.compilation_cache_dir={cfg.compilation_cache_dir!r}: cannot create it ({e}); "
                              "name a writable directory, or '' to compile without the cache") from None
        jax.config.update("jax_compilation_cache_dir", path)
    else:
        return None
    jax.config.update("jax_compilation_cache_max_size", int(cfg.compilation_cache_max_gb * 2**30))
    logging.getLogger(__name__).info("XLA compilation cache: %s", path)
    return path


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


def _config_spec(argv: list[str]) -> str | None:
    """The --config flag's value (PATH[:ARG]) in argv, or None."""
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _check_config_file(spec: str) -> None:
    """The experiment file exists, parses and defines get_config: each said in one line before absl loads it."""
    path = spec.split(":", 1)[0]
    if not os.path.isfile(path):
        _die(f"--config={spec}: no such file {path!r} (experiment files: experiments/*.py)")
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except SyntaxError as e:
        _die(f"--config={spec}: {path}:{e.lineno}: {e.msg}")
    except (OSError, UnicodeDecodeError) as e:
        _die(f"--config={spec}: cannot read {path}: {e}")
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if "get_config" not in names:
        _die(f"--config={spec}: {path} defines no get_config() (an experiment file returns its ConfigDict from "
             "get_config(arg=None))")


def _none_overrides(argv: list[str]) -> list[str]:
    """The `--config.key=None` arguments: absl does not see them, `main` sets those keys to None."""
    return [a for a in argv[1:] if a.startswith("--config.") and a.endswith("=None")]


def _raised_in(error: BaseException, path: str) -> int | None:
    """The line of `path` (the experiment file) in the error's traceback, if the error passed through it."""
    target, line = os.path.abspath(path), None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        if os.path.abspath(frame.f_code.co_filename) == target:
            line = lineno
    return line


def _unknown_override(spec: str, overrides: list[str]) -> str | None:
    """For an override naming a key the experiment's config lacks: the one-line message naming the first unknown
    part of its path, the keys there and the nearest one."""
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    try:
        base = ConfigFileFlagParser("config").parse(spec)
    except Exception:  # noqa: BLE001 - the config file's own error is reported by the caller
        return None
    if not hasattr(base, "keys"):
        return f"--config={spec}: get_config() returned {base!r}, not a ConfigDict (a missing return statement?)"
    for override in overrides:
        node, parts = base, override[len("--config."):].split(".")
        for i, part in enumerate(parts):
            keys = list(node.keys()) if hasattr(node, "keys") else None
            if keys is None:
                where = "config." + ".".join(parts[:i])
                return f"config.{'.'.join(parts)}: {where} is a value ({node!r}), not a section"
            if part not in keys:
                where = "config" + "".join("." + p for p in parts[:i])
                near = difflib.get_close_matches(part, [str(k) for k in keys], n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                return (f"config.{'.'.join(parts[:i + 1])}: unknown key{hint}; {where} has: "
                        f"{', '.join(sorted(str(k) for k in keys))}")
            node = node[part]
    return None


def _set(config, dotted: str, value) -> None:
    node, parts = config, dotted.split(".")
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with every problem of the config file or an override (an unknown key, a bad value)
    reported in one line instead of ml-collections' traceback. `--config.key=None` sets a key to None."""
    spec = _config_spec(argv)
    if spec is not None:
        _check_config_file(spec)
    overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
    repeated = next((o for o in overrides if overrides.count(o) > 1), None)
    if repeated:  # ml-collections keeps one of them without a word
        values = [a.split("=", 1)[1] if "=" in a else "..." for a in argv[1:] if a.split("=", 1)[0] == repeated]
        _die(f"{repeated.lstrip('-')} is given {len(values)} times ({', '.join(values)}): give each key once")
    nones = _none_overrides(argv)
    if spec is not None and nones:  # keys absl will not see: checked here
        unknown = _unknown_override(spec, [a.split("=", 1)[0] for a in nones])
        if unknown:
            _die(unknown)
    try:
        return flags.FLAGS([a for a in argv if a not in nones])
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming what was wrong
        text = str(e)
        if "Error whilst parsing config file" in text:  # get_config raised (ml-collections keeps its traceback)
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            _die(f"--config={spec}: get_config raised {lines[-1]}")
        path = (spec or "").split(":", 1)[0]
        line = _raised_in(e, path) if path else None
        if line is not None:
            _die(f"--config={spec}: get_config raised {type(e).__name__}: {e} ({path}:{line})")
        # an override naming a key the config lacks: the config is loaded once more, only now, to say which
        unknown = _unknown_override(spec, overrides) if spec is not None and overrides else None
        if unknown:
            _die(unknown)
        if isinstance(e, flags.Error):
            _die(text.splitlines()[0])
        if not isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
            raise
        text = text.strip("'\"").replace("\\n", " ").replace("\\'", "'").replace("\n", " ")
        # ml-collections names only the last path component; point at the override that holds it
        named = re.match(r"'?([A-Za-z_][\w]*)'?", text)
        culprit = next((o for o in overrides if named and o.split(".")[-1] == named.group(1)), None)
        where = f"{culprit.lstrip('-')}: " if culprit else ""
        _die(f"{where}bad --config override ({text}); overrides given: {' '.join(overrides) or 'none'}")


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
