"""experiments/custom_task.py: a user's own JSONL task, with tools, reward and agent class by import path.

- the `:cpu` command with a scripted agent class (`--config.agent.type=tests.trainer.test_custom_task:...`)
  trains (slow): summary.json, TensorBoard scalars of the RL step, the final policy; its real tool calls reach
  `convert_units` in the trainer's rollout and are scored on held-out rows. (The tiny random policy of `:cpu`
  itself practically never writes a valid tool call; the command exactly as given runs in docs/custom_task.md's
  first bash block, tests/docs/test_custom_task_doc.py);
- fast: a bad tool import path and a reward asking for a field the rows lack fail at setup, naming them; an
  agent class given by import path is the class the trainer builds, and the trainer's wiring (tools, reward,
  rows) of the task runs chains whose tool calls reach `convert_units`.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest

from agentfly_jax.envs import Environment, StepResult
from agentfly_jax.rewards import reward
from agentfly_jax.rollout.agents import ReactAgent, ToolCallingAgent
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.trainer import builders
from agentfly_jax.trainer.config import ConfigError, TrainConfig
from agentfly_jax.trainer.metrics import read_scalars
from agentfly_jax.tools import tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENTFLY_TRAIN = os.path.join(os.path.dirname(sys.executable), "agentfly-train")
CPU_COMMAND = [AGENTFLY_TRAIN, "--config", "experiments/custom_task.py:cpu", "--config.progress=False"]
QUESTION = re.compile(r"How many (\S+) are in (\S+) (\S+)\?")
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


# ---------------------------------------------------------------------------------- agents by import path
class MyAgent(ToolCallingAgent):
    """A custom agent class, chosen with --config.agent.type=tests.trainer.test_custom_task:MyAgent."""

    def system_message(self, task):
        return "Convert units with the tool. " + (self.system_prompt or "")


class ScriptedUnitsAgent(ToolCallingAgent):
    """Plays the unit-conversion task instead of sampling: turn 1 calls `convert_units` with the question's
    numbers, turn 2 answers with the tool's observation. Everything else (parsing, tool execution, reward,
    the trainer's batch and update) is the real pipeline."""

    async def generate(self, prompt_token_ids, *, max_tokens, seed):
        prompt = self.tokenizer.decode(list(prompt_token_ids), skip_special_tokens=False)
        observations = TOOL_RESPONSE.findall(prompt)
        if observations:
            text = f"The answer is {observations[-1]}."
        else:
            dst, value, src = QUESTION.findall(prompt)[-1]
            arguments = {"value": float(value), "from_unit": src, "to_unit": dst}
            call = json.dumps({"name": "convert_units", "arguments": arguments})
            text = f"<tool_call>\n{call}\n</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.stop_token_ids[0]]
        assert len(ids) <= max_tokens, (len(ids), max_tokens)
        return Completion(ids, [0.0] * len(ids), "stop")


class NotAnAgent:
    pass


class NoSampling(GenerationBackend):
    """A backend for agents that never sample (the scripted agent plays every turn itself)."""

    async def generate(self, prompt_token_ids, **sampling):
        raise AssertionError("the scripted agent does not sample")

    async def update_weights(self, params, version, *, interrupt=False):
        self.weight_version = version


class TallyEnv(Environment):
    def __init__(self):
        self.count = 0

    async def reset(self, task=None):
        self.count = 0
        return "0"

    async def step(self, action):
        self.count += 1
        return StepResult(observation=str(self.count))


@tool(stateful=True, pool="tally")
async def tally(env: TallyEnv) -> str:
    """Adds one to the chain's tally and returns it."""
    return (await env.step(None)).observation


@reward
def answer_with_typo(prediction: str, answre: float) -> float:
    """Asks for a dataset field `answre` that the example's rows do not have (they have `answer`)."""
    return 0.0


