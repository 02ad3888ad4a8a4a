"""Qwen3-VL (vision tower, image features in place of the image tokens, DeepStack, interleaved M-RoPE) against
transformers' Qwen3VLForConditionalGeneration, on a tiny random folder built locally with `save_pretrained`
(q/k of the text and vision attention scaled, norms and tables drawn away from their init, so each part moves the
logits). Images go through posttrain's own preprocessing (vision.qwen_vl_patches) for both models."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import qwen3_vl_model
from PIL import Image
from safetensors import safe_open

from posttrain.models import from_pretrained, save_pretrained
from posttrain.models.transformer import KVCache
from posttrain.vision import qwen_vl_image_tokens, qwen_vl_patches
from posttrain.vision.qwen_vl import image_forward, rope_index, vision_config

V, IMAGE, START, END = 97, 90, 92, 93
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10_000.0, mrope_section=[2, 3, 3],
                                 mrope_interleaved=True), pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
PATCHES = dict(patch_size=4, merge_size=2, min_pixels=64, max_pixels=4096)
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = qwen3_vl_model(TEXT, VISION, image=IMAGE, video=91, start=START, end=END)
    path = os.fspath(tmp_path_factory.mktemp("qwen3_vl") / "hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                           attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(ckpt):
    return from_pretrained(ckpt)


def images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def row(rng, grids, text=(3, 5, 4)):
    """[text, (start, image tokens, end, text) per image] token ids."""
    ids = list(rng.integers(3, 80, text[0]))
    for n in qwen_vl_image_tokens(grids):
        ids += [START] + [IMAGE] * int(n) + [END] + list(rng.integers(3, 80, text[1]))
    return ids


def batch(per_row, seed=0):
    """Rows of 1 or 2 images each (sizes in pixels), right-padded: tokens, mask, pixels, grids."""
    rng = np.random.default_rng(seed)
    pixels, grids = qwen_vl_patches(images([s for sizes in per_row for s in sizes], seed), **PATCHES)
    rows, k = [], 0
    for sizes in per_row:
        rows.append(row(rng, grids[k:k + len(sizes)]))
        k += len(sizes)
    T = max(map(len, rows))
    tokens = np.array([r + [0] * (T - len(r)) for r in rows], np.int32)
    mask = np.array([[1] * len(r) + [0] * (T - len(r)) for r in rows], np.int32)
    return tokens, mask, pixels, grids


def hf_logits(hf, tokens, mask, pixels, grids):
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                 pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                 mm_token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int32)), use_cache=False)
    return out.logits.numpy()


@nnx.jit(static_argnums=4)
def _forward(model, tokens, pos, pixels, grids, mask):
    return image_forward(model, tokens, pos, pixels, grids, segment_ids=mask).logits


def our_logits(model, tokens, mask, pixels, grids):
    """Jitted, as training runs it (the grids are static: they fix the tower's shapes)."""
    pos, _ = rope_index(tokens, mask, grids, model.cfg.vision)
    return np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(pixels),
                               tuple(map(tuple, np.asarray(grids).tolist())), jnp.asarray(mask)))


def check(a, b, mask):
    m = mask.astype(bool)
    err = float(np.abs(a[m] - b[m]).max())
    scale = float(b[m].max() - b[m].min())
    assert err <= TOL * scale, (err, scale)
    return err, scale


def test_vision_tower_matches(hf, ours):
    pixels, grids = qwen_vl_patches(images([(16, 24), (24, 16), (32, 32)]), **PATCHES)
    with torch.no_grad():
        ref = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grids), return_dict=True)
    feats, deep = ours.vision(jnp.asarray(pixels), grids)
    want = [ref.pooler_output] + list(ref.deepstack_features)
    assert len(deep) == len(VISION["deepstack_visual_indexes"])
    for got, w in zip((feats,) + deep, want):
        w = w.numpy()
        assert np.abs(np.asarray(got) - w).max() <= 1e-5 * max(1.0, np.abs(w).max())


def test_rope_index_matches(hf):
    tokens, mask, _, grids = batch([[(16, 24)], [(24, 16), (32, 32)]])
    with torch.no_grad():
        want, delta = hf.model.get_rope_index(torch.tensor(tokens, dtype=torch.long),
                                              torch.tensor((tokens == IMAGE).astype(np.int32)),
                                              image_grid_thw=torch.tensor(grids), attention_mask=torch.tensor(mask))
    got, got_delta = rope_index(tokens, mask, grids, vision_config(VISION, dict(image_token_id=IMAGE)))
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(got_delta, delta.numpy().reshape(-1))


