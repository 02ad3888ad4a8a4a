"""Gemma 3 vision-language (`gemma3` folders, transformers' Gemma3ForConditionalGeneration) against transformers:
pixels, image features, logits with one and two images a row and right padding, the bidirectional image blocks
(dense and blockwise attention agree), greedy decoding, the text model alone, and the export read back.

One tiny random folder built locally with transformers' save_pretrained: a 2-layer Gemma 3 text model (sliding
window 4, shorter than an image's 4 tokens plus text) and a 2-layer SigLIP tower over 32 x 32 images in 4 x 4
patches (an 8 x 8 grid pooled 4 x 4 to 2 x 2 = 4 image tokens). Weights are perturbed as tests/hf_models.py's
(norms, biases; q/k projections x QK_SCALE so attention is not uniform), and the projector, which transformers
initialises to zeros, gets random weights.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import gemma3_vl_model

from posttrain.models import Transformer, from_pretrained, save_pretrained
from posttrain.models import attention as attention_module
from posttrain.vision.gemma3 import Gemma3VL, image_blocks
from posttrain.vision.preprocess import gemma3_pixels

V, IMAGE, BOI, EOI, MM = 97, 90, 91, 92, 4
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
            rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0),
                             "sliding_attention": dict(rope_type="default", rope_theta=1e4)})
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=4, vision_use_head=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = gemma3_vl_model(TEXT, VISION, mm_tokens=MM, image=IMAGE, boi=BOI, eoi=EOI)
    path = os.fspath(tmp_path_factory.mktemp("gemma3_vl") / "hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(folder):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(folder):
    return from_pretrained(folder)


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(20, 60)), int(rng.integers(20, 60)), 3), dtype=np.uint8)
            for _ in range(n)]


def row(rng, parts):
    """Token ids: bos, then per part either a text run (an int: its length) or an image ("I": the processor's
    boi, MM image tokens, eoi)."""
    out = [1]
    for p in parts:
        out += [BOI] + [IMAGE] * MM + [EOI] if p == "I" else list(rng.integers(3, 89, p))
    return out


def batch(rows):
    """Right-padded tokens and mask [B, T]."""
    T = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), T), np.int64)
    mask = np.zeros((len(rows), T), np.int64)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], mask[i, :len(r)] = r, 1
    return tokens, mask


def hf_logits(hf_model, tokens, mask, pixels, token_types=True):
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                       pixel_values=None if pixels is None else torch.tensor(pixels),
                       token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int64)) if token_types else None)
    return out.logits.numpy()


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, state, tokens, mask, pixels):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    extra = () if pixels is None else (pixels,)
    return nnx.merge(graphdef, state)(tokens, positions, *extra, segment_ids=mask).logits


def ours(model, tokens, mask, pixels):
    return np.asarray(forward(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(mask),
                              None if pixels is None else jnp.asarray(pixels)))


def close(a, b, mask, tol=1e-4):
    """max |a - b| over real tokens, against tol times the logit range."""
    real = mask.astype(bool)
    err = np.abs(a - b)[real].max()
    print(f"max |difference| {err:.2e}, logit range {np.ptp(b[real]):.2f}")
    assert err <= tol * np.ptp(b[real]), (err, np.ptp(b[real]))
    return err


def test_pixels_equal_transformers_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ims = images(3)
    want = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})(ims, return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(gemma3_pixels(ims, size=32), want)


def test_loads_the_vision_language_model(model, folder):
    assert isinstance(model, Gemma3VL) and isinstance(model.text, Transformer)
    assert model.vcfg.mm_tokens_per_image == MM and model.vcfg.image_token_id == IMAGE
    text = from_pretrained(folder, text_only=True)  # the text model alone, as before
    assert isinstance(text, Transformer)


def test_image_features_equal_transformers(model, hf_model):
    pixels = gemma3_pixels(images(3), size=32)
    with torch.no_grad():
        want = hf_model.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    got = np.asarray(model.image_features(jnp.asarray(pixels)))
    assert got.shape == (3, MM, TEXT["hidden_size"])
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("layout", ["one image a row", "two images a row"])
def test_logits_equal_transformers(model, hf_model, layout):
    rng = np.random.default_rng(1)
    parts = [[3, "I", 5], ["I", 2]] if layout == "one image a row" else [[2, "I", 3, "I", 4], ["I", "I", 1]]
    tokens, mask = batch([row(rng, p) for p in parts])
    pixels = gemma3_pixels(images(int((tokens == IMAGE).sum()) // MM, seed=2), size=32)
    want = hf_logits(hf_model, tokens, mask, pixels)
    close(ours(model, tokens, mask, pixels), want, mask)
    # each part moves the logits: the images, and their bidirectional blocks
    causal = hf_logits(hf_model, tokens, mask, pixels, token_types=False)
    assert np.abs(causal - want)[mask.astype(bool)].max() > 1e-2 * np.ptp(want)
    no_images = ours(model, tokens, mask, None)
    assert np.abs(no_images - want)[mask.astype(bool)].max() > 1e-2 * np.ptp(want)


def test_blockwise_attention_equals_dense_with_images(model, hf_model, monkeypatch):
    rng = np.random.default_rng(3)
    tokens, mask = batch([row(rng, [2, "I", 3, "I", 9]), row(rng, ["I", 4, "I", 2])])
    pixels = gemma3_pixels(images(4, seed=4), size=32)
    want = hf_logits(hf_model, tokens, mask, pixels)
    monkeypatch.setattr(attention_module, "DENSE_MAX", 0)
    monkeypatch.setattr(attention_module, "BLOCK", 4)  # tiles cut through the images
    close(ours(model, tokens, mask, pixels), want, mask)


def test_attention_mask_and_gradients_with_image_blocks():
    """The masking rule with image ids: dense and blockwise outputs and gradients agree, with a window, padding,
    and images across tile boundaries; an image's first token sees its last."""
    B, T, K, G, H = 2, 24, 2, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, s) for kk, s in zip(keys, [(B, T, K, G, H), (B, K, T, H), (B, K, T, H)]))
    tokens = jnp.asarray([[5] * 3 + [IMAGE] * 6 + [5] * 2 + [IMAGE] * 5 + [5] * 8,
                          [IMAGE] * 7 + [5] * 12 + [0] * 5])
    seg = (tokens != 0).astype(jnp.int32)
    pos = jnp.where(seg != 0, jnp.arange(T), -1)
    slots = jnp.arange(T)
    img = image_blocks(tokens, IMAGE)
    lay = attention_module.Layout(pos, pos, slots, slots, seg, seg, q_image=img, k_image=img, causal_aligned=True)
    m = lay.mask(5)
    assert bool(m[0, 3, 8]) and not bool(m[0, 2, 3]) and not bool(m[0, 11, 3]) and not bool(m[1, 20, 3])

    def f(impl):
        @jax.jit
        def loss(q, k, v):
            if impl == "dense":
                out, _ = attention_module.dense(q, k, v, lay.mask(5), scale=0.3, cap=None)
            else:
                out = attention_module.blockwise(q, k, v, lay, window=5, scale=0.3, cap=None, block_q=8, block_k=8)
            return jnp.sum(jnp.where(seg[:, :, None, None, None] != 0, out, 0) ** 2), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (a, out_a), ga = f("dense")
    (b, out_b), gb = f("blockwise")
    np.testing.assert_allclose(np.asarray(out_b)[np.asarray(seg) != 0], np.asarray(out_a)[np.asarray(seg) != 0],
                               atol=1e-5)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-4)


