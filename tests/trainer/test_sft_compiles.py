"""The SFT stage compiles its step once per batch shape: its fresh state enters the first step placed as the
step returns it (a first call on an uncommitted optimiser state compiled the same program again at step 2, ~8 s
of a tiny model's run on a CPU, ~22 s of SmolLM2-135M's)."""
import jax

from agentfly_jax.trainer import loop
from experiments.quickstart import get_config


def test_an_sft_stage_of_one_batch_shape_compiles_its_step_once(tmp_path, monkeypatch):
    c = get_config("cpu")
    c.workdir, c.progress = str(tmp_path), False
    c.sft.update(dict(stages=((3, 1.0),), batch_size=16))
    c.sft.optimizer.decay_steps = 3
    c.eval.update(dict(num_tasks=0, before_sft=False))
    c.seq_buckets, c.row_bucket = (256,), 32  # one row length, one row count: every batch has one shape
    shapes = []
    take = loop.take_minibatch

    def recording(rows, k):
        shapes.append(rows.tokens.shape)
        return take(rows, k)

    monkeypatch.setattr(loop, "take_minibatch", recording)
    run = loop.setup(c)
    try:
        before = dict(run.traces)
        loop.run_sft(run)
        assert len(shapes) == 3 and len(set(shapes)) == 1, shapes
        assert run.traces["sft_step"] - before.get("sft_step", 0) == 1, dict(run.traces)
        # the warm-started policy is handed back placed as the run's state
        leaf = jax.tree.leaves(run.state.policy.params)[0]
        assert leaf.sharding == jax.tree.leaves(run.shardings.policy.params)[0]
    finally:
        loop._close_run(run)
