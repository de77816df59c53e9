"""A user's own task, as `experiments/custom_task.py` trains it: unit conversions with a `convert_units` tool.

Everything here is what a user writes for their own task: JSONL rows (`train.jsonl`, `eval.jsonl`, built by
`python -m experiments.custom_task_example.make_data`), a stateless @tool and a @reward, given to the trainer
by import path (`experiments.custom_task_example.tools:convert_units`, `...rewards:close_to_answer`).
"""