def test_greedy_equals_transformers(model, hf_model):
    """24 greedy tokens: transformers without a cache (argmax of a full forward each step) against posttrain's
    repeated full forwards over one right-padded buffer (the Sampler's KV cache: the next test). Both choose among
    the text tokens (ids below the image tokens): a generated image token would be an image without pixels."""
    rng = np.random.default_rng(5)
    prompts = [row(rng, [2, "I", 3]), row(rng, ["I", 5, "I"])]
    pixels = gemma3_pixels(images(3, seed=6), size=32)
    steps = 24
    want = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one torch thread runs these tiny forwards faster (as test_gguf.py)
    try:
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            pix = torch.tensor(pixels[:1] if i == 0 else pixels[1:])
            with torch.no_grad():
                for _ in range(steps):
                    logits = hf_model(input_ids=ids, pixel_values=pix, token_type_ids=(ids == IMAGE).long()).logits
                    ids = torch.cat([ids, logits[:, -1, :IMAGE].argmax(-1, keepdim=True)], dim=1)
            want.append(ids[0, len(p):].tolist())
    finally:
        torch.set_num_threads(threads)

    size = max(len(p) for p in prompts) + steps
    tokens = np.zeros((2, size), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    positions = jnp.broadcast_to(jnp.arange(size), (2, size))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, lengths, pixels):
        m = nnx.merge(graphdef, state)
        seg = (jnp.arange(size)[None] < lengths[:, None]).astype(jnp.int32)
        logits = m(tokens, positions, pixels, segment_ids=seg).logits
        return jnp.argmax(logits[jnp.arange(2), lengths - 1, :IMAGE], axis=-1)

    got = [[], []]
    for _ in range(steps):
        nxt = np.asarray(step(state, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(pixels)))
        for i in range(2):
            tokens[i, lengths[i]] = nxt[i]
            got[i].append(int(nxt[i]))
        lengths = lengths + 1
    assert got == want