# ---------------------------------------------------------------------------------------------- helpers
def cpu_config(**agent):
    from experiments.custom_task import get_config

    c = get_config("cpu")
    c.agent.update(agent)
    return c


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer

    return build_qwen2_5_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def train_cli(workdir, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT}  # `tests.trainer...` importable by the console script
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    proc = subprocess.run([*CPU_COMMAND, f"--config.workdir={workdir}", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(workdir, "summary.json")) as fh:
        return json.load(fh)


def eval_texts(logdir):
    """{tag: [text, ...]} of the text summaries (eval sample trajectories) in `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


# ------------------------------------------------------------------------------------------ slow: the CLI
@pytest.mark.slow
def test_cpu_command_tool_calls_reach_convert_units(tmp_path):
    """The `:cpu` command with a scripted agent class by import path: its calls run `convert_units` inside the
    trainer's rollout, the reward scores them against the rows' `answer`, and the held-out rows are evaluated
    before and after the step."""
    workdir = str(tmp_path / "run")
    summary = train_cli(workdir, "--config.agent.type=tests.trainer.test_custom_task:ScriptedUnitsAgent",
                        "--config.agent.max_new_tokens=64", "--config.task.num_eval=2",
                        "--config.eval.num_tasks=2")
    assert summary["environment"] == "experiments/custom_task_example/train.jsonl" and summary["steps"] == 1
    assert summary["success_before"] == 1.0 and summary["success_after"] == 1.0
    scalars = read_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["reward/mean"]] == [1]  # the train step ran and logged
    assert scalars["rollout/chains"] == [(1, 4.0)]  # 2 tasks x 2 chains
    for tag in ("rollout/tool_errors/unknown_tool", "success/rate"):
        assert tag in scalars, tag
    assert os.path.isfile(os.path.join(summary["final_policy"], "model.safetensors"))
    assert scalars["rollout/tool_calls"] == [(1, 4.0)]  # one call in each of the 4 chains
    assert scalars["rollout/tool_errors"] == [(1, 0.0)]
    assert scalars["reward/mean"] == [(1, 1.0)]
    texts = eval_texts(os.path.join(workdir, "tensorboard"))["eval/sample_trajectory"]
    assert len(texts) == 2  # before and after
    for text in texts:
        assert text.startswith("reward=1.0"), text
        assert '"name": "convert_units"' in text and "<tool_response>" in text


# -------------------------------------------------------------------------------- fast: failing at start
def test_bad_tool_import_path_fails_at_setup_naming_it(tmp_path):
    from agentfly_jax.trainer.loop import setup

    bad = "experiments.custom_task_example.tools:convert_unit"
    with pytest.raises(ValueError, match=re.escape(bad)) as error:
        setup(cpu_config(tools=(bad,)), workdir=str(tmp_path))
    assert "has no attribute 'convert_unit'" in str(error.value)
    missing_module = "experiments.custom_task_examples.tools:convert_units"
    with pytest.raises(ValueError, match=re.escape(missing_module)):
        setup(cpu_config(tools=(missing_module,)), workdir=str(tmp_path))


def test_bad_tool_import_path_message_calls_it_a_tool(tmp_path):
    from agentfly_jax.trainer.loop import setup

    bad = "experiments.custom_task_example.tools:convert_unit"
    with pytest.raises(ConfigError) as error:
        setup(cpu_config(tools=(bad,)), workdir=str(tmp_path))
    assert str(error.value).startswith(f"config.agent.tools: {bad!r} cannot be imported")
    not_a_tool = "experiments.custom_task_example.tools:convert"  # a plain function, not a @tool
    with pytest.raises(ConfigError, match="not a @tool function"):
        setup(cpu_config(tools=(not_a_tool,)), workdir=str(tmp_path))


def test_reward_field_missing_from_rows_fails_at_setup_naming_it(tmp_path):
    from agentfly_jax.trainer.loop import setup

    config = cpu_config(reward="tests.trainer.test_custom_task:answer_with_typo")
    with pytest.raises(ConfigError) as error:
        setup(config, workdir=str(tmp_path))
    message = str(error.value)
    assert "reward 'answer_with_typo' takes a parameter 'answre'" in message
    assert "experiments/custom_task_example/train.jsonl:1 has no field 'answre'" in message
    assert "Did you mean 'answer'?" in message
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))  # nothing built past the data


def test_stateful_tool_whose_pool_is_not_configured_fails_at_setup():
    c = cpu_config(tools=("experiments.custom_task_example.tools:convert_units",
                          "tests.trainer.test_custom_task:tally"))
    # misnamed pool: the tool says "tally"
    c.envs = {"tallies": {"factory": "tests.trainer.test_custom_task:TallyEnv"}}
    with pytest.raises(ConfigError, match=r"tool 'tally' uses environment pool 'tally' but the run has pools "
                                          r"\['tallies'\]"):
        builders.build_task_setup(TrainConfig.build(c))
    c.envs = {"tally": {"factory": "tests.trainer.test_custom_task:TallyEnv"}}
    assert sorted(builders.build_task_setup(TrainConfig.build(c)).pools) == ["tally"]


def test_missing_reward_or_data_is_a_config_error():
    with pytest.raises(ConfigError, match="needs config.agent.reward"):
        TrainConfig.build(cpu_config(reward=""))
    c = cpu_config()
    c.task.train_path = ""
    with pytest.raises(ConfigError, match="config.task.train_path is empty"):
        TrainConfig.build(c)


# ------------------------------------------------------------------------------- fast: the agent class
def test_agent_class_by_import_path_is_the_one_the_trainer_builds(tokenizer):
    path = "tests.trainer.test_custom_task:MyAgent"
    assert builders.agent_class(path) is MyAgent
    cfg = TrainConfig.build(cpu_config(type=path))
    task_setup = builders.build_task_setup(cfg)
    agent = builders.build_agent(cfg, task_setup, backend=NoSampling(), tokenizer=tokenizer)
    assert type(agent) is MyAgent
    assert list(agent.tools) == ["convert_units"] and agent.reward_fn.name == "close_to_answer"
    assert agent.max_turns == 2 and agent.max_new_tokens == 32  # the :cpu numbers reach the agent
    assert builders.agent_class("react") is ReactAgent  # built-in names still work
    with pytest.raises(ConfigError, match="not a subclass of agentfly_jax.rollout.agents.BaseAgent"):
        builders.agent_class("tests.trainer.test_custom_task:NotAnAgent")


def test_trainer_wiring_runs_chains_whose_tool_calls_reach_convert_units(tokenizer):
    """The trainer's builders (tools and reward by import path, rows from the JSONL files) with the scripted
    agent: every chain calls convert_units once, gets the exact conversion back and is rewarded 1.0."""
    cfg = TrainConfig.build(cpu_config(type="tests.trainer.test_custom_task:ScriptedUnitsAgent",
                                       max_new_tokens=64))
    task_setup = builders.build_task_setup(cfg)
    train_rows, _ = builders.build_tasks(cfg, task_setup)
    agent = builders.build_agent(cfg, task_setup, backend=NoSampling(), tokenizer=tokenizer)
    assert type(agent) is ScriptedUnitsAgent
    trajectories = asyncio.run(agent.run(train_rows[:3], num_chains=2, progress=False))
    assert len(trajectories) == 6
    for trajectory in trajectories:
        assert [(c.name, c.error) for c in trajectory.tool_call_records] == [("convert_units", None)]
        assert trajectory.reward == 1.0, trajectory.reward_extras
    assert agent.last_run_stats["tool_calls"] == 6 and agent.last_run_stats["tool_errors"] == 0


# ------------------------------------------------------------------- a second attack pass: user code and files
USER_MODULES = {  # module source -> what the one-line error says
    "p_nohints": ("from agentfly_jax.tools import tool\n\n@tool\ndef nohints(x, y):\n    '''Adds.'''\n    return x\n",
                  "tool", "importing p_nohints failed: ToolDefinitionError: tool 'nohints': parameter 'x' has no "
                          "type hint"),
    "p_posonly": ("from agentfly_jax.rewards import reward\n\n@reward\ndef posonly(prediction, answer, /):\n"
                  "    return 1.0\n", "reward", "importing p_posonly failed: TypeError: "),
    "p_raises": ("raise RuntimeError('no config here')\n", "tool", "importing p_raises failed: RuntimeError: no config "
                                                                  "here ("),
    "p_syntax": ("def broken(:\n", "tool", "importing p_syntax failed: SyntaxError: "),
    "p_needs": ("import not_installed_package_xyz\n", "tool", "importing p_needs needs the module "
                                                              "'not_installed_package_xyz', which is not installed"),
}


@pytest.mark.parametrize("module", sorted(USER_MODULES))
def test_a_user_module_that_fails_to_import_is_one_config_error(module, tmp_path, monkeypatch):
    source, kind, expected = USER_MODULES[module]
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "nohints" if module == "p_nohints" else "posonly" if module == "p_posonly" else "x"
    c = cpu_config(**({"tools": (f"{module}:{name}",)} if kind == "tool" else {"reward": f"{module}:{name}"}))
    with pytest.raises(ConfigError) as error:
        builders.build_task_setup(TrainConfig.build(c))
    message = str(error.value)
    assert message.startswith(f"config.agent.{kind}{'s' if kind == 'tool' else ''}: ") and expected in message
    assert "\n" not in message
    if module in ("p_raises", "p_syntax"):  # the user's own line
        assert f"{tmp_path / module}.py:1)" in message


def test_two_tools_of_one_name_are_refused_naming_both_entries(tmp_path, monkeypatch):
    (tmp_path / "p_dup.py").write_text("from agentfly_jax.tools import tool\n\n@tool(name='convert_units')\n"
                                       "def fake(value: float) -> str:\n    '''Converts.'''\n    return ''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = "experiments.custom_task_example.tools:convert_units"
    with pytest.raises(ConfigError, match=re.escape(f"config.agent.tools: {real!r} and 'p_dup:fake' are both named "
                                                    "'convert_units'")):
        builders.build_task_setup(TrainConfig.build(cpu_config(tools=(real, "p_dup:fake"))))
    assert builders.build_task_setup(TrainConfig.build(cpu_config(tools=(real, real)))).tools  # the same one twice


SFT_FILES = {  # file content -> the error naming file:line (None: read fine, `rows` conversations)
    "missing": (None, "cannot read it (No such file or directory)"),
    "bad_json": ('{"messages": [{"role": "assistant", "content": "a"}]}\n\n{"messages": [}\n', "sft.jsonl:3: "
                                                                                             "invalid JSON: "),
    "a_list": ('[1, 2]\n', "sft.jsonl:1: expected an object with a non-empty 'messages' list, got list"),
    "bad_role": ('{"messages": [{"text": "hi"}]}\n', "sft.jsonl:1: message 0 must be an object with a string 'role'"),
    "empty_assistant": ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}\n',
                        "sft.jsonl:1: message 1 is an assistant message with neither 'content' nor 'tool_calls'"),
    "no_assistant": ('{"messages": [{"role": "user", "content": "hi"}]}\n' * 3,
                     "no row has an assistant message (SFT learns the assistant's turns): 3 rows without one"),
    "not_utf8": (b'{"messages": [{"role": "user", "content": "\xff"}]}\n', "sft.jsonl:1: not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(SFT_FILES))
def test_sft_data_file_problems_name_the_file_and_line(case, tmp_path):
    content, expected = SFT_FILES[case]
    path = tmp_path / "sft.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as error:
        builders.read_sft_conversations(str(path))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_sft_rows_without_an_assistant_turn_are_left_out_with_a_warning(tmp_path, caplog):
    path = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text("\n".join(json.dumps(r) for r in (good, {"messages": [{"role": "user", "content": "hi"}]}, good)))
    with caplog.at_level("WARNING"):
        assert builders.read_sft_conversations(str(path)) == [good["messages"]] * 2
    assert "1 rows have no assistant message and are left out (lines 2)" in caplog.text


def test_a_held_out_file_is_read_even_when_unused_and_a_short_one_is_said(tmp_path, caplog):
    c = cpu_config()
    c.task.eval_path = str(tmp_path / "nope.jsonl")
    c.task.num_eval, c.eval.num_tasks = 0, 0
    cfg = TrainConfig.build(c)
    with pytest.raises(ConfigError, match="nope.jsonl: no such dataset file"):
        builders.build_tasks(cfg, builders.build_task_setup(cfg))
    two = tmp_path / "two.jsonl"
    two.write_text('{"question": "1 km in m?", "answer": 1000}\n{"question": "2 km in m?", "answer": 2000}\n')
    c.task.eval_path, c.task.num_eval = str(two), 4
    cfg = TrainConfig.build(c)
    with caplog.at_level("WARNING"):
        _, heldout = builders.build_tasks(cfg, builders.build_task_setup(cfg))
    assert len(heldout) == 2 and f"config.task.num_eval=4 but {two} has 2 rows: using those 2" in caplog.text


def test_task_file_problems_name_the_line(tmp_path):
    from agentfly_jax.rollout.data import DatasetError, load_tasks

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"question": "a", "answer": 1}\n{"question": "b\xff", "answer": 2}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: not UTF-8 text")):
        load_tasks(path)
    path.write_text('{"question": 42, "answer": 1}\n')
    with pytest.raises(DatasetError, match=re.escape("'question' field (got int 42; fields: answer, question)")):
        load_tasks(path)
    with pytest.raises(DatasetError, match="a directory, not a dataset file"):
        load_tasks(tmp_path)
    path.write_bytes('\ufeff{"question": "a", "answer": 1}\n'.encode())  # a byte-order mark
    assert load_tasks(path) == [{"question": "a", "answer": 1}]
