"""Qwen2.5-VL in Flax against transformers' Qwen2_5_VLForConditionalGeneration (torch CPU), fp32, tiny random
checkpoints; images through transformers' Qwen2-VL image processor (PIL)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from agentfly_jax.models import (
    ModelConfig,
    Qwen2_5_VLCausalLM,
    init_params,
    load_pretrained,
    mrope_positions,
    pad_patches,
    save_pretrained,
    vision_layout,
)
from agentfly_jax.models import sharding as shd
from tests.models.hf_reference import build

TOL = 1e-4
IMAGE, VIDEO, START, END = 290, 291, 292, 293
TEXT_VOCAB = 280  # random text tokens stay below the special ones

# Vision: depth 2 = one window block (0) and one full-attention block (1); window 56 px = 2x2 merged tokens, so
# the 4x6 and 8x10 patch grids below (2x3 and 4x5 merged) are split into several windows, some cut short.
HF_CONFIG = dict(
    text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                     max_position_embeddings=512,
                     # a small theta turns the low frequencies too, so wrong positions show in the logits
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2),
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
)
IMAGE_SIZES = {"a": (56, 84), "b": (112, 140), "c": (28, 56)}  # (height, width) px -> grids 4x6, 8x10, 2x4


def _build(path, tie=False, seed=0):
    cfg = transformers.Qwen2_5_VLConfig(**HF_CONFIG, tie_word_embeddings=tie)
    return build(cfg, path, seed=seed, cls=transformers.Qwen2_5_VLForConditionalGeneration,
                 attn_implementation="eager")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    hf_model = _build(path)
    model, params = load_pretrained(path)
    return path, hf_model, model, params


@pytest.fixture(scope="module")
def images():
    """name -> (pixel_values [P, 1176], grid [1, 3]) from transformers' image processor."""
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=200 * 200, patch_size=14, merge_size=2,
                                         temporal_patch_size=2)
    rng = np.random.default_rng(0)
    out = {}
    for name, (h, w) in IMAGE_SIZES.items():
        batch = processor(images=[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))],
                          return_tensors="np")
        out[name] = (batch["pixel_values"].astype(np.float32), batch["image_grid_thw"])
    return out


