"""The typed config: unknown keys, wrong types and out-of-range values are refused in one line naming the key,
before any model work; placeholders make unset knobs settable from the command line; the experiment configs
build."""
import copy
import json
import os
import subprocess
import sys
import time

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from agentfly_jax.trainer import config as config_lib
from agentfly_jax.trainer.config import ConfigError, TrainConfig, default_config
from experiments import custom_task, quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build_with(change):
    """TrainConfig.build of the quickstart config (as a plain dict) after `change(dict)`."""
    d = copy.deepcopy(quickstart.get_config().to_dict())
    change(d)
    return TrainConfig.build(d)


def _refused(change) -> str:
    with pytest.raises(ConfigError) as err:
        _build_with(change)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# ===================================================================================== refusals, one line each
def test_unknown_key_suggests_the_right_one():
    message = _refused(lambda d: d["rl"].update(stesp=3))
    assert message.startswith("config.rl.stesp: unknown key (did you mean 'steps'?)")
    assert "config.rl has: steps, tasks_per_step" in message
    assert "did you mean 'algorithm'?" in _refused(lambda d: d.update(algorithmm="grpo"))
    # a ConfigDict (not locked) takes the new key, and the build refuses it the same way
    c = quickstart.get_config()
    c.loss.clip_epsilon = 0.1
    with pytest.raises(ConfigError, match=r"config.loss.clip_epsilon: unknown key \(did you mean 'clip_eps'\?\)"):
        TrainConfig.build(c)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["rl"].update(steps="3"), "config.rl.steps='3': expected an integer"),
    (lambda d: d["rl"].update(steps=3.0), "config.rl.steps=3.0: expected an integer"),
    (lambda d: d["rl"].update(steps=True), "config.rl.steps=True: expected an integer"),
    (lambda d: d.update(progress="yes"), "config.progress='yes': expected True or False"),
    (lambda d: d["optimizer"].update(learning_rate="1e-3"), "config.optimizer.learning_rate='1e-3': expected a number"),
    (lambda d: d.update(seq_buckets="64"), "config.seq_buckets='64': expected a tuple"),
    (lambda d: d["agent"].update(tools=("a", 3)), "config.agent.tools[1]=3: expected a string"),
    (lambda d: d.update(rl=3), "config.rl: expected a section (mapping of keys), got int"),
    (lambda d: d["sft"].update(stages=((10, 1.0, 2),)), "config.sft.stages[0]=(10, 1.0, 2): expected 2 items"),
])
def test_wrong_type_is_refused_naming_the_key(change, message):
    assert _refused(change).startswith(message)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["rl"].update(tasks_per_step=-1), "config.rl.tasks_per_step=-1 is out of range; allowed: > 0"),
    (lambda d: d["rl"].update(steps=-1), "config.rl.steps=-1 is out of range; allowed: >= 0"),
    (lambda d: d["loss"].update(dual_clip=0.5), "config.loss.dual_clip=0.5 is out of range; allowed: > 1"),
    (lambda d: d["agent"].update(top_p=0.0), "config.agent.top_p=0.0 is out of range; allowed: in (0, 1]"),
    (lambda d: d.update(backend="torch"), "config.backend='torch' is out of range; allowed: one of 'jax', 'vllm'"),
    (lambda d: d["advantage"].update(gamma=1.5), "config.advantage.gamma=1.5 is out of range; allowed: in [0, 1]"),
    (lambda d: d.update(seq_buckets=()), "config.seq_buckets=() is out of range"),
])
def test_out_of_range_is_refused_naming_the_key(change, message):
    assert _refused(change).startswith(message)


