"""The trainer: typed config, the one batch path, train state, the jitted update and the RL loop."""
from agentfly_jax.trainer.batch import (
    PackedRows,
    UpdateBatch,
    VisionRows,
    assign_minibatches,
    choose_bucket,
    first_fit_decreasing,
    pack_step,
    pack_vision,
    unpack_rows,
)
from agentfly_jax.trainer.config import ConfigError, TrainConfig, default_config
from agentfly_jax.trainer.state import (
    ModelState,
    OptimizerConfig,
    TrainState,
    create_train_state,
    learning_rate_schedule,
    make_optimizer,
    state_shardings,
)
from agentfly_jax.trainer.update import (
    accumulate_gradients,
    make_prepare_fn,
    make_sft_step,
    make_train_step,
    take_minibatch,
    token_logprobs,
)

__all__ = [
    "ConfigError",
    "ModelState",
    "OptimizerConfig",
    "PackedRows",
    "TrainConfig",
    "TrainState",
    "UpdateBatch",
    "VisionRows",
    "accumulate_gradients",
    "assign_minibatches",
    "choose_bucket",
    "create_train_state",
    "default_config",
    "first_fit_decreasing",
    "learning_rate_schedule",
    "make_optimizer",
    "make_prepare_fn",
    "make_sft_step",
    "make_train_step",
    "pack_step",
    "pack_vision",
    "state_shardings",
    "take_minibatch",
    "token_logprobs",
    "unpack_rows",
]
