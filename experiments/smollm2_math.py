"""Math word problems with a Python tool on a real pretrained model: SmolLM2-135M-Instruct solves reasoning-gym
gsm_symbolic problems (environments/math_word) by running Python in its sandboxed `code_interpreter` session,
then answers in \\boxed{}, graded by math-verify (`math_verify_match`).

    agentfly-train --config experiments/smollm2_math.py                    # one GPU
    agentfly-train --config experiments/smollm2_math.py:cpu                # plumbing run on a CPU (tiny model)
    python scripts/eval_env.py --env math_word --agent oracle --num 100    # the oracle reaches reward 1.0

An SFT warm start on the environment's demonstrations (a short program redoing the worked solution's
arithmetic, run with the tool, then the boxed result; `environments.math_word.tasks`): first all of them with
the tool, then a mix in which half answer with a guess. GRPO follows, 8 chains per problem. A problem needs one
or two tool calls: 3 turns, 256 new tokens a turn and a 2,048-token context hold a chain with the tool schema.
The code sandbox needs bubblewrap (or env.options.backend="docker"). Held-out: 128 test problems, 1 chain each.
"""
from experiments.common import base, smollm2, smollm2_cpu, smollm2_grpo, smollm2_sft


def get_config(arg: str | None = None):
    c = base("runs/smollm2_math", "math_word", train_size=5000, dev_size=200, test_size=300, backend="bwrap",
             timeout=10.0, pool_size=64, max_turns=3)
    smollm2(c, cpu=arg == "cpu")
    c.task.update(dict(num_train=0, num_eval=128))
    c.seq_buckets = (1024, 2048)
    c.agent.update(dict(max_turns=3, max_new_tokens=256, max_context_tokens=2048, max_observation_chars=2000))
    c.jax_sampler.update(dict(max_slots=128, max_len=2048, steps_per_call=16))
    smollm2_sft(c, ((100, 1.0), (50, 0.5)), batch_size=16)
    smollm2_grpo(c, steps=50, tasks_per_step=16, chains_per_task=8)
    if arg == "cpu":
        smollm2_cpu(c, real_model=False)  # the real model: the arithmetic recipe's :cpu
        c.env.options.update(dict(pool_size=4, train_size=200, dev_size=20, test_size=20))
    elif arg:
        raise ValueError(f"experiments/smollm2_math.py takes no argument or 'cpu', got {arg!r}")
    return c