def test_export_round_trip(model, folder, hf_model, tmp_path):
    from safetensors import safe_open
    from transformers import Gemma3ForConditionalGeneration

    out = save_pretrained(model, os.fspath(tmp_path / "export"))
    names = [set(safe_open(os.path.join(f, "model.safetensors"), "np").keys()) for f in (folder, out)]
    assert names[0] == names[1]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "gemma3" and cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    rng = np.random.default_rng(7)
    tokens, mask = batch([row(rng, [2, "I", 3, "I", 4]), row(rng, ["I", 1])])
    pixels = gemma3_pixels(images(3, seed=8), size=32)
    want = hf_logits(hf_model, tokens, mask, pixels)
    back = Gemma3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    close(hf_logits(back, tokens, mask, pixels), want, mask, tol=1e-5)
    again = from_pretrained(out)
    close(ours(again, tokens, mask, pixels), ours(model, tokens, mask, pixels), mask, tol=1e-5)


def test_text_only_equals_transformers_without_images(folder, hf_model):
    text = from_pretrained(folder, text_only=True)
    rng = np.random.default_rng(9)
    tokens, mask = batch([row(rng, [9]), row(rng, [5])])
    want = hf_logits(hf_model, tokens, mask, None, token_types=False)
    close(ours(text, tokens, mask, None), want, mask)


def test_sampler_with_images_equals_transformers_generate(model, hf_model):
    """The Sampler prefills left-padded prompts with their images (images=), then decodes: 24 greedy tokens and
    their log-probs equal transformers' generate (KV cache, pixels at the first step only)."""
    import copy

    from posttrain.generate import Sampler, SamplingParams
    from posttrain.generate.vision import ImageInputs

    rng = np.random.default_rng(10)
    prompts = [row(rng, [3, "I", 2]), row(rng, ["I", 1, "I", 4])]
    pixels = gemma3_pixels(images(3, seed=11), size=32)
    steps = 24
    gen = copy.deepcopy(hf_model.generation_config)
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    want, want_lp = [], []
    for p, pix in zip(prompts, (pixels[:1], pixels[1:])):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, pixel_values=torch.tensor(pix), token_type_ids=(ids == IMAGE).long(),
                                    generation_config=gen, max_new_tokens=steps, min_new_tokens=steps,
                                    output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(p):]
        logps = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1)
        want.append(tokens.tolist())
        want_lp.append(logps[torch.arange(steps), tokens].numpy())
    sampler = Sampler(model, max_len=64)
    got = sampler.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.0),
                           images=[ImageInputs(pixels=pixels[:1]), ImageInputs(pixels=pixels[1:])])
    assert [t[:n].tolist() for t, n in zip(got.tokens, got.lengths)] == want
    assert len(set(want[0] + want[1])) > 4  # not one token repeated
    np.testing.assert_allclose(got.logprobs, np.stack(want_lp), atol=2e-5)


def test_recipes_build_the_whole_model_or_its_text_model(folder):
    """The model of a recipe that reads image rows: the Gemma3VL (tests/test_vlm_gemma3_recipes.py), with the
    section's numerics on its text model; the other recipes refuse it; with model.text_only its text model alone."""
    from posttrain.config import ModelSection
    from posttrain.errors import PosttrainError
    from posttrain.recipes.build import build_model

    tok = type("Tok", (), {"vocab_size": V})()  # build_model reads the tokenizer's size only
    whole = build_model(ModelSection(path=folder, remat=True), tok, images=True)
    assert isinstance(whole, Gemma3VL) and whole.text.cfg.remat and whole.cfg is whole.text.cfg
    with pytest.raises(PosttrainError, match="text_only: true"):
        build_model(ModelSection(path=folder), tok)
    assert isinstance(build_model(ModelSection(path=folder, text_only=True), tok), Transformer)
