"""The trained policy is usable: a short quickstart run ends in `final_policy/`, `scripts/start_vllm.sh` serves it
(with its tokenizer, the chat template used in training and the Hermes tool-call parser), and the official `openai`
client chats with it — a plain completion, then a calculator call parsed into `tool_calls`, the tool's result sent
back and a final answer. The same server still answers VLLMBackend's token-in/token-out requests and weight syncs.

The run: `experiments/quickstart.py:cpu` with its SFT warm start on tool-call demonstrations only (200 steps, so the
tiny policy writes well-formed calls) and its one RL step; about 2 minutes on 2 cores, then a minute of vLLM start.
"""
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.backends.conftest import REPO, VLLMServerProcess, trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
QUESTION = "What is 417 * 38?"
TRAIN = ["--config", "experiments/quickstart.py:cpu", "--config.eval.num_tasks=0", "--config.progress=False",
         "--config.sft.stages=((200, 1.0),)", "--config.sft.optimizer.decay_steps=200"]
TIMINGS = {}


@pytest.fixture(scope="module")
def final_policy(tmp_path_factory):
    """A user's short training run; returns (summary, final_policy directory)."""
    if not ((REPO / ".venv-vllm/bin/python").exists() or os.environ.get("VLLM_PYTHON")):
        pytest.fail("no vLLM server environment: run scripts/setup_vllm.sh (scripts/setup.sh does) or set "
                    "VLLM_PYTHON")
    workdir = str(tmp_path_factory.mktemp("served_policy") / "run")
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "agentfly_jax.train", *TRAIN, f"--config.workdir={workdir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    TIMINGS["train_s"] = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    return summary, summary["final_policy"]


@pytest.fixture(scope="module")
def server(final_policy, tmp_path_factory):
    # scripts/start_vllm.sh on the final_policy directory; `start_messages` keeps the flags it chose
    served = VLLMServerProcess(final_policy[1], str(tmp_path_factory.mktemp("served_policy_vllm")), max_model_len=512)
    served.start()
    TIMINGS["server_start_s"] = served.start_seconds[-1]
    yield served
    served.stop()
    print(f"served-policy timings: {', '.join(f'{k}={v:.0f}' for k, v in TIMINGS.items())}")


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def model_name(client):
    [model] = client.models.list().data
    return model.id


def test_final_policy_holds_eos_generation_config_and_the_training_template(final_policy):
    from transformers import AutoTokenizer, GenerationConfig

    from environments.arithmetic.tokenizer import CHAT_TEMPLATE

    _, directory = final_policy
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # the agent's stop ids in training: the tokenizer's eos (<|im_end|>) and the other end-of-turn token it knows
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = json.load(open(os.path.join(directory, "config.json")))
    assert config["eos_token_id"] == stops
    generation = GenerationConfig.from_pretrained(directory)
    assert generation.eos_token_id == stops and generation.pad_token_id == tokenizer.pad_token_id
    assert set(json.load(open(os.path.join(directory, "generation_config.json")))) == {
        "eos_token_id", "pad_token_id", "transformers_version"}
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the quickstart trains with its tokenizer's own template


def test_start_vllm_serves_the_policy_with_its_tokenizer_and_the_hermes_parser(server):
    assert "hermes parser" in server.start_messages, server.start_messages
    log = open(os.path.join(server.run_dir, f"port-{server.port}.log")).read()
    assert "non-default args" in log
    server_args = log.split("non-default args", 1)[1].split("\n", 1)[0]  # the server's own account of its flags
    assert "'enable_auto_tool_choice': True" in server_args and "'tool_call_parser': 'hermes'" in server_args
    assert "skip_tokenizer_init" not in server_args


def test_plain_chat_completion(client):
    from agentfly_jax.rollout.templates import encode_conversation
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": QUESTION}]
    t0 = time.perf_counter()
    answer = client.chat.completions.create(model=model_name(client), messages=messages, max_tokens=48,
                                            temperature=0.0, extra_body={"return_token_ids": True})
    TIMINGS["chat_s"] = time.perf_counter() - t0
    [choice] = answer.choices
    assert choice.finish_reason == "stop", choice
    assert choice.message.role == "assistant" and choice.message.content
    assert "<|im_end|>" not in choice.message.content
    # the server rendered the prompt exactly as training encoded it
    tokenizer = AutoTokenizer.from_pretrained(model_name(client))
    expected = encode_conversation(tokenizer, messages, add_generation_prompt=True).token_ids
    assert answer.model_extra["prompt_token_ids"] == expected


def test_chat_with_tools_returns_a_parsed_call_and_takes_the_result_back(client):
    from agentfly_jax.tools.calculator import calculator
    from agentfly_jax.tools.execute import execute_tool_call

    model = model_name(client)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], max_tokens=48,
                                           temperature=0.0)
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id
    arguments = json.loads(call.function.arguments)  # valid JSON
    assert isinstance(arguments, dict) and isinstance(arguments.get("expression"), str), arguments

    # run the call with the project's calculator (as the agent does) and send its result back as a tool message
    result = asyncio.run(execute_tool_call({"name": call.function.name, "arguments": arguments},
                                           [calculator])).observation
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], max_tokens=48,
                                           temperature=0.0)
    [answer] = final.choices
    assert answer.finish_reason in ("stop", "tool_calls"), answer
    assert answer.message.role == "assistant"
    assert answer.message.content or answer.message.tool_calls
    print(f"served policy: {QUESTION!r} -> calculator({arguments}) = {result!r} -> {answer.message.content!r}")


def test_token_in_token_out_and_weight_sync_still_work(server, final_policy):
    """VLLMBackend's requests against the tokenizer-carrying server: token ids in and out with the trainer's
    logprobs, and an in-memory weight sync takes effect (then the trained weights are restored)."""
    import jax
    from transformers import AutoTokenizer

    from agentfly_jax.models import load_pretrained
    from agentfly_jax.rollout.backends import VLLMBackend
    from agentfly_jax.rollout.templates import encode_conversation

    directory = final_policy[1]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model, params = load_pretrained(directory)
    stops = json.load(open(os.path.join(directory, "generation_config.json")))["eos_token_id"]
    prompt = encode_conversation(tokenizer, [{"role": "user", "content": QUESTION}], tools=[CALCULATOR],
                                 add_generation_prompt=True).token_ids
    halved = jax.tree.map(lambda x: x * 0.5, params)

    async def go():
        async with VLLMBackend(server.url, model) as backend:
            [trained] = await backend.generate(prompt, max_tokens=40, temperature=1.0, stop_token_ids=stops, seed=1)
            await backend.update_weights(halved, version=1)
            [other] = await backend.generate(prompt, max_tokens=12, temperature=1.0, seed=2)
            await backend.update_weights(params, version=2)
            return trained, other

    trained, other = asyncio.run(go())
    assert trained.finish_reason == "stop" and trained.token_ids[-1] in stops
    np.testing.assert_allclose(trained.logprobs, trainer_logprobs(model, params, prompt, trained.token_ids, 1.0),
                               atol=1e-4, rtol=0)
    assert other.weight_version == 1 and len(other.token_ids) == 12
    np.testing.assert_allclose(other.logprobs, trainer_logprobs(model, halved, prompt, other.token_ids, 1.0),
                               atol=1e-4, rtol=0)
