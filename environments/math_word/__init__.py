"""Math word problems with a Python tool: reasoning-gym's `gsm_symbolic` (GSM8K templates with fresh names and
numbers), solved by running Python in the chain's sandboxed `code_interpreter` session and graded by
`math_verify_match` (math-verify on the final `\\boxed{}`).

`env_spec(**options)` is the EnvSpec (entry point `math_word`). Splits come from disjoint generator seeds and
share no question (`tasks`). The oracle prints the gold answer through the tool and boxes it: an upper bound
that checks tool, sandbox and reward agree, not a solver. The SFT demonstrations (`tasks.demonstration`) run a
short program redoing the arithmetic of reasoning-gym's worked solution for the problem (`answer_cot`; each
checked step becomes `stepN = ...`, earlier results reused by name) and box what it printed; rows whose
solution text does not convert (about 8%) and the non-expert share show a boxed guess without the tool.
"""

from environments.math_word.spec import SYSTEM_PROMPT, env_spec, oracle_policy, random_policy
from environments.math_word.tasks import (
    demonstration,
    generate_split,
    program_output,
    solution_program,
    solution_steps,
)

__all__ = [
    "SYSTEM_PROMPT",
    "demonstration",
    "env_spec",
    "generate_split",
    "oracle_policy",
    "program_output",
    "random_policy",
    "solution_program",
    "solution_steps",
]