def _image_tokens(grid):
    return [START] + [IMAGE] * int(np.prod(grid) // 4) + [END]


def _text(n, seed):
    return list(np.random.default_rng(seed).integers(3, TEXT_VOCAB, n))


def _conversation(images, names, seed):
    """Text, then each image with text after it."""
    toks = _text(4, seed)
    for i, name in enumerate(names):
        toks += _image_tokens(images[name][1][0]) + _text(3 + 2 * i, seed + i + 1)
    return toks


def _vision_inputs(images, names):
    if not names:
        return None, None
    return (np.concatenate([images[n][0] for n in names]), np.concatenate([images[n][1] for n in names]))


def _hf_logits(hf_model, ids, pixel_values=None, grid=None, attention_mask=None):
    kw = {}
    if pixel_values is not None:
        kw = dict(pixel_values=torch.as_tensor(pixel_values), image_grid_thw=torch.as_tensor(grid))
    if attention_mask is not None:
        kw["attention_mask"] = torch.as_tensor(attention_mask)
    ids = np.asarray(ids)
    with torch.no_grad():
        out = hf_model(input_ids=torch.as_tensor(ids), mm_token_type_ids=torch.as_tensor((ids == IMAGE).astype(int)),
                       **kw)
    return out.logits.numpy()


def _ours(model, params, ids, pixel_values=None, grid=None, segment_ids=None, eager=False):
    """Our logits: eagerly from the grid (the model computes positions and layout itself), or (faster to
    compile) jitted with positions and vision layout computed on the host; the two agree (test below)."""
    if eager:
        return np.asarray(model.apply({"params": params}, jnp.asarray(ids), segment_ids=segment_ids,
                                      pixel_values=pixel_values, image_grid_thw=grid))
    positions = mrope_positions(model.config, ids, grid, segment_ids)
    layout = None if grid is None else vision_layout(model.config.vision, grid)
    return np.asarray(_jit_apply(model)({"params": params}, jnp.asarray(ids), jnp.asarray(positions), segment_ids,
                                        pixel_values=pixel_values, vision_layout=layout))


_JITTED = {}


def _jit_apply(model):
    return _JITTED.setdefault(id(model), (model, jax.jit(model.apply)))[1]


def test_config_reads_vision_language_features(checkpoint):
    _, hf_model, model, params = checkpoint
    c = model.config
    assert isinstance(model, Qwen2_5_VLCausalLM)
    assert (c.family, c.mrope_section, c.qkv_bias, c.tie_word_embeddings) == ("qwen2_5_vl", (2, 3, 3), True, False)
    assert (c.vision.depth, c.vision.fullatt_block_indexes, c.vision.window_merged) == (2, (1,), 2)
    assert c.vision.image_token_id == IMAGE and c.rope_theta == 1e4
    assert params["visual"]["patch_embed"]["kernel"].shape == (3 * 2 * 14 * 14, 32)
    assert c.num_params == sum(p.numel() for p in hf_model.parameters())


def test_text_only_matches_transformers(checkpoint):
    _, hf_model, model, params = checkpoint
    ids = np.random.default_rng(1).integers(0, TEXT_VOCAB, (2, 24))
    ours = _ours(model, params, ids)
    theirs = _hf_logits(hf_model, ids)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    assert np.abs(theirs).max() > 1.0


def test_one_image_matches_transformers(checkpoint, images):
    _, hf_model, model, params = checkpoint
    ids = np.array([_conversation(images, ["b"], seed=2)])
    pv, grid = _vision_inputs(images, ["b"])
    ours = _ours(model, params, ids, pv, grid, eager=True)  # the plain call: model.apply(ids, pixel_values, grid)
    theirs = _hf_logits(hf_model, ids, pv, grid)
    assert ours.shape == (1, ids.shape[1], 300)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    # the image matters: the same prompt with another image of the same grid gives other logits
    other = _ours(model, params, ids, pv[::-1].copy(), grid)
    assert np.abs(other - ours).max() > 1e-2


def test_several_images_of_different_grids_match_transformers(checkpoint, images):
    _, hf_model, model, params = checkpoint
    names = ["a", "b", "c"]
    ids = np.array([_conversation(images, names, seed=3)])
    pv, grid = _vision_inputs(images, names)
    assert grid.tolist() == [[1, 4, 6], [1, 8, 10], [1, 2, 4]]
    np.testing.assert_allclose(_ours(model, params, ids, pv, grid), _hf_logits(hf_model, ids, pv, grid),
                               atol=TOL, rtol=0)


def test_mrope_positions_equal_transformers_get_rope_index(checkpoint, images):
    _, hf_model, model, _ = checkpoint
    rows = [_conversation(images, ["a", "c"], seed=4), _conversation(images, ["b"], seed=5)]
    width = max(map(len, rows))
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    ids[0, width - len(rows[0]):], mask[0, width - len(rows[0]):] = rows[0], 1  # left padded
    ids[1, :len(rows[1])], mask[1, :len(rows[1])] = rows[1], 1  # right padded
    _, grid = _vision_inputs(images, ["a", "c", "b"])
    theirs, _ = hf_model.model.get_rope_index(torch.as_tensor(ids), torch.as_tensor((ids == IMAGE).astype(int)),
                                              image_grid_thw=torch.as_tensor(grid),
                                              attention_mask=torch.as_tensor(mask))
    np.testing.assert_array_equal(mrope_positions(model.config, ids, grid, segment_ids=mask), theirs.numpy())


def test_padded_batch_of_two_rows_with_different_images(checkpoint, images):
    _, hf_model, model, params = checkpoint
    rows = [_conversation(images, ["a", "c"], seed=6), _conversation(images, ["b"], seed=7)]
    width = max(map(len, rows)) + 3
    ids = np.full((2, width), 2, np.int64)  # pad token 2
    segments = np.zeros((2, width), np.int32)
    ids[0, width - len(rows[0]):], segments[0, width - len(rows[0]):] = rows[0], 1  # left padding
    ids[1, :len(rows[1])], segments[1, :len(rows[1])] = rows[1], 1  # right padding
    pv, grid = _vision_inputs(images, ["a", "c", "b"])  # row 0's images, then row 1's
    ours = _ours(model, params, ids, pv, grid, segment_ids=segments)
    theirs = _hf_logits(hf_model, ids, pv, grid, attention_mask=segments)
    real = segments.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=TOL, rtol=0)


