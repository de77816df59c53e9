"""Wikipedia search QA on a real pretrained model: SmolLM2-135M-Instruct answers questions with a `search` tool.

    agentfly-train --config experiments/smollm2_search.py              # one GPU
    agentfly-train --config experiments/smollm2_search.py:cpu          # plumbing run on a CPU (tiny model)

The search environment (environments/search): generated single-hop questions (birth/death years, descriptions,
cloze) over the offline Wikipedia-summaries corpus, answered with `search(query, k)` and scored by exact match.
`env.options.retriever` picks BM25 (default here: the index travels to a GPU machine as is), the dense
retriever, or "hybrid" (both, fused by reciprocal rank; recall figures in docs/benchmarks.md). The model has
never seen the tool format: a short SFT warm start on demonstrations recorded from the environment's scripted
searchers (the oracle on half of them, the random searcher on the rest: `recorded_demonstrations`), then GRPO.
"""
from experiments.common import base, smollm2, smollm2_cpu, smollm2_grpo, smollm2_sft


def get_config(arg: str | None = None):
    c = base("runs/smollm2_search", "search", question_set="generated", retriever="bm25", pool_size=64,
             demo_tasks=512)
    smollm2(c, cpu=arg == "cpu")
    c.task.update(dict(num_train=0, num_eval=128))
    c.seq_buckets = (1024, 2048)
    c.agent.update(dict(max_turns=4, max_new_tokens=64, max_context_tokens=2048, max_observation_chars=1500))
    c.jax_sampler.update(dict(max_slots=128, max_len=2048, steps_per_call=16))
    smollm2_sft(c, ((60, 1.0), (40, 0.5)), batch_size=16)
    smollm2_grpo(c, steps=50, tasks_per_step=16, chains_per_task=8)
    if arg == "cpu":
        c.env.options.update(dict(demo_tasks=8, pool_size=4))
        smollm2_cpu(c, real_model=False)  # the real model: the arithmetic recipe's :cpu
    elif arg:
        raise ValueError(f"experiments/smollm2_search.py takes no argument or 'cpu', got {arg!r}")
    return c
