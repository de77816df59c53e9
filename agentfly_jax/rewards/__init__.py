"""Rewards: the `@reward` decorator (dataset fields by parameter name) and built-in math/QA rewards
(`math_match`, `math_verify_match` graded by math-verify, `qa_exact_match`, `qa_f1`), and `LLMJudge`, a
reward graded by a judge model behind any generation backend."""

from agentfly_jax.rewards.decorator import (
    REWARD_REGISTRY,
    Reward,
    RewardBindingError,
    RewardResult,
    as_reward,
    reward,
)
from agentfly_jax.rewards.extract import (
    extract_answer,
    extract_answer_phrase,
    extract_answer_tag,
    extract_boxed,
    extract_final_answer_line,
)
from agentfly_jax.rewards.judge import JudgeVerdict, LLMJudge, parse_verdict
from agentfly_jax.rewards.math_answers import (
    grade_math_answer,
    math_answers_equal,
    math_match,
    normalize_math_answer,
    parse_number,
    unbox,
)
from agentfly_jax.rewards.math_verify import grade_with_math_verify, math_verify_equal, math_verify_match
from agentfly_jax.rewards.qa import normalize_qa_answer, qa_exact_match, qa_f1, token_f1

__all__ = [
    "REWARD_REGISTRY",
    "JudgeVerdict",
    "LLMJudge",
    "Reward",
    "RewardBindingError",
    "RewardResult",
    "as_reward",
    "extract_answer",
    "extract_answer_phrase",
    "extract_answer_tag",
    "extract_boxed",
    "extract_final_answer_line",
    "grade_math_answer",
    "grade_with_math_verify",
    "math_answers_equal",
    "math_match",
    "math_verify_equal",
    "math_verify_match",
    "normalize_math_answer",
    "normalize_qa_answer",
    "parse_number",
    "parse_verdict",
    "qa_exact_match",
    "qa_f1",
    "reward",
    "token_f1",
    "unbox",
]
