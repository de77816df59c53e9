"""Scripted policies (oracle, random) and SFT demonstrations of the BFCL environment."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from environments.bfcl.agent import system_message_with_tools
from environments.bfcl.data import format_result, new_instances, public_methods

#: The assistant's short message closing each user turn in the demonstrations.
TURN_DONE = "Done."


def oracle_policy(task: Mapping[str, Any], rng: random.Random):
    """Replays the ground-truth calls of every user turn, in order, then answers."""
    for turn in task["ground_truth"]:
        for call in turn:
            yield {"name": call["name"], "arguments": dict(call["arguments"])}
    return TURN_DONE


def _random_value(schema: Mapping[str, Any], rng: random.Random) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_random_value(schema.get("items", {"type": "string"}), rng) for _ in range(rng.randint(0, 2))]
    if kind == "object":
        return {}
    return rng.choice(["a", "test", "file.txt", "user", "USD", "..", "data"])


def random_call(functions: Sequence[Mapping[str, Any]], rng: random.Random) -> dict:
    """A call of a random function of the task with random arguments of the right types (its required ones
    and, half the time, each optional one)."""
    function = rng.choice(list(functions))["function"]
    parameters = function["parameters"]
    required = set(parameters.get("required", []))
    arguments = {name: _random_value(schema, rng) for name, schema in parameters.get("properties", {}).items()
                 if name in required or rng.random() < 0.5}
    return {"name": function["name"], "arguments": arguments}


def random_policy(task: Mapping[str, Any], rng: random.Random, calls_per_turn: int = 2):
    """`calls_per_turn` random calls per user turn of the task's functions, then answers: the floor."""
    for _ in range(calls_per_turn * len(task["user_turns"])):
        yield random_call(task["functions"], rng)
    return TURN_DONE


def truncate(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with the note the tool runtime adds (`agentfly_jax.tools.execute`)."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[observation truncated: the tool returned {len(text)} characters, the limit is {limit}]"


def expert_conversation(task: Mapping[str, Any], system_prompt: str, max_observation_chars: int) -> list[dict]:
    """The ground truth as a conversation: per user turn, one assistant tool call per ground-truth call with the
    real backend output as its observation, then a short final message."""
    instances = new_instances(task["initial_config"], task["involved_classes"])
    methods = public_methods(instances, task.get("excluded_functions", []))
    messages = [{"role": "system", "content": system_message_with_tools(system_prompt, task["functions"])}]
    for user_text, calls in zip(task["user_turns"], task["ground_truth"]):
        messages.append({"role": "user", "content": user_text})
        for call in calls:
            observation = format_result(methods[call["name"]](**call["arguments"]))
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {
                                 "name": call["name"], "arguments": dict(call["arguments"])}}]})
            messages.append({"role": "tool", "name": call["name"],
                             "content": truncate(observation, max_observation_chars)})
        messages.append({"role": "assistant", "content": TURN_DONE})
    return messages


def baseline_conversation(task: Mapping[str, Any], system_prompt: str) -> list[dict]:
    """The weaker behaviour: every user turn answered without a tool call."""
    messages = [{"role": "system", "content": system_message_with_tools(system_prompt, task["functions"])}]
    for user_text in task["user_turns"]:
        messages.append({"role": "user", "content": user_text})
        messages.append({"role": "assistant", "content": TURN_DONE})
    return messages


def make_demonstrations(system_prompt: str, max_observation_chars: int):
    """`demonstrations(tasks, rng, expert_fraction)` per the EnvSpec contract."""

    def demonstrations(tasks: Sequence[Mapping[str, Any]], rng: random.Random,
                       expert_fraction: float) -> list[list[dict]]:
        return [expert_conversation(task, system_prompt, max_observation_chars) if rng.random() < expert_fraction
                else baseline_conversation(task, system_prompt) for task in tasks]

    return demonstrations