def test_packed_conversations_equal_separate_runs(checkpoint, images):
    _, hf_model, model, params = checkpoint
    first, second = _conversation(images, ["b", "c"], seed=8), _conversation(images, ["a"], seed=9)
    ids = np.array([first + second + [2] * 5])
    segments = np.array([[1] * len(first) + [2] * len(second) + [0] * 5], np.int32)
    pv, grid = _vision_inputs(images, ["b", "c", "a"])
    ours = _ours(model, params, ids, pv, grid, segment_ids=segments)
    alone_first = _hf_logits(hf_model, np.array([first]), *_vision_inputs(images, ["b", "c"]))
    alone_second = _hf_logits(hf_model, np.array([second]), *_vision_inputs(images, ["a"]))
    np.testing.assert_allclose(ours[0, :len(first)], alone_first[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(ours[0, len(first):len(first) + len(second)], alone_second[0], atol=TOL, rtol=0)
    # positions restart per conversation (logits alone cannot show it: RoPE sees only relative positions)
    expected = [hf_model.model.get_rope_index(torch.as_tensor([conv]), torch.as_tensor(np.equal([conv], IMAGE)),
                                              image_grid_thw=torch.as_tensor(g))[0].numpy()[:, 0]
                for conv, g in ((first, grid[:2]), (second, grid[2:]))]
    np.testing.assert_array_equal(mrope_positions(model.config, ids, grid, segments)[:, 0, :-5],
                                  np.concatenate(expected, axis=1))
    # without segment ids the second conversation would see the first: the test can tell the difference
    leaky = _ours(model, params, ids, pv, grid)
    assert np.abs(leaky[0, len(first):len(first) + len(second)] - alone_second[0]).max() > 1e-2


def test_vision_tower_matches_transformers_visual(checkpoint, images):
    _, hf_model, model, params = checkpoint
    pv, grid = _vision_inputs(images, ["a", "b", "c"])
    with torch.no_grad():
        theirs = hf_model.model.visual(torch.as_tensor(pv), grid_thw=torch.as_tensor(grid)).pooler_output.numpy()
    features = jax.jit(lambda x, layout: model.apply({"params": params}, x, vision_layout=layout,
                                                     method=Qwen2_5_VLCausalLM.image_features))
    ours = np.asarray(features(pv, vision_layout(model.config.vision, grid)))
    assert ours.shape == theirs.shape == (pv.shape[0] // 4, 64)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    # padded to a bucket: the real features are unchanged and come first
    bucket = pv.shape[0] + 36
    padded = np.asarray(features(pad_patches(pv, bucket), vision_layout(model.config.vision, grid, bucket)))
    assert padded.shape == (bucket // 4, 64)
    np.testing.assert_allclose(padded[:len(ours)], theirs, atol=TOL, rtol=0)


def test_window_and_full_blocks_both_matter(checkpoint, images):
    """A layout that puts every patch of an image in one window (or each in its own frame) changes the output:
    the comparison against transformers above exercises both kinds of block."""
    _, _, model, params = checkpoint
    pv, grid = _vision_inputs(images, ["b"])
    layout = vision_layout(model.config.vision, grid)
    assert len(np.unique(layout.window_segments)) == 6  # 4x5 merged tokens in 2x2 windows: 2 x 3 windows
    assert len(np.unique(layout.full_segments)) == 1

    def features(lay):
        return np.asarray(model.apply({"params": params}, pv, vision_layout=lay,
                                      method=Qwen2_5_VLCausalLM.image_features))

    base = features(layout)
    one_window = layout._replace(window_segments=layout.full_segments)
    split_frame = layout._replace(full_segments=layout.window_segments)
    assert np.abs(features(one_window) - base).max() > 1e-3
    assert np.abs(features(split_frame) - base).max() > 1e-3


def test_jit_with_host_layout_equals_eager(checkpoint, images):
    _, _, model, params = checkpoint
    rows = [_conversation(images, ["a", "c"], seed=10), _conversation(images, ["b"], seed=11)]
    width = max(map(len, rows))
    ids = np.full((2, width), 2, np.int64)
    segments = np.zeros((2, width), np.int32)
    for r, row in enumerate(rows):
        ids[r, :len(row)], segments[r, :len(row)] = row, 1
    pv, grid = _vision_inputs(images, ["a", "c", "b"])
    eager = _ours(model, params, ids, pv, grid, segment_ids=jnp.asarray(segments), eager=True)

    bucket = 256  # fixed shapes: patches padded to a bucket
    positions = mrope_positions(model.config, ids, grid, segments)
    layout = vision_layout(model.config.vision, grid, bucket)
    apply = jax.jit(model.apply)
    jitted = np.asarray(apply({"params": params}, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments),
                              pixel_values=jnp.asarray(pad_patches(pv, bucket)), vision_layout=layout))
    real = segments.astype(bool)
    np.testing.assert_allclose(jitted[real], eager[real], atol=1e-5, rtol=0)
    # the same compiled function serves other images of the same bucket (jit specialises on shapes only)
    pv2, grid2 = _vision_inputs(images, ["c", "a", "b"])
    ids2 = ids.copy()
    ids2[0, :len(rows[0])] = _conversation(images, ["c", "a"], seed=10)
    eager2 = _ours(model, params, ids2, pv2, grid2, segment_ids=jnp.asarray(segments), eager=True)
    jitted2 = np.asarray(apply({"params": params}, jnp.asarray(ids2),
                               jnp.asarray(mrope_positions(model.config, ids2, grid2, segments)),
                               jnp.asarray(segments), pixel_values=jnp.asarray(pad_patches(pv2, bucket)),
                               vision_layout=vision_layout(model.config.vision, grid2, bucket)))
    np.testing.assert_allclose(jitted2[real], eager2[real], atol=1e-5, rtol=0)
    assert apply._cache_size() == 1


def test_hidden_states_and_embed_compose_to_logits(checkpoint, images):
    _, _, model, params = checkpoint
    ids = np.array([_conversation(images, ["a"], seed=12)])
    pv, grid = _vision_inputs(images, ["a"])
    logits = _ours(model, params, ids, pv, grid)
    vp = {"params": params}
    positions = jnp.asarray(mrope_positions(model.config, ids, grid))
    vision = dict(pixel_values=jnp.asarray(pv), vision_layout=vision_layout(model.config.vision, grid))

    def run(method, *args, **kw):
        return jax.jit(lambda *a: model.apply(vp, *a, method=method, **kw))(*args)

    hidden = run(Qwen2_5_VLCausalLM.hidden_states, jnp.asarray(ids), positions, **vision)
    np.testing.assert_allclose(np.asarray(run(Qwen2_5_VLCausalLM.logits_from_hidden, hidden)), logits,
                               atol=1e-5, rtol=0)
    # a sampler's prefill: embeddings with the image merged in, then the decoder at explicit mRoPE positions
    embeds = run(Qwen2_5_VLCausalLM.embed, jnp.asarray(ids), **vision)
    assert embeds.shape == (1, ids.shape[1], 64)
    token_embeds = np.asarray(params["model"]["embed_tokens"]["embedding"])[ids[0]]
    is_image = ids[0] == IMAGE
    np.testing.assert_array_equal(np.asarray(embeds[0])[~is_image], token_embeds[~is_image])
    features = run(Qwen2_5_VLCausalLM.image_features, jnp.asarray(pv), vision_layout=vision["vision_layout"])
    np.testing.assert_allclose(np.asarray(embeds[0])[is_image], np.asarray(features), atol=1e-5, rtol=0)
    hidden2 = run(Qwen2_5_VLCausalLM.hidden_from_embeddings, embeds, positions)
    np.testing.assert_allclose(np.asarray(hidden2), np.asarray(hidden), atol=1e-5, rtol=0)


def test_sharded_forward_equals_single_device(checkpoint, images):
    """The vision tower's parameters carry logical axis names too: sharded by the default rules on a mesh of
    the 8 fake CPU devices, the model computes the same logits."""
    _, _, model, params = checkpoint
    names = ["a", "c", "c", "a"]  # one image a row; 4 rows: the batch splits over fsdp
    rows = [_conversation(images, [n], seed=16 + i) for i, n in enumerate(names)]
    ids = np.full((4, max(map(len, rows))), 2, np.int64)
    segments = np.zeros(ids.shape, np.int32)
    for r, row in enumerate(rows):
        ids[r, :len(row)], segments[r, :len(row)] = row, 1
    pv, grid = _vision_inputs(images, names)
    reference = _ours(model, params, ids, pv, grid, segment_ids=segments)
    mesh = shd.make_mesh({"fsdp": 4, "tensor": 2})
    sharded = shd.shard_params(model, params, mesh)
    gate = sharded["visual"]["blocks_0"]["mlp"]["gate_proj"]["kernel"]  # [32, 48]: split over fsdp x tensor
    assert gate.addressable_shards[0].data.size == gate.size // 8
    positions = mrope_positions(model.config, ids, grid, segments)
    put = lambda x: jax.device_put(x, shd.batch_sharding(mesh, ndim=x.ndim))  # noqa: E731
    with jax.set_mesh(mesh), shd.axis_rules():
        out = jax.jit(model.apply)({"params": sharded}, put(ids), positions, put(segments), pixel_values=pv,
                                   vision_layout=vision_layout(model.config.vision, grid))
    np.testing.assert_allclose(np.asarray(out), reference, atol=1e-5, rtol=0)


def test_save_pretrained_round_trip_through_transformers(checkpoint, images, tmp_path):
    _, hf_model, model, params = checkpoint
    params = jax.tree.map(lambda p: p * 1.01, params)  # so the test cannot pass by copying the input files
    save_pretrained(model, params, str(tmp_path))
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = np.array([_conversation(images, ["c", "a"], seed=13)])
    pv, grid = _vision_inputs(images, ["c", "a"])
    ours = _ours(model, params, ids, pv, grid)
    np.testing.assert_allclose(_hf_logits(reloaded, ids, pv, grid), ours, atol=TOL, rtol=0)
    assert np.abs(_hf_logits(hf_model, ids, pv, grid) - ours).max() > 1e-3  # the perturbation is visible
    _, params2 = load_pretrained(str(tmp_path))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_tied_embeddings_and_fresh_model_round_trip(images, tmp_path):
    hf_model = _build(str(tmp_path / "tied"), tie=True, seed=1)
    model, params = load_pretrained(str(tmp_path / "tied"))
    assert model.config.tie_word_embeddings and "lm_head" not in params
    ids = np.array([_conversation(images, ["a"], seed=14)])
    pv, grid = _vision_inputs(images, ["a"])
    np.testing.assert_allclose(_ours(model, params, ids, pv, grid), _hf_logits(hf_model, ids, pv, grid),
                               atol=TOL, rtol=0)
    # init_params creates the vision tower too (it runs on text only), with the shapes of a checkpoint
    fresh = init_params(Qwen2_5_VLCausalLM(model.config), jax.random.PRNGKey(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, params)
    save_pretrained(Qwen2_5_VLCausalLM(model.config), fresh, str(tmp_path / "fresh"))
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(tmp_path / "fresh"), dtype=torch.float32, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(reloaded, ids, pv, grid), _ours(model, fresh, ids, pv, grid),
                               atol=TOL, rtol=0)


def test_released_checkpoint_layout_loads(checkpoint, tmp_path):
    """The released checkpoints keep the text keys at the top of config.json (rope_scaling type "mrope",
    in_chans); tensors may also carry transformers 5's in-memory names. Both read to the same model."""
    path, _, model, params = checkpoint
    nested = json.load(open(os.path.join(path, "config.json")))
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat.update(text, model_type="qwen2_5_vl", rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    flat["vision_config"] = {k: v for k, v in nested["vision_config"].items() if k != "in_channels"}
    flat["vision_config"]["in_chans"] = 3
    os.makedirs(tmp_path / "released")
    json.dump(flat, open(tmp_path / "released" / "config.json", "w"))
    tensors = load_file(os.path.join(path, "model.safetensors"))

    def new_name(k):
        if k.startswith("model."):
            return "model.language_model." + k[len("model."):]
        return "model." + k if k.startswith("visual.") else k

    renamed = {new_name(k): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "released" / "model.safetensors"), metadata={"format": "pt"})
    model2, params2 = load_pretrained(str(tmp_path / "released"))
    assert model2.config.replace(extra={}) == model.config.replace(extra={})
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    assert ModelConfig.from_hf_dict(flat).to_hf_dict()["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]


def test_bad_inputs_raise_clear_errors(checkpoint, images):
    _, _, model, params = checkpoint
    pv, grid = _vision_inputs(images, ["a"])
    ids = np.array([_conversation(images, ["a"], seed=15)])
    short = np.array([[t for i, t in enumerate(ids[0]) if not (t == IMAGE and i % 5 == 0)]])
    with pytest.raises(ValueError, match="needs 6 image tokens"):
        _ours(model, params, short, pv, grid, eager=True)
    with pytest.raises(ValueError, match="image_grid_thw has 2 images"):
        mrope_positions(model.config, ids, np.concatenate([grid, grid]))
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        vision_layout(model.config.vision, np.array([[1, 3, 4]]))
    with pytest.raises(ValueError, match="multiple of spatial_merge_size"):
        vision_layout(model.config.vision, grid, num_patches=pv.shape[0] + 2)
    with pytest.raises(ValueError, match="videos are not supported"):
        mrope_positions(model.config, np.array([[5, VIDEO, 6]]))
    with pytest.raises(ValueError, match="inside jit"):  # positions
        jax.jit(lambda p, i, x, g: model.apply({"params": p}, i, pixel_values=x, image_grid_thw=g))(
            params, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(grid))
    with pytest.raises(ValueError, match="pass vision_layout"):  # the grid
        jax.jit(lambda p, i, x, g: model.apply({"params": p}, i, mrope_positions(model.config, ids, grid),
                                               pixel_values=x, image_grid_thw=g))(
            params, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(grid))
    with pytest.raises(ValueError, match="pixel_values must be"):
        _ours(model, params, ids, pv[:, :100], grid, eager=True)
