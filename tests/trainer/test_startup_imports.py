"""What a trainer process imports before its first step. Every `agentfly-train` run (and every process of a
multi-process one) pays its imports again: on a 2-core CPU, transformers' auto classes cost about 9 s (they pull
in its generation code, torch and sklearn) and torch about 3 s, and the quickstart needs neither."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = r"""
import json, sys
from experiments import quickstart
from agentfly_jax.trainer import builders
from agentfly_jax.trainer.config import TrainConfig

cfg = TrainConfig.build(quickstart.get_config("cpu"))
setup = builders.build_task_setup(cfg)
tokenizer = builders.build_tokenizer(cfg, setup, sys.argv[1])  # built, then saved into the workdir
again = builders.build_tokenizer(cfg, setup, sys.argv[1])  # loaded from there, as a resumed run does
assert again.encode("What is 417 * 38?") == tokenizer.encode("What is 417 * 38?")
names = ("torch", "sklearn", "transformers.models.auto.tokenization_auto", "transformers.generation.utils")
print(json.dumps({"loaded": [n for n in names if n in sys.modules], "same_class": type(again) is type(tokenizer)}))
"""


def test_the_quickstart_trainer_imports_neither_torch_nor_transformers_auto_classes(tmp_path):
    """The quickstart's setup up to its tokenizer (the calculator tool's schema, which asks transformers'
    get_json_schema; the environment's tokenizer, built and then loaded from the workdir) leaves torch, sklearn
    and transformers' auto and generation modules unimported."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "tokenizer")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"loaded": [], "same_class": True}, got
