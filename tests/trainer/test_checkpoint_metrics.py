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


def _largest_file(directory) -> str:
    files = [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]
    return max(files, key=os.path.getsize)


def test_a_flipped_byte_is_caught_by_the_checksums_and_the_step_can_be_saved_again(tmp_path, caplog):
    """One flipped bit in the stored array data loads without any error from orbax (the values are simply
    wrong); the checksums catch it: the checkpoint is skipped, and the step retrained after it is saved again."""
    import orbax.checkpoint as ocp

    def tree(x):
        return {"params": {"w": jnp.asarray(np.arange(4096, dtype=np.float32) + x)}}

    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1)
    ckpt.save(1, tree(1.5), {"step": 1})
    ckpt.save(2, tree(2.5), {"step": 2})
    ckpt.close()
    data = _largest_file(tmp_path / "ckpt" / "2" / "state")
    with open(data, "rb") as fh:
        raw = bytearray(fh.read())
    raw[len(raw) // 2] ^= 0x40
    with open(data, "wb") as fh:
        fh.write(bytes(raw))
    # what a plain orbax restore returns: no error, different numbers
    plain = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree(0.0))
    loaded = plain.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                      meta=ocp.args.JsonRestore()))
    assert not np.array_equal(np.asarray(loaded["state"]["params"]["w"]), np.asarray(tree(2.5)["params"]["w"]))
    plain.close()

    again = Checkpointer(str(tmp_path / "ckpt"), every=1)
    with caplog.at_level(logging.WARNING):
        step, restored, meta = again.restore_latest(tree(0.0))
    assert step == 1 and meta == {"step": 1}  # the checksums are checked, not handed back
    np.testing.assert_array_equal(restored["params"]["w"], tree(1.5)["params"]["w"])
    assert any("skipping checkpoint 2" in r.message and "checksums" in r.message for r in caplog.records)
    assert again.skipped and again.skipped[0][0] == 2
    # nothing is deleted at restore (a load can fail for a passing reason) ...
    assert 2 in again.manager.all_steps() and not (tmp_path / "ckpt.corrupt").exists()
    # ... but the retrained step is written again, the broken copy kept aside for inspection
    assert again.save(2, tree(2.5), {"step": 2})
    assert [p.name.split("-")[0] for p in (tmp_path / "ckpt.corrupt").iterdir()] == ["2"]
    assert not again.save(2, tree(9.5), {"step": 2})  # a step saved by this run is not overwritten
    step, restored, _ = Checkpointer(str(tmp_path / "ckpt"), every=1).restore_latest(tree(0.0))
    assert step == 2
    np.testing.assert_array_equal(restored["params"]["w"], tree(2.5)["params"]["w"])


def test_checksums_cover_every_dtype_a_state_holds():
    """bf16 (no buffer format of its own), empty, 0-d and integer arrays are hashed; one changed value changes
    its array's checksum only."""
    from agentfly_jax.trainer.checkpoint import checksums

    tree = {"bf16": jnp.arange(6, dtype=jnp.bfloat16), "empty": jnp.zeros((0, 3)), "scalar": jnp.int32(7),
            "f32": jnp.ones((2, 2))}
    first = checksums(tree)
    assert set(first) == {"['bf16']", "['empty']", "['scalar']", "['f32']"}
    changed = checksums({**tree, "bf16": tree["bf16"].at[5].set(9)})
    assert [k for k in first if first[k] != changed[k]] == ["['bf16']"]
    assert checksums({**tree, "f32": tree["f32"].astype(jnp.bfloat16)})["['f32']"] != first["['f32']"]


def test_a_checksum_that_does_not_match_skips_the_checkpoint(tmp_path):
    """The comparison itself: a checkpoint whose recorded checksum is not its data's is never loaded."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1)
    ckpt.save(1, _tree(1), {"step": 1})
    ckpt.save(2, _tree(2), {"step": 2})
    ckpt.close()
    meta_file = next(p for p in (tmp_path / "ckpt" / "2" / "meta").rglob("*") if p.is_file()
                     and "checksums" in p.read_text(errors="ignore"))
    text = meta_file.read_text()
    first = text.index('"checksums"')
    digit = text.index('": "', first) + 4
    meta_file.write_text(text[:digit] + ("0" if text[digit] != "0" else "1") + text[digit + 1:])
    step, _, _ = Checkpointer(str(tmp_path / "ckpt"), every=1).restore_latest(_tree(0))
    assert step == 1


def test_non_finite_state_is_never_checkpointed_or_exported():
    """The trainer's guard before every checkpoint and the final export names the tensors that hold NaN/inf."""
    import pytest

    from agentfly_jax.trainer.loop import NonFiniteTrainingError, _check_finite

    good = _tree(1)
    _check_finite(good, "checkpoint step 1")  # ints and finite floats pass
    for bad_value in (jnp.nan, jnp.inf, -jnp.inf):
        bad = {**good, "params": {**good["params"], "w": good["params"]["w"].at[2, 1].set(bad_value)}}
        with pytest.raises(NonFiniteTrainingError, match=r"refusing to checkpoint step 1: 1 tensors hold NaN or inf "
                                                         r"\(first: \['params'\]\['w'\]\)"):
            _check_finite(bad, "checkpoint step 1")


def test_a_checkpoint_of_another_state_layout_is_refused_not_skipped(tmp_path):
    """A setting that decides the state's layout (optimizer.fused): a checkpoint saved under another value stops the
    resume with a ConfigError naming the key, and nothing is moved aside; one saved before the key existed counts
    as its default."""
    import pytest

    from agentfly_jax.trainer.config import ConfigError

    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1)
    ckpt.save(1, _tree(1), {"step": 1})  # no key: saved as "off"
    ckpt.save(2, _tree(2), {"step": 2, "optimizer_fused": "stacked"})
    with pytest.raises(ConfigError, match=r"checkpoint 2 .* optimizer_fused='stacked', this run has 'off'"):
        ckpt.restore_latest(_tree(0), settings={"optimizer_fused": ("off", "off")})
    assert sorted(ckpt.manager.all_steps()) == [1, 2] and not ckpt.skipped
    step, _, _ = ckpt.restore_latest(_tree(0), settings={"optimizer_fused": ("stacked", "off")})
    assert step == 2
    ckpt.manager.delete(2)
    with pytest.raises(ConfigError, match=r"checkpoint 1 .* optimizer_fused='off', this run has 'stacked'"):
        ckpt.restore_latest(_tree(0), settings={"optimizer_fused": ("stacked", "off")})
    assert ckpt.restore_latest(_tree(0), settings={"optimizer_fused": ("off", "off")})[0] == 1
    ckpt.close()


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
