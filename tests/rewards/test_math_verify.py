"""`math_verify_match`: math-verify's grading (fractions vs decimals, LaTeX vs plain, sets and intervals, boxed
answers on either side) behind a bounded, thread-safe call that never raises."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("math_verify")

from agentfly_jax.rewards import REWARD_REGISTRY, math_verify_equal, math_verify_match
from agentfly_jax.rewards import math_verify as mv


def score(prediction, answer):
    return math_verify_match.func(prediction=prediction, answer=answer)


@pytest.mark.parametrize(
    "prediction, gold",
    [
        ("So the total is \\boxed{288}.", "288"),
        ("\\boxed{0.5}", "$\\frac{1}{2}$"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{\\dfrac{1}{2}}", "1/2"),
        ("\\boxed{42}", "\\boxed{42}"),  # boxed on both sides
        ("\\boxed{\\sqrt{2}}", "$\\sqrt{2}$"),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),  # sets are unordered
        ("\\boxed{[1, 2)}", "$[1,2)$"),  # intervals
        ("\\boxed{x = 3}", "3"),  # an assignment's value
        ("\\boxed{1,234}", "1234"),
        ("\\boxed{5906.25}", "5906.25"),
        ("\\boxed{18.90}", "\\$18.90"),  # an escaped dollar sign is money, not a math delimiter
        ("Working... then \\boxed{3} and finally \\boxed{7}", "7"),  # the last box counts
        ("There are 12 apples left, so the answer is 12", "12"),  # no box: math-verify's own extraction
    ],
)
def test_equal_answers_score_one(prediction, gold):
    result = score(prediction, gold)
    assert result["reward"] == 1.0, result


@pytest.mark.parametrize(
    "prediction, gold",
    [
        ("\\boxed{289}", "288"),
        ("\\boxed{0.51}", "$\\frac{1}{2}$"),
        ("\\boxed{[1, 2]}", "[1,2)"),  # closed vs half-open
        ("\\boxed{\\{1, 3\\}}", "\\{1,2\\}"),
        ("\\boxed{7} ... \\boxed{3}", "7"),  # an earlier box does not count
    ],
)
def test_wrong_answers_score_zero(prediction, gold):
    result = score(prediction, gold)
    assert result["reward"] == 0.0 and result["reason"], result


@pytest.mark.parametrize("prediction", ["", "   ", "\\boxed{}", "no answer at all", "\\boxed{\\frac{", "}}}{{{\\\\",
                                        "\x00\x01 binary"])
def test_junk_scores_zero_without_raising(prediction):
    result = score(prediction, "42")
    assert result["reward"] == 0.0


def test_list_of_golds_and_junk_golds():
    assert score("\\boxed{0.5}", ["2", "1/2"])["reward"] == 1.0
    assert score("\\boxed{5}", [])["reward"] == 0.0
    assert score("\\boxed{5}", None)["reward"] == 0.0
    assert score("\\boxed{5}", "\\frac{")["reward"] == 0.0
    assert math_verify_equal("42", "x" * (mv.MAX_ANSWER_CHARS + 1)) == {
        "equal": False, "reason": f"answer of {mv.MAX_ANSWER_CHARS + 1} characters is too long to grade"}


def test_huge_expressions_are_bounded_in_time():
    start = time.monotonic()
    result = score("\\boxed{(10^{10^{10}})!}", "5")
    assert result["reward"] == 0.0 and time.monotonic() - start < mv.HARD_TIMEOUT_SECONDS + 5
    # a helper that overruns the hard limit (here below math-verify's own 3 s) is killed, and the next grading
    # starts a fresh one
    start = time.monotonic()
    graded = math_verify_equal("5", "(10^{10^{10}})!", timeout=0.5)
    assert graded["equal"] is False and "within 0.5 s" in graded["reason"]
    assert time.monotonic() - start < 3
    assert score("\\boxed{0.5}", "1/2")["reward"] == 1.0  # the pool recovered


def test_safe_from_worker_threads_and_the_reward_runtime():
    cases = [("\\boxed{0.5}", "1/2", 1.0), ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0), ("\\boxed{3}", "4", 0.0),
             ("\\boxed{\\frac{1}{3}}", "0.333333", 1.0)] * 3
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda case: score(case[0], case[1])["reward"], cases))
    assert results == [expected for _, _, expected in cases]
    seen = []
    thread = threading.Thread(target=lambda: seen.append(score("\\boxed{\\frac{6}{4}}", "1.5")))
    thread.start()
    thread.join(30)
    assert seen and seen[0]["reward"] == 1.0
    # the decorator's path: a sync reward runs in the runtime's worker threads
    assert REWARD_REGISTRY["math_verify_match"] is math_verify_match
    result = asyncio.run(math_verify_match.score(prediction="\\boxed{\\dfrac{1}{2}}", task={"answer": "0.5"}))
    assert result.ok and result.reward == 1.0 and result.extras["extracted"] == "\\dfrac{1}{2}"


def test_close_workers_then_grade_again():
    assert score("\\boxed{2/4}", "0.5")["reward"] == 1.0
    mv.close_workers()
    assert score("\\boxed{2/4}", "0.5")["reward"] == 1.0


def test_a_helpers_start_is_not_part_of_the_grading_time(monkeypatch):
    # a new helper says it is ready after importing math-verify, before its first grading's clock starts
    worker = mv._Worker()
    try:
        worker.wait_ready()
        assert worker.ready and worker.grade({"gold": "1/2", "prediction": "0.5", "boxed": True}, 30)["equal"]
    finally:
        worker.kill()
    graded_when = []
    grade = mv._Worker.grade

    def recording_grade(self, request, timeout):
        graded_when.append(self.ready)
        return grade(self, request, timeout)

    monkeypatch.setattr(mv._Worker, "grade", recording_grade)
    mv.close_workers()  # the next grading starts a fresh helper
    assert score("\\boxed{0.5}", "1/2")["reward"] == 1.0 and graded_when == [True]
    # a helper that does not come up in time is a failed grading with the reason, not a hang
    mv.close_workers()
    monkeypatch.setattr(mv, "STARTUP_TIMEOUT_SECONDS", 0.001)
    graded = mv.grade_with_math_verify("1/2", "0.5")
    assert graded["status"] == mv.STATUS_FAILED and "did not start within 0.001 s" in graded["reason"]
