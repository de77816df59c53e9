"""Scoring a BFCL chain the way BFCL's multi-turn checker does: by backend state, turn by turn.

The ground truth's calls run on fresh instances from the task's `initial_config`; after each user turn the
state of every involved instance (its public attributes, BFCL's `state_checker`) is recorded together with
the text results of that turn's calls. A model's user turn k passes when

- state: every instance of the chain's environment at the end of turn k equals the ground truth's after
  turn k (the chain's checkpoint, `BFCLEnv.end_user_turn`, or its final state for the last turn), and
- response (BFCL's `response_checker`): every result of the ground truth's turn-k calls is among the
  results of the model's successful calls up to the end of turn k (unordered, as a multiset) — so a turn
  that only reads (ls, grep, get_stock_info) needs the read to happen, not just an unchanged state.

Turns whose ground truth is empty (the request cannot be done) are not scored, as in BFCL. The reward is
the fraction of scored turns that pass (1.0: every turn), a turn the chain never reached (it ran out of
assistant turns) fails. BFCL itself stops at the first failed turn and gives 0/1; the fraction is our partial
credit for RL, and `success_threshold=1.0` keeps success meaning BFCL's pass.

A chain whose agent does not deliver the later user turns (it ended with a final answer, no checkpoints,
while the task has more turns: e.g. the scripted ReAct agents of `environments/evaluation.py`, where the oracle
replays every turn's calls after the first message) is scored as one turn: its final state and all its
results against the ground truth's final state and all its results (0 or 1).
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from environments.bfcl.data import format_result, new_instances, public_methods
from environments.bfcl.env import snapshot


def _freeze(task: Mapping[str, Any]) -> str:
    # Key order is kept: the backends read it (the file system's root is the config's first directory).
    return json.dumps({k: task[k] for k in ("id", "initial_config", "involved_classes", "ground_truth")})


@functools.lru_cache(maxsize=512)
def _ground_truth_turns(frozen: str) -> tuple[tuple[dict, tuple[str, ...]], ...]:
    task = json.loads(frozen)
    instances = new_instances(task["initial_config"], task["involved_classes"])
    methods = public_methods(instances)
    turns = []
    for calls in task["ground_truth"]:
        results = []
        for call in calls:
            results.append(format_result(methods[call["name"]](**call["arguments"])))
        turns.append((snapshot(instances), tuple(results)))
    return tuple(turns)


def ground_truth_turns(task: Mapping[str, Any]) -> list[tuple[dict, list[str]]]:
    """[(state after turn k, results of turn k's calls)] of the task's ground truth (cached per task)."""
    return [(state, list(results)) for state, results in _ground_truth_turns(_freeze(task))]


def state_differences(model: Mapping[str, dict], truth: Mapping[str, dict]) -> list[str]:
    """'Class.attribute' of every public attribute of the ground truth whose model value differs."""
    differences = []
    for class_name, attributes in truth.items():
        model_attributes = model.get(class_name, {})
        for key, value in attributes.items():
            if key not in model_attributes or model_attributes[key] != value:
                differences.append(f"{class_name}.{key}")
    return differences


def missing_results(truth_results: Sequence[str], model_results: Sequence[str]) -> list[str]:
    """Ground-truth results not found among the model's (each model result counts once)."""
    available = collections.Counter(model_results)
    missing = []
    for result in truth_results:
        if available[result] > 0:
            available[result] -= 1
        else:
            missing.append(result)
    return missing


def score_chain(task: Mapping[str, Any], checkpoints: Sequence[tuple[dict, int]], final_state: dict,
                results: Sequence[str], single_message: bool) -> dict[str, Any]:
    """The reward and its details for a chain (see the module docstring).

    checkpoints: (state, number of results so far) at the end of each user turn the chain finished before
      its last one; final_state / results: the chain's state at its end and every successful call's result.
    single_message: the agent answered without receiving the later user turns.
    """
    truth = ground_truth_turns(task)
    if single_message:
        final_truth_state = truth[-1][0]
        all_truth_results = [r for _, turn_results in truth for r in turn_results]
        differences = state_differences(final_state, final_truth_state)
        missing = missing_results(all_truth_results, results)
        passed = not differences and not missing
        return {"reward": float(passed), "turns_scored": 1, "turns_passed": int(passed), "turns_reached": 1,
                "single_message": True, "state_mismatch": differences[:8], "missing_results": len(missing)}
    points = list(checkpoints) + [(final_state, len(results))]
    scored = passed = 0
    first_failed, why = None, ""
    for k, (truth_state, truth_results) in enumerate(truth):
        if not task["ground_truth"][k]:
            continue
        scored += 1
        if k >= len(points):
            ok, reason = False, "not reached"
        else:
            state, count = points[k]
            differences = state_differences(state, truth_state)
            missing = missing_results(truth_results, results[:count])
            ok = not differences and not missing
            reason = (f"state {', '.join(differences[:4])}" if differences else
                      f"{len(missing)} missing result(s)" if missing else "")
        passed += ok
        if not ok and first_failed is None:
            first_failed, why = k, reason
    reward = passed / scored if scored else 1.0
    out = {"reward": reward, "turns_scored": scored, "turns_passed": passed,
           "turns_reached": min(len(points), len(truth)), "single_message": False}
    if first_failed is not None:
        out["first_failed_turn"] = first_failed
        out["first_failure"] = why
    return out
