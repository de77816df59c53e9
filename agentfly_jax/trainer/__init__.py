"""Train state, batching, the jitted update step (and, later, the RL loop)."""
from agentfly_jax.trainer.batching import (
    PackedBatch,
    build_update_batch,
    choose_bucket,
    first_fit_decreasing,
    loss_token_weights,
    pack,
    split_microbatches,
)
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
    LossConfig,
    accumulate_gradients,
    make_logprob_fn,
    make_sft_step,
    make_train_step,
    make_value_fn,
    token_logprobs,
)