@pytest.mark.parametrize("per_row", [[[(16, 24)]], [[(24, 16), (32, 32)]], [[(16, 24)], [(24, 16), (32, 32)]]],
                         ids=["one-image", "two-images", "batch-padded"])
def test_logits_match_transformers(hf, ours, per_row):
    tokens, mask, pixels, grids = batch(per_row)
    check(our_logits(ours, tokens, mask, pixels, grids), hf_logits(hf, tokens, mask, pixels, grids), mask)


def test_greedy_matches_transformers(hf, ours):
    """24 greedy tokens: posttrain's cached decode (prefill with the image, then one token a step at its text
    position + the M-RoPE delta) against transformers' full forward each step (no cache)."""
    tokens, mask, pixels, grids = batch([[(24, 16), (16, 24)]], seed=1)
    vcfg = ours.cfg.vision
    pos, delta = rope_index(tokens, mask, grids, vcfg)
    T, n = tokens.shape[1], 24
    cache = KVCache.init(ours.cfg, 1, T + n)
    out = image_forward(ours, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(pixels), grids, cache=cache)
    cache, got = out.cache, [int(np.argmax(out.logits[0, -1]))]
    for i in range(n - 1):
        p = np.full((3, 1, 1), T + i + delta[0], np.int32)
        out = ours(jnp.asarray([[got[-1]]], jnp.int32), jnp.asarray(p), cache=cache)
        cache = out.cache
        got.append(int(np.argmax(out.logits[0, -1])))
    ids, want = tokens, []
    for _ in range(n):
        logits = hf_logits(hf, ids, np.ones_like(ids), pixels, grids)
        want.append(int(np.argmax(logits[0, -1])))
        ids = np.concatenate([ids, [[want[-1]]]], axis=1).astype(np.int32)
    assert got == want, (got, want)
    assert len(set(got)) > 3  # not one token repeated


def test_export_round_trip(ckpt, hf, ours, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    out = save_pretrained(ours, os.fspath(tmp_path / "export"))
    src, dst = (json.load(open(os.path.join(d, "config.json"))) for d in (ckpt, out))
    for key in ("model_type", "architectures", "image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id", "tie_word_embeddings"):
        assert dst[key] == src[key], key
    for part in ("text_config", "vision_config"):
        for key in (TEXT if part == "text_config" else VISION):  # (token ids come from the tokenizer on export)
            if key.endswith("token_id"):
                continue
            assert dst[part][key] == src[part][key], (part, key)
    names = [set(safe_open(os.path.join(d, "model.safetensors"), "numpy").keys()) for d in (ckpt, out)]
    assert names[0] == names[1]
    back = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tokens, mask, pixels, grids = batch([[(16, 24)], [(24, 16), (32, 32)]])
    a, b = hf_logits(hf, tokens, mask, pixels, grids), hf_logits(back, tokens, mask, pixels, grids)
    assert np.abs(a - b)[mask.astype(bool)].max() <= 1e-5
    again = from_pretrained(out)
    c = our_logits(again, tokens, mask, pixels, grids)
    assert np.abs(c - our_logits(ours, tokens, mask, pixels, grids))[mask.astype(bool)].max() <= 1e-5


def test_text_only_exports_as_qwen3(ckpt, hf, tmp_path):
    """text_only: the text model alone (2-D positions: M-RoPE with equal axes) equals transformers on text, and
    exports as a `qwen3` folder that AutoModelForCausalLM reads with the same logits."""
    from transformers import AutoModelForCausalLM

    text = from_pretrained(ckpt, text_only=True)
    assert text.cfg.vision is None and not hasattr(text, "vision")
    tokens = np.random.default_rng(3).integers(3, 80, (2, 11)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, 8:] = 0
    pos = np.broadcast_to(np.arange(11), tokens.shape)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(text(jnp.asarray(tokens), jnp.asarray(pos), segment_ids=jnp.asarray(mask)).logits)
    check(got, want, mask)
    back = AutoModelForCausalLM.from_pretrained(save_pretrained(text, os.fspath(tmp_path / "qwen3")),
                                                dtype=torch.float32).eval()
    assert back.config.model_type == "qwen3"
    with torch.no_grad():
        again = back(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    assert np.abs(again.numpy() - want)[mask.astype(bool)].max() <= 1e-4


def test_image_token_count_must_match_the_grids():
    from posttrain.errors import PosttrainError

    tokens, mask, _, grids = batch([[(16, 24)]])
    with pytest.raises(PosttrainError, match="image tokens"):
        rope_index(tokens[:, :-6], mask[:, :-6], np.concatenate([grids, grids]),
                   vision_config(VISION, dict(image_token_id=IMAGE)))
