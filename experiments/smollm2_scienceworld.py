"""ScienceWorld on a real pretrained model: SmolLM2-135M-Instruct runs science experiments as a ReAct agent.

    agentfly-train --config experiments/smollm2_scienceworld.py        # an accelerator machine with Java 17
    agentfly-train --config experiments/smollm2_scienceworld.py:cpu    # plumbing run on a CPU (tiny model)

The ScienceWorld simulator (environments/scienceworld, a JVM per environment) on ten of its task families
(`EVAL_TASK_NAMES`); reward = the simulator's score / 100, success = 1.0 (task completed). The model has never
seen the ReAct format: a short SFT warm start on demonstrations recorded from the scripted players (the
simulator's gold action sequence on half the variations, random valid actions on the rest), then GRPO. On a
GPU machine without Java, `scripts/device/smollm2_gpu.sh java` unpacks a carried JRE first.
"""
from experiments.common import base, smollm2, smollm2_cpu, smollm2_grpo, smollm2_sft


def get_config(arg: str | None = None):
    c = base("runs/smollm2_scienceworld", "scienceworld", task_names="eval", max_steps=30, max_turns=31,
             pool_size=16, random_steps=10, demo_tasks=48)
    smollm2(c, cpu=arg == "cpu")
    c.task.update(dict(num_train=400, num_eval=64))
    c.seq_buckets = (2048, 4096)
    c.agent.update(dict(type="react", max_turns=16, max_new_tokens=48, max_context_tokens=4096,
                        max_observation_chars=800))
    c.jax_sampler.update(dict(max_slots=64, max_len=4096, steps_per_call=16))
    smollm2_sft(c, ((60, 1.0), (30, 0.5)), batch_size=16)
    smollm2_grpo(c, steps=20, tasks_per_step=8, chains_per_task=8, eval_tasks=64, eval_chains=2)
    if arg == "cpu":
        c.env.options.update(dict(task_names="find-animal", pool_size=2, demo_tasks=2))
        smollm2_cpu(c, real_model=False)  # the real model: the arithmetic recipe's :cpu
        c.task.num_train = 4
        c.sft.cut_long = True  # the demonstrated episodes are longer than the plumbing run's 1,024 tokens
    elif arg:
        raise ValueError(f"experiments/smollm2_scienceworld.py takes no argument or 'cpu', got {arg!r}")
    return c
