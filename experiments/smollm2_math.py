"""Math word problems with a Python tool and GRPO: a tool-calling agent solves reasoning-gym gsm_symbolic
problems (environments/math_word) by running Python in its sandboxed `code_interpreter` session, then answers
in \\boxed{}, graded by math-verify (`math_verify_match`).

    agentfly-train --config experiments/smollm2_math.py                    # tiny random policy (plumbing)
    agentfly-train --config experiments/smollm2_math.py:cpu                # CPU plumbing check
    python scripts/eval_env.py --env math_word --agent oracle --num 100    # the oracle reaches reward 1.0

The run starts with an SFT warm start on the environment's demonstrations (a short program redoing the worked
solution's arithmetic, run with the tool, then the boxed result; `environments.math_word.tasks`), all of them
using the tool, then GRPO over 8 chains per problem. A problem needs one or two tool calls: 3 turns, 256 new
tokens a turn (a short program) and a 2,048-token context hold a whole chain with the tool schema. The policy is
the tiny random Qwen2-architecture model with the Qwen2.5 tokenizer until a real checkpoint is set
(model.hf_path / tokenizer.path); the code sandbox needs bubblewrap (or env.options.backend="docker").
"""
from experiments.common import agentfly_grpo, base, cpu_plumbing, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/smollm2_math", "math_word", train_size=5000, dev_size=200, test_size=300, backend="bwrap",
             timeout=10.0, pool_size=64, max_turns=3)
    agentfly_grpo(c)
    c.task.update(dict(num_train=0, num_eval=200, eval_split="dev"))
    tiny_policy(c)
    c.seq_buckets = (1024, 2048)
    c.agent.update(dict(max_turns=3, max_new_tokens=256, max_context_tokens=2048, max_observation_chars=2000))
    c.jax_sampler.update(dict(max_slots=64, max_len=2048))
    c.sft.update(dict(stages=((300, 1.0),), batch_size=32))
    c.sft.optimizer.update(dict(learning_rate=5e-5, warmup_steps=20))
    c.rl.update(dict(steps=200, tasks_per_step=8, chains_per_task=8))
    c.eval.update(dict(every=20, num_tasks=200))
    if arg == "cpu":
        cpu_plumbing(c, context=1024, buckets=(1024,), turns=2, new_tokens=48)
        c.env.options.update(dict(pool_size=4, train_size=200, dev_size=20, test_size=20))
        c.sft.update(dict(stages=((2, 1.0),), batch_size=4))
        c.sft.optimizer.warmup_steps = 0  # two SFT steps at the full learning rate
    elif arg:
        raise ValueError(f"experiments/smollm2_math.py takes no argument or 'cpu', got {arg!r}")
    return c
