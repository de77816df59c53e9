"""ALFWorld on a real pretrained model: SmolLM2-135M-Instruct acts in household games as a ReAct agent.

    agentfly-train --config experiments/smollm2_alfworld.py            # an accelerator machine with TextWorld
    agentfly-train --config experiments/smollm2_alfworld.py:cpu_small  # the learning run that fits a 2-core CPU
    agentfly-train --config experiments/smollm2_alfworld.py:cpu        # plumbing run on a CPU (tiny model)

Games of the six ALFWorld task types generated offline from ALFWorld's PDDL domain (environments/alfworld), on
the real TextWorld engine; reward 1.0 when the goal is reached. The model has never seen the ReAct format or
the game: a short SFT warm start on demonstrations recorded from the scripted players (the engine planner's
expert plan on half the games, random admissible commands on the rest), then GRPO.

Where it runs: TextWorld and its engine (jericho >= 3.3, fast-downward) have no wheels for the GPU machine's
Python 3.12 and that machine has no network, so the engine cannot be installed there as carried wheels; the
`cpu_small` variant is the size that fits this repository's 2-core CPU machine (few games, short chains).
"""
from experiments.common import base, smollm2, smollm2_cpu, smollm2_grpo, smollm2_sft


def get_config(arg: str | None = None):
    c = base("runs/smollm2_alfworld", "alfworld", suite_dir="", num_train_games=240, num_test_games=60,
             max_steps=30, pool_size=64, demo_tasks=128)
    smollm2(c, cpu=arg in ("cpu", "cpu_small"))
    c.task.update(dict(num_train=240, num_eval=60))
    c.seq_buckets = (2048, 4096)
    c.agent.update(dict(type="react", max_turns=20, max_new_tokens=64, max_context_tokens=4096,
                        max_observation_chars=800))
    c.jax_sampler.update(dict(max_slots=128, max_len=4096, steps_per_call=16))
    smollm2_sft(c, ((80, 1.0), (40, 0.5)), batch_size=16)
    smollm2_grpo(c, steps=40, tasks_per_step=16, chains_per_task=8, eval_tasks=60, eval_chains=3)
    if arg == "cpu_small":  # 24 train / 8 held-out games (x 16 chains = 128 episodes), 8-turn chains, 4 x 4 a step
        c.env.options.update(dict(num_train_games=24, num_test_games=8, max_steps=10, pool_size=8, demo_tasks=24))
        c.task.update(dict(num_train=24, num_eval=8))
        # 1k-token chains and one 1k-token row per micro-batch: the CPU backend keeps every layer's [heads, T, T]
        # attention for the backward pass (2k-token rows asked for 68 GB); demonstrations are cut to 1k tokens
        c.seq_buckets = (1024,)
        c.model.remat = False
        c.agent.update(dict(max_turns=8, max_new_tokens=32, max_context_tokens=1024, max_observation_chars=400))
        c.jax_sampler.update(dict(max_slots=32, max_len=1024, steps_per_call=8))
        smollm2_sft(c, ((30, 1.0), (10, 0.5)), batch_size=4)
        c.sft.cut_long = True
        c.rl.update(dict(steps=8, tasks_per_step=4, chains_per_task=4, mini_batches=1, micro_batch_tokens=1024))
        c.eval.update(dict(every=0, num_tasks=8, num_chains=16))
    elif arg == "cpu":
        c.env.options.update(dict(num_train_games=4, num_test_games=2, pool_size=2, demo_tasks=2))
        smollm2_cpu(c, real_model=False)  # the real model: the arithmetic recipe's :cpu
        c.task.num_train = 4
    elif arg:
        raise ValueError(f"experiments/smollm2_alfworld.py takes no argument, 'cpu' or 'cpu_small', got {arg!r}")
    return c
