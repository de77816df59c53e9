"""The example task's reward: 1.0 when the final answer is within 0.1% of the dataset's `answer`."""
from agentfly_jax.rewards import reward
from agentfly_jax.rewards.math_answers import parse_number


@reward
def close_to_answer(prediction: str, answer: float) -> dict:
    """1.0 if the last number in the final answer is within 0.1% of `answer` (a dataset field), else 0.0."""
    words = [w.strip(".,;:!?") for w in prediction.split()]
    numbers = [n for n in (parse_number(w) for w in words) if n is not None]
    if not numbers:
        return {"reward": 0.0, "parsed": None}
    guess = numbers[-1]
    return {"reward": float(abs(guess - answer) <= 1e-3 * max(abs(answer), 1e-9)), "parsed": guess}