def test_out_of_range_is_refused_before_any_model_work(monkeypatch, tmp_path):
    """`train` validates first: no builder (tokenizer, tasks, model) runs and no workdir is made."""
    from agentfly_jax.trainer import builders, loop

    def must_not_run(*args, **kwargs):
        raise AssertionError("model/data work started before the config was validated")

    for name in ("build_task_setup", "build_tokenizer", "build_tasks", "build_policy", "build_mesh"):
        monkeypatch.setattr(builders, name, must_not_run)
    c = quickstart.get_config()
    c.rl.tasks_per_step = -1
    c.workdir = str(tmp_path / "run")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^config\.rl\.tasks_per_step=-1 is out of range; allowed: > 0$"):
        loop.train(c)
    assert time.perf_counter() - t0 < 5.0
    assert not os.path.exists(c.workdir)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["advantage"].update(gamma=0.99), "config.advantage.gamma has no effect under algorithm 'grpo'"),
    (lambda d: d["advantage"].update(kl_in_reward_coef=0.1),
     "config.advantage.kl_in_reward_coef=0.1 has no effect under algorithm 'grpo'"),
    (lambda d: d["loss"].update(norm_len=128), "config.loss.norm_len=128 has no effect with aggregation 'token-mean'"),
    (lambda d: d.update(algorithm="drgrpo") or d["loss"].update(aggregation="token-mean"),
     "config.loss.aggregation='token-mean': algorithm 'drgrpo' is defined by its aggregation"),
    (lambda d: d["loss"].update(kl_loss_estimator="k2"), "config.loss.kl_loss_estimator is set but"),
    (lambda d: d.update(algorithm="grop"), "unknown algorithm 'grop' (did you mean 'grpo'?)"),
    (lambda d: d["rl"].update(mini_batches=200), "config.rl.mini_batches=200 is more than the 128 chains"),
    (lambda d: d["agent"].update(max_context_tokens=1024),
     "config.agent.max_context_tokens=1024 does not fit the largest of config.seq_buckets"),
    (lambda d: d["jax_sampler"].update(max_len=200),
     "config.jax_sampler.max_len=200 is shorter than config.agent.max_context_tokens=256"),
    (lambda d: d["tokenizer"].update(kind=""), "set config.tokenizer.path (an HF tokenizer directory) or"),
    (lambda d: d.update(backend="vllm"), "config.backend='vllm' needs config.vllm.urls"),
    (lambda d: d["env"].update(name=""), "config.env.name is empty and config.task.train_path is empty"),
    (lambda d: d["model"].update(num_kv_heads=3), "config.model.num_kv_heads=3 must divide num_heads=4"),
    (lambda d: d["agent"].update(temperature=0.0), "config.agent.temperature=0 samples greedily, so the 8 chains"),
    (lambda d: d["model"].update(hidden_size=130),
     "config.model.hidden_size=130 is not a multiple of num_heads=4: change one, or set config.model.head_dim"),
])
def test_cross_section_rules_are_one_line_config_errors(change, message):
    assert message in _refused(change)


def test_recipe_defaults_are_filled_from_the_config():
    c = quickstart.get_config()
    c.algorithm = "drgrpo"
    resolved = TrainConfig.build(c).resolved_algorithm()
    assert resolved.aggregation == "seq-mean-token-sum-norm"
    assert resolved.norm_len == c.agent.max_context_tokens == 256  # Dr.GRPO's horizon: the context length
    c.loss.norm_len = 100
    assert TrainConfig.build(c).resolved_algorithm().norm_len == 100


# ================================================================================================ placeholders
def test_default_config_is_the_typed_defaults_with_placeholders():
    c = default_config()
    built = TrainConfig.build({**c.to_dict(), "tokenizer": {"kind": "env"}, "env": {"name": "arithmetic"}})
    assert built.rl == config_lib.RLSection() and built.loss == config_lib.LossSection()
    for key in ("dual_clip", "is_cap", "norm_len", "aggregation", "kl_loss_coef"):
        assert c.loss[key] is None and isinstance(c.loss.get_ref(key), ml_collections.FieldReference), key
    # optional keys with a default are typed references too: they can be switched off (None) and back
    assert c.loss.logprob_chunk == 256 and c.critic.value_clip_eps == 0.2 and c.model.param_dtype == "float32"
    c.loss.logprob_chunk = None
    c.critic.value_clip_eps = None
    assert TrainConfig.build({**c.to_dict(), "tokenizer": {"kind": "env"}, "env": {"name": "arithmetic"}}
                             ).loss.logprob_chunk is None
    c.loss.logprob_chunk = 64  # placeholders of their type: set ...
    c.loss.dual_clip = 1.5
    c.loss.is_cap = 2.0
    with pytest.raises(TypeError, match="logprob_chunk"):  # ... and typed
        c.loss.logprob_chunk = "x"


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections loading the file
@pytest.mark.parametrize("change,in_step", [
    ({}, True),  # the quickstart: one epoch of one mini-batch, no KL in the reward
    ({"rl.old_logprobs": "prepare"}, False),
    ({"rl.ppo_epochs": 2}, False),  # the second epoch's policy is not the one that sampled: prepare's pass
    ({"rl.mini_batches": 2}, False),  # the second mini-batch's step starts from the first one's parameters
    ({"algorithm": "reinforce_pp", "advantage.kl_in_reward_coef": 0.05}, False),  # prepare's KL reads them
    ({"algorithm": "reinforce_pp"}, True),  # no KL coefficient: nothing in prepare reads them
    ({"algorithm": "ppo", "loss.kl_loss_coef": 0.1}, True),  # the KL loss reads the reference's, in the step
])
def test_old_logprobs_come_from_the_train_step_only_for_one_optimiser_step(change, in_step):
    """config.rl.old_logprobs="auto" (the default) lets the train step take the old log-probabilities from its own
    forward pass (prepare skips its pass over the policy) exactly when they would be that pass's values."""
    c = quickstart.get_config()
    for key, value in change.items():
        section, _, name = key.rpartition(".")
        setattr(c[section] if section else c, name, value)
    assert TrainConfig.build(c).resolved_algorithm().old_logprobs_in_step is in_step
    c.rl.old_logprobs = "sometimes"
    with pytest.raises(ConfigError, match="config.rl.old_logprobs='sometimes' is out of range; allowed: one of "
                                          "'auto', 'prepare'"):
        TrainConfig.build(c)


