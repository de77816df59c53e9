"""Checkpoints (save, restore, skip a corrupt one) and TensorBoard files read back."""
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from agentfly_jax.trainer.checkpoint import Checkpointer
from agentfly_jax.trainer.metrics import MetricWriter, read_scalars


def _tree(x):
    return {"params": {"w": jnp.full((4, 3), x, jnp.float32), "b": jnp.arange(3, dtype=jnp.int32) + int(x)},
            "step": jnp.asarray(int(x), jnp.int32)}


def test_save_restore_keeps_last_k(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=2, keep=2)
    assert not ckpt.should_save(0) and not ckpt.should_save(3) and ckpt.should_save(4)
    for step in (2, 4, 6):
        ckpt.save(step, _tree(step), {"step": step, "weight_version": step})
    assert sorted(ckpt.manager.all_steps()) == [4, 6]
    step, tree, meta = ckpt.restore_latest(_tree(0))
    assert step == 6 and meta["weight_version"] == 6
    jax.tree.map(np.testing.assert_array_equal, tree, _tree(6))
    ckpt.close()


def test_corrupt_checkpoint_is_skipped_with_warning(tmp_path, caplog):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1, keep=3)
    ckpt.save(1, _tree(1), {"step": 1, "weight_version": 1})
    ckpt.save(2, _tree(2), {"step": 2, "weight_version": 2})
    # corrupt every data file of the newest checkpoint
    newest = tmp_path / "ckpt" / "2"
    damaged = 0
    for root, _, files in os.walk(newest):
        for f in files:
            path = os.path.join(root, f)
            if os.path.getsize(path) > 0 and not f.startswith("_CHECKPOINT_METADATA"):
                with open(path, "r+b") as fh:
                    fh.truncate(max(0, os.path.getsize(path) // 3))
                damaged += 1
    assert damaged
    with caplog.at_level(logging.WARNING):
        step, tree, meta = Checkpointer(str(tmp_path / "ckpt"), every=1).restore_latest(_tree(0))
    assert step == 1 and meta["step"] == 1
    jax.tree.map(np.testing.assert_array_equal, tree, _tree(1))
    assert any("skipping checkpoint 2" in r.message for r in caplog.records)


def test_no_checkpoint_returns_none(tmp_path):
    assert Checkpointer(str(tmp_path / "empty"), every=1).restore_latest(_tree(0)) is None


def test_tensorboard_scalars_and_text_read_back(tmp_path):
    writer = MetricWriter(str(tmp_path / "tb"))
    writer.scalars(1, {"reward/mean": 0.25, "policy/approx_kl": 0.01})
    writer.scalars(2, {"reward/mean": 0.5, "policy/approx_kl": float("nan")})
    writer.text(2, "eval/sample_trajectory", "hello")
    writer.close()
    scalars = read_scalars(str(tmp_path / "tb"))
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["policy/approx_kl"] == [(1, 0.01)] or np.isclose(scalars["policy/approx_kl"][0][1], 0.01)
    lines = (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()
    assert '"policy/approx_kl": "nan"' in lines[1]  # kept in the JSONL, not silently dropped
