"""The update path of a vision-language policy (Qwen2.5-VL): trajectories with images, packed several to a row and
split into micro-batches, reach the model with each micro-batch's own images and mRoPE positions, so the logprobs
the trainer computes equal a direct forward of the Flax model on each trajectory alone (fp32); gradients reach the
vision tower; patch buckets bound the compiled shapes; a mesh gives what one device gives; a text-only batch is
packed as for a text policy."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentfly_jax.algorithms.recipes import get_recipe
from agentfly_jax.models import (ModelConfig, Qwen2_5_VLCausalLM, VisionConfig, init_params, mrope_positions,
                                 pad_patches, vision_layout)
from agentfly_jax.images import PreparedImage
from agentfly_jax.rollout.trajectory import Trajectory, trajectories_to_batch
from agentfly_jax.trainer import create_train_state, make_prepare_fn, make_train_step, pack_step, unpack_rows
from agentfly_jax.trainer.batch import MIN_PATCH_BUCKET, patch_bucket
from agentfly_jax.trainer.update import make_sft_step, take_minibatch, token_logprobs

IMAGE, VIDEO, START, END = 60, 61, 62, 63
TEXT = 56  # text tokens are 1..TEXT-1
# window 56 px = 2 x 2 merged tokens: the grids below are split into several windows (block 0), block 1 attends
# over each whole image; head_dim 16 -> mRoPE over 8 frequencies (2 temporal, 3 height, 3 width)
VISION = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, window_size=56,
                      fullatt_block_indexes=(1,), image_token_id=IMAGE, video_token_id=VIDEO,
                      vision_start_token_id=START, vision_end_token_id=END)
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  qkv_bias=True, family="qwen2_5_vl", vision=VISION, mrope_section=(2, 3, 3), rope_theta=100.0)
TOL = {"rtol": 1e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def policy():
    model = Qwen2_5_VLCausalLM(CFG)
    params = init_params(model, jax.random.PRNGKey(0))
    # larger weights than the default init, norms around 1: image features and positions move the logits visibly
    rng = np.random.default_rng(1)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    new = []
    for path, x in leaves:
        name = jax.tree_util.keystr(path)
        noise = rng.normal(size=x.shape).astype(np.float32)
        new.append(jnp.asarray(1.0 + 0.2 * noise if ("norm" in name or "ln_q" in name) else 0.2 * noise))
    return model, jax.tree_util.tree_unflatten(treedef, new)


def _image(height, width, seed):
    return PreparedImage(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _trajectory(rng, images, *, text=(3, 6), tail=5, answer=4):
    """prompt text, then each image as <|vision_start|> pads <|vision_end|> followed by text, then sampled tokens."""
    ids, mask = list(rng.integers(1, TEXT, text[0])), []
    for image in images:
        ids += [START] + [IMAGE] * image.num_tokens + [END] + list(rng.integers(1, TEXT, text[1]))
    ids += list(rng.integers(1, TEXT, tail))
    mask = [0] * len(ids) + [1] * answer
    ids += list(rng.integers(1, TEXT, answer))
    return Trajectory(ids, mask, [0.0] * len(ids), images=list(images), reward=float(rng.normal()))


def _trajectories(seed=0):
    """Eight trajectories: one to three images of several grids each (a 2x3-window grid, a tall one, small ones),
    and two without images."""
    rng = np.random.default_rng(seed)
    a, b, c, d = _image(56, 84, seed), _image(112, 56, seed + 1), _image(56, 56, seed + 2), _image(28, 56, seed + 3)
    groups = [[a], [b, c], [], [d], [c, a, d], [], [b], [d, d]]
    return [_trajectory(rng, images, text=(int(rng.integers(2, 6)), int(rng.integers(1, 4))))
            for images in groups]


REFERENCE_LEN, REFERENCE_PATCHES = 64, 256


@jax.jit
def _forward(params, ids, positions, segment_ids, pixel_values, layout):
    return Qwen2_5_VLCausalLM(CFG).apply({"params": params}, ids, positions, segment_ids, pixel_values=pixel_values,
                                         vision_layout=layout)


def _reference_logprobs(params, trajectory):
    """log p(token t | tokens < t) of one trajectory alone, a batch of one: its mRoPE positions and image layout
    from its own grids (what the model computes itself outside jit), right-padded to one compiled shape (padding
    tokens are another segment, padding patches their own)."""
    n = trajectory.length
    ids = np.zeros((1, REFERENCE_LEN), np.int32)
    ids[0, :n] = trajectory.token_ids
    segments = (np.arange(REFERENCE_LEN) < n).astype(np.int32)[None]
    grid = np.array([im.grid_thw for im in trajectory.images], np.int64).reshape(-1, 3)
    positions = np.zeros((3, 1, REFERENCE_LEN), np.int32)
    positions[:, :, :n] = mrope_positions(CFG, ids[:, :n], grid)
    pixels = [im.pixel_values() for im in trajectory.images]
    pixels = pad_patches(np.concatenate(pixels) if pixels else np.zeros((0, VISION.patch_dim), np.float32),
                         REFERENCE_PATCHES)
    logits = _forward(params, ids, positions, segments, pixels, vision_layout(VISION, grid, REFERENCE_PATCHES))[0]
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    out = np.zeros(n, np.float32)
    out[1:] = np.asarray(jnp.take_along_axis(logprobs[:n - 1], jnp.asarray(ids[0, 1:n, None]), axis=-1)[:, 0])
    return out


def _pack(trajectories, *, row_len=64, micro_batches=2, minibatch=None, num_minibatches=1, **kw):
    arrays = trajectories_to_batch(trajectories, pad_to=row_len, image_token_id=IMAGE)
    n = len(trajectories)
    images = {k: arrays[k] for k in ("pixel_values", "image_grid_thw", "image_rows")} if "image_rows" in arrays else None
    batch = pack_step(arrays["tokens"], arrays["action_mask"], arrays["sampler_logprobs"], arrays["lengths"],
                      rewards=arrays["rewards"], group_ids=np.arange(n) // 2,
                      minibatch=np.zeros(n, np.int32) if minibatch is None else minibatch,
                      num_minibatches=num_minibatches, micro_batches=micro_batches, row_len=row_len, images=images,
                      model_config=CFG, **kw)
    return arrays, batch


def _state(params):
    return create_train_state(jax.tree.map(jnp.copy, params), optax.adam(1e-2))


ALG = get_recipe("grpo").resolve({}, {})
#: Mini-batch 1 gets the two trajectories without images (2 and 5), mini-batch 0 the six with images.
MINIBATCH = np.array([0, 0, 1, 0, 0, 1, 0, 0], np.int32)


@pytest.fixture(scope="module")
def prepare(policy):
    return make_prepare_fn(policy[0], ALG)


@pytest.fixture(scope="module")
def step_batch():
    """The eight trajectories in two mini-batches of two micro-batches of two rows of 64 tokens."""
    return _trajectories(), _pack(_trajectories(), minibatch=MINIBATCH, num_minibatches=2)[1]


def test_packed_logprobs_with_images_equal_each_trajectory_alone(policy, prepare, step_batch):
    model, params = policy
    trajectories, batch = step_batch
    rows = batch.rows
    # what the test covers: rows of two trajectories with images, a row with a text-only one, micro-batches of
    # several mini-batches with images, one without images and an empty one (the tower runs on padding alone)
    assert rows.segment_ids.max(axis=-1).tolist() == [[[2, 2], [2, 0]], [[2, 0], [0, 0]]]
    image_tokens = (rows.tokens == IMAGE).sum(axis=-1)  # [K, M, R]
    assert image_tokens.tolist() == [[[18, 20], [6, 0]], [[0, 0], [0, 0]]]
    real_patches = (rows.vision.full_segments > 0).sum(axis=-1)  # [K, M]: each micro-batch has its own images
    np.testing.assert_array_equal(real_patches, image_tokens.sum(axis=-1) * VISION.merge_unit)
    # the largest micro-batch's 152 patches in a bucket of 256, for every micro-batch
    assert rows.positions.shape == (2, 2, 3, 2, 64) and rows.vision.pixel_values.shape == (2, 2, 256, 1176)

    prepared, metrics = prepare(_state(params), jax.tree.map(jnp.asarray, batch))
    old = unpack_rows(np.asarray(prepared.rows.old_logprobs), batch)
    for i, trajectory in enumerate(trajectories):
        want = _reference_logprobs(params, trajectory)
        np.testing.assert_allclose(old[i, 1:trajectory.length], want[1:], **TOL, err_msg=f"trajectory {i}")
    assert np.isfinite(float(metrics["advantages/std"]))


def test_the_images_and_their_positions_matter(policy):
    """The parity above is not vacuous: another image, or text positions in place of the mRoPE ones, change the
    logprobs well beyond the tolerance."""
    model, params = policy
    trajectory = _trajectories()[0]
    want = _reference_logprobs(params, trajectory)
    other = Trajectory(trajectory.token_ids, trajectory.action_mask, trajectory.sampler_logprobs,
                       images=[_image(56, 84, 99)])
    assert np.abs(_reference_logprobs(params, other) - want).max() > 100 * TOL["atol"]
    _, batch = _pack([trajectory], micro_batches=1)
    rows = jax.tree.map(lambda x: jnp.asarray(x[0, 0]), batch.rows)
    text_positions = rows.replace(positions=jnp.arange(rows.tokens.shape[1]) * (rows.segment_ids > 0))
    logprobs = jax.jit(lambda r: token_logprobs(model, params, r)[0])
    got = np.asarray(logprobs(rows))[0, 1:trajectory.length]
    shifted = np.asarray(logprobs(text_positions))[0, 1:trajectory.length]
    np.testing.assert_allclose(got, want[1:], **TOL)
    assert np.abs(shifted - want[1:]).max() > 100 * TOL["atol"]


@pytest.mark.slow
def test_rl_update_with_images_trains_the_vision_tower(policy, prepare, step_batch):
    model, params = policy
    _, batch = step_batch
    prepared, _ = prepare(_state(params), jax.tree.map(jnp.asarray, batch))
    train_step = make_train_step(model, ALG, optax.adam(1e-2))
    state, metrics = train_step(_state(params), take_minibatch(prepared.rows, 0))
    assert np.isfinite(float(metrics["policy/loss"])) and float(metrics["policy/nonfinite"]) == 0
    assert _moved(state.policy.params, params, "visual") > 1e-4 and _moved(state.policy.params, params, "model") > 1e-4


def _moved(new, old, part):
    return max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(new[part]), jax.tree.leaves(old[part])))


@pytest.mark.slow
def test_sft_on_demonstrations_with_images_reaches_the_tower_only_through_images(policy):
    """SFT steps on conversations with images lower the loss and move the vision tower; on text-only ones the
    tower gets no gradient and stays exactly as it was."""
    model, params = policy
    trajectories = _trajectories()
    step = make_sft_step(model, optax.adam(1e-3))
    _, batch = _pack(trajectories, micro_batches=2)
    state = _state(params)
    losses = []
    for _ in range(3):
        state, metrics = step(state, take_minibatch(jax.tree.map(jnp.asarray, batch.rows), 0))
        losses.append(float(metrics["sft/loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert _moved(state.policy.params, params, "visual") > 1e-4
    _, text_batch = _pack([t for t in trajectories if not t.images], micro_batches=1)
    state, metrics = step(_state(params), take_minibatch(jax.tree.map(jnp.asarray, text_batch.rows), 0))
    assert np.isfinite(float(metrics["sft/loss"]))
    assert _moved(state.policy.params, params, "visual") == 0.0 and _moved(state.policy.params, params, "model") > 0


def test_patch_buckets_bound_the_compiled_shapes(policy):
    """Steps whose micro-batches hold different patch counts within one bucket reuse the compiled prepare."""
    model, params = policy
    prepare = make_prepare_fn(model, ALG)
    rng = np.random.default_rng(5)
    shapes = set()
    for images in ([_image(56, 56, 1)], [_image(56, 84, 2)], [_image(56, 56, 3), _image(28, 56, 4)]):
        trajectories = [_trajectory(rng, images), _trajectory(rng, [])]
        _, batch = _pack(trajectories, micro_batches=1)
        shapes.add(batch.rows.vision.pixel_values.shape)
        prepare(_state(params), jax.tree.map(jnp.asarray, batch))
    assert shapes == {(1, 1, MIN_PATCH_BUCKET, VISION.patch_dim)}
    assert prepare._cache_size() == 1
    assert [patch_bucket(n) for n in (0, 1, 64, 65, 130, 1000)] == [64, 64, 64, 128, 256, 1024]


def test_text_only_batch_of_a_vision_policy_packs_as_for_a_text_policy(policy):
    model, params = policy
    rng = np.random.default_rng(0)
    trajectories = [_trajectory(rng, []) for _ in range(3)]
    _, batch = _pack(trajectories, micro_batches=1)
    assert batch.rows.vision is None and batch.rows.positions.shape == batch.rows.tokens.shape
    rows = jax.tree.map(lambda x: jnp.asarray(x[0, 0]), batch.rows)
    got = unpack_rows(np.asarray(jax.jit(lambda r: token_logprobs(model, params, r)[0])(rows))[None, None], batch)
    for i, trajectory in enumerate(trajectories):
        np.testing.assert_allclose(got[i, 1:trajectory.length], _reference_logprobs(params, trajectory)[1:], **TOL)


def test_images_for_a_text_policy_or_a_bad_bucket_are_refused():
    trajectories = _trajectories()
    arrays = trajectories_to_batch(trajectories, pad_to=128, image_token_id=IMAGE)
    n = len(trajectories)
    common = dict(rewards=arrays["rewards"], group_ids=np.arange(n), minibatch=np.zeros(n, np.int32),
                  num_minibatches=1, images={k: arrays[k] for k in ("pixel_values", "image_grid_thw", "image_rows")})
    text = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="not a vision-language model \\(family 'qwen2'\\)"):
        pack_step(arrays["tokens"], arrays["action_mask"], arrays["sampler_logprobs"], arrays["lengths"],
                  model_config=text, **common)
    with pytest.raises(ValueError, match="pad_patches_to=66 must hold a micro-batch's"):
        pack_step(arrays["tokens"], arrays["action_mask"], arrays["sampler_logprobs"], arrays["lengths"],
                  model_config=CFG, pad_patches_to=66, **common)


@pytest.mark.slow
def test_sharded_prepare_and_update_with_images_equal_single_device(policy):
    """The batch placed on a data x fsdp mesh as the loop places it (rows split over devices, mRoPE positions along
    their row axis, each micro-batch's images whole on every device) gives one device's old logprobs and update."""
    import types

    from jax.sharding import PartitionSpec as P

    from agentfly_jax.models import sharding as shd
    from agentfly_jax.trainer import state_shardings
    from agentfly_jax.trainer.loop import _put_batch

    model, params = policy
    _, batch = _pack(_trajectories(), minibatch=MINIBATCH, num_minibatches=2, rows_multiple=4)
    # plain SGD: the update is the gradient scaled, so the parameters compare the gradients themselves (Adam's first
    # step, g / |g|, would blow the last bits of a near-zero gradient up to the learning rate)
    optimizer = optax.sgd(1.0)

    def run(state, batch, prepare, step):
        filled, _ = prepare(state, batch)
        state, metrics = step(state, take_minibatch(filled.rows, 0))
        return filled, state, metrics

    def new_state():
        return create_train_state(jax.tree.map(jnp.copy, params), optimizer)

    single = run(new_state(), jax.tree.map(jnp.asarray, batch), make_prepare_fn(model, ALG),
                 make_train_step(model, ALG, optimizer))
    mesh = shd.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
    state = new_state()
    sharding = state_shardings(state, mesh, policy_model=model, policy_opt=optimizer)
    placed = _put_batch(types.SimpleNamespace(mesh=mesh), batch)
    assert placed.rows.positions.sharding.spec == P(None, None, None, ("data", "fsdp"))
    assert placed.rows.vision.pixel_values.sharding.spec == P()
    with jax.set_mesh(mesh), shd.axis_rules():
        sharded = run(jax.device_put(state, sharding), placed, make_prepare_fn(model, ALG),
                      make_train_step(model, ALG, optimizer, state_sharding=sharding))
    np.testing.assert_allclose(sharded[0].rows.old_logprobs, single[0].rows.old_logprobs, **TOL)
    assert _moved(single[1].policy.params, params, "visual") > 1e-4
    for got, want in zip(jax.tree.leaves(sharded[1].policy.params), jax.tree.leaves(single[1].policy.params)):
        np.testing.assert_allclose(got, want, **TOL)
    assert abs(float(sharded[2]["policy/loss"]) - float(single[2]["policy/loss"])) <= 1e-5