def test_placeholders_are_settable_through_config_flags():
    """The ml-collections command-line override path the trainer's --config flag uses."""
    argv = ["train", f"--config={ROOT}/experiments/quickstart.py:cpu", "--config.loss.logprob_chunk=64",
            "--config.loss.dual_clip=1.5", "--config.loss.is_cap=2.0", "--config.advantage.normalize_std=False",
            "--config.rl.steps=3"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "experiment config", flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    fv(argv)
    cfg = TrainConfig.build(fv.config)
    assert (cfg.loss.logprob_chunk, cfg.loss.dual_clip, cfg.loss.is_cap) == (64, 1.5, 2.0)
    assert cfg.rl.steps == 3 and cfg.rl.tasks_per_step == 4  # the :cpu variant's
    resolved = cfg.resolved_algorithm()
    assert (resolved.logprob_chunk, resolved.dual_clip, resolved.is_cap) == (64, 1.5, 2.0)
    assert resolved.estimator_kwargs["normalize_std"] is False


def _train_cli(*overrides, config="experiments/quickstart.py"):
    env = {**os.environ, "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "agentfly_jax.train", "--config", config, *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    return proc, time.perf_counter() - t0


@pytest.mark.slow
def test_cli_refuses_a_bad_value_in_one_line_fast():
    proc, seconds = _train_cli("--config.loss.logprob_chunk=64", "--config.loss.dual_clip=1.5",
                               "--config.loss.is_cap=2.0", "--config.rl.tasks_per_step=-1")
    assert seconds < 30, seconds
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "rl.tasks_per_step" in lines[0] and "Traceback" not in proc.stderr
    assert lines[0] == "agentfly-train: config.rl.tasks_per_step=-1 is out of range; allowed: > 0"
    assert proc.stdout == ""


@pytest.mark.slow
def test_cli_refuses_a_misspelled_key_in_one_line_with_a_suggestion():
    proc, seconds = _train_cli("--config.rl.stesp=3")
    assert seconds < 30, seconds
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("agentfly-train: config.rl.stesp: unknown key (did you mean 'steps'?); config.rl "
                               "has: "), lines
    assert "Traceback" not in proc.stderr


CONFIG_FILES = {  # an experiment file's problems, each said in one line naming the file
    "missing": (None, "no such file"),
    "syntax": ("def get_config(:\n    pass\n", "syntax.py:1: invalid syntax"),
    "no_get_config": ("CONFIG = 1\n", "defines no get_config()"),
    "returns_none": ("def get_config(arg=None):\n    pass\n", "get_config() returned None"),
    "raises": ("def get_config(arg=None):\n    raise RuntimeError('no data here')\n",
               "get_config raised RuntimeError: no data here (")
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_cli_names_a_broken_experiment_file_in_one_line(case, tmp_path):
    text, expected = CONFIG_FILES[case]
    path = tmp_path / f"{case}.py"
    if text is not None:
        path.write_text(text)
    for extra in ((), ("--config.rl.steps=1",)):  # with and without an override to apply
        proc, _ = _train_cli(*extra, config=str(path))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[-1].startswith(f"agentfly-train: --config={path}: ") and expected in lines[-1], lines


@pytest.mark.slow
@pytest.mark.parametrize("overrides,expected", [
    (("--config.model.nonexistent=1",), "config.model.nonexistent: unknown key; config.model has: attention_impl, "),
    (("--config.nonexistent.foo=1",), "config.nonexistent: unknown key; config has: advantage, agent, "),
    (("--config.env.options.opz=1",), "config.env.options.opz: unknown key (did you mean 'ops'?); config.env.options "
                                      "has: "),
    (("--config.rl.steps.x=1",), "config.rl.steps.x: config.rl.steps is a value (40), not a section"),
    # None from the command line (ml-collections parses a value as the key's type): accepted, so the run stops
    # at the next key
    (("--config.loss.is_cap=None", "--config.model.param_dtype=None", "--config.rl.micro_batch_tokens=None",
      "--config.rl.tasks_per_step=-1"), "config.rl.tasks_per_step=-1 is out of range; allowed: > 0"),
    # a key given twice: one of the two would be dropped without a word
    (("--config.rl.steps=3", "--config.eval.num_tasks=0", "--config.rl.steps=5"),
     "config.rl.steps is given 2 times (3, 5): give each key once"),
    ((), None),
])
def test_cli_overrides_unknown_keys_and_none(overrides, expected):
    if expected is None:  # the experiment's variant argument: get_config's own error, not ml-collections'
        proc, _ = _train_cli(config="experiments/quickstart.py:nope")
        expected = ("--config=experiments/quickstart.py:nope: get_config raised ValueError: experiments/quickstart.py "
                    "takes no argument or 'cpu', got 'nope'")
    else:
        proc, _ = _train_cli(*overrides)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("agentfly-train: " + expected), lines


@pytest.mark.slow
@pytest.mark.parametrize("overrides,expected", [
    (("--config.mesh.tensor=3",), "config.mesh: mesh {'data': 1, 'tensor': 3} (and fsdp=-1, the rest) needs a "
                                  "multiple of 3 devices but "),  # 1 device, or the suite's 8 fake ones
    (("--config.model.vocab_size=10",), "config.model.vocab_size=10 but the tokenizer has "),
])
def test_cli_setup_problems_are_one_line(overrides, expected, tmp_path):
    """Found while building the run (the devices, the tokenizer), not by the config alone."""
    proc, _ = _train_cli(*overrides, "--config.progress=False", f"--config.workdir={tmp_path}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("agentfly-train: " + expected), lines


# The bad values an attack pass fed the trainer (some used to fail only after SFT and the first evaluation, some
# with unreadable errors, some were accepted): each is refused by the config, in one line naming the key.
ATTACK_TABLE = [
    ("rl", "tasks_per_step", -4, "> 0"), ("rl", "chains_per_task", 0, "> 0"), ("rl", "mini_batches", 0, "> 0"),
    ("eval", "num_chains", 0, "> 0"), ("rl", "micro_batches", 0, "> 0"), ("sft", "batch_size", -1, "> 0"),
    ("model", "hidden_size", -128, "> 0"), ("optimizer", "learning_rate", -1.0, "> 0"),
    ("checkpoint", "keep", 0, "> 0"), ("loss", "temperature", 0.0, "> 0"), (None, "seed", -1, ">= 0"),
    (None, "max_nonfinite_steps", 0, "> 0"), ("sft", "optimizer", {"learning_rate": 0.0}, "> 0"),
    # a second pass: accepted before, each then failing with a traceback or doing something else than asked
    ("mesh", "data", 0, "> 0"), ("mesh", "tensor", 0, "> 0"),
    ("mesh", "fsdp", 0, ">= 1, or -1 (every remaining device)"),
    ("agent", "max_observation_chars", -10, "None (no limit) or >= 1"),
    ("agent", "max_concurrency", 0, "None (no limit) or >= 1"),
    ("agent", "tool_timeout", -5.0, "None or positive seconds"),
    ("agent", "stop_token_ids", (-1,), "None or token ids >= 0"),
    ("jax_sampler", "max_len", 0, "None (config.agent.max_context_tokens) or >= 2"),
    ("agent", "success_threshold", float("nan"), "None (the environment's) or a finite number"),
    ("optimizer", "end_lr_ratio", 5.0, "in [0, 1] (the decay's end, a fraction of learning_rate)"),
    ("sft", "stages", ((10, 1.5),), "(steps >= 1, expert fraction in [0, 1]) pairs"),
    ("sft", "stages", ((-10, 0.5),), "(steps >= 1, expert fraction in [0, 1]) pairs"),
    ("loss", "clip_eps_high", -0.5, "> 0"), ("model", "head_dim", -4, "None (hidden_size / num_heads) or > 0"),
    (None, "compilation_cache_max_gb", 0.0, "> 0"),
]


@pytest.mark.parametrize("section,key,value,allowed", ATTACK_TABLE,
                         ids=[f"{s or 'config'}.{k}" for s, k, _, _ in ATTACK_TABLE])
def test_attack_table_of_bad_values_is_refused_naming_the_key(section, key, value, allowed):
    def change(d):
        (d[section] if section else d)[key] = value if not isinstance(value, dict) else {**d[section][key], **value}

    message = _refused(change)
    name = f"config.{section + '.' if section else ''}{key}"
    if isinstance(value, dict):
        name, value = f"{name}.learning_rate", value["learning_rate"]
    assert message == f"{name}={value!r} is out of range; allowed: {allowed}"


@pytest.mark.slow
def test_an_unreachable_vllm_server_is_found_at_start_in_one_line():
    """`config.vllm.urls` are probed (GET /health) before the model is built, SFT runs or an evaluation starts."""
    proc, seconds = _train_cli("--config.backend=vllm", "--config.vllm.urls=('http://127.0.0.1:9',)")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("agentfly-train: config.vllm.urls: 1 of 1 vLLM servers do not answer GET /health: "
                                "http://127.0.0.1:9 ("), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and seconds < 60, seconds


_CACHE_CHILD = r"""
import json, os, sys, types
import jax, jax.numpy as jnp
from agentfly_jax.train import use_compilation_cache
from agentfly_jax.trainer.config import ConfigError

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the test's tiny program is cached too
case, path = sys.argv[1], sys.argv[2]
cfg = types.SimpleNamespace(compilation_cache_dir=path, compilation_cache_max_gb=0.5)
try:
    used = use_compilation_cache(cfg)
except ConfigError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()
print(json.dumps({"used": used, "dir": jax.config.jax_compilation_cache_dir,
                  "max": jax.config.jax_compilation_cache_max_size}))
"""


def test_the_compilation_cache_holds_the_programs_a_run_compiles(tmp_path):
    """config.compilation_cache_dir (created, "~" expanded) receives the compiled programs, bounded by
    compilation_cache_max_gb; the environment's JAX_COMPILATION_CACHE_DIR takes precedence, as JAX sets it up (no
    bound of ours: a bounded writer cannot add to a directory unbounded ones wrote to); "" compiles without a
    cache; a directory that cannot be created is a one-line config error. Each case in a fresh process (JAX sets its
    cache up once)."""
    def child(case, path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        if case == "env":
            env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "from_env")
        proc = subprocess.run([sys.executable, "-c", _CACHE_CHILD, case, str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cache = tmp_path / "a" / "cache"
    got = child("config", cache)
    assert got == {"used": str(cache), "dir": str(cache), "max": 2**29} and any(cache.iterdir())
    # the environment's directory wins, with JAX's bound (none by default); the config's directory is not made
    got = child("env", tmp_path / "b")
    assert got["used"] == got["dir"] == str(tmp_path / "from_env") and not (tmp_path / "b").exists()
    assert got["max"] == -1
    assert any((tmp_path / "from_env").iterdir())
    got = child("config", "")
    assert got["used"] is None and got["dir"] is None
    (tmp_path / "file").write_text("")
    got = child("config", tmp_path / "file" / "cache")
    assert got["error"].startswith(f"config.compilation_cache_dir='{tmp_path / 'file' / 'cache'}': cannot create it")


# ========================================================================================= experiment configs
@pytest.mark.parametrize("module,arg", [(quickstart, None), (quickstart, "cpu"), (custom_task, None),
                                        (custom_task, "cpu")])
def test_experiment_configs_build(module, arg):
    cfg = TrainConfig.build(module.get_config(arg))
    assert isinstance(cfg, TrainConfig)
    assert cfg.resolved_algorithm().recipe.name == cfg.algorithm == "grpo"
    assert cfg.agent.max_context_tokens <= max(cfg.seq_buckets)
    if arg == "cpu":
        assert cfg.rl.steps == 1
    if module is custom_task:
        assert cfg.env.name == "" and cfg.task.train_path.endswith("train.jsonl")
        assert os.path.exists(os.path.join(ROOT, cfg.task.train_path))
    else:
        assert cfg.env.name == "arithmetic"
    with pytest.raises(ValueError, match="takes no argument or 'cpu'"):
        module.get_config("gpu")


def test_built_config_is_frozen():
    cfg = TrainConfig.build(quickstart.get_config())
    with pytest.raises(Exception, match="cannot assign"):
        cfg.rl.steps = 3
