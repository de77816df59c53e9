"""Arithmetic tasks that need the `calculator` tool: the quickstart's task family.

Project-generated (no download): questions, gold answers, synthetic demonstrations for SFT (a configurable
fraction of which answer by guessing instead of calling the tool), a small tokenizer trained on them, and
`env_spec(**options)`, the environment's EnvSpec (`environments.arithmetic.spec`).
"""
from environments.arithmetic.spec import env_spec
from environments.arithmetic.tasks import ArithmeticTaskConfig, demonstration, generate_tasks
from environments.arithmetic.tokenizer import CHAT_TEMPLATE, build_tokenizer

__all__ = ["ArithmeticTaskConfig", "generate_tasks", "demonstration", "build_tokenizer", "CHAT_TEMPLATE", "env_spec"]
