"""The Transformer against Hugging Face transformers: logits parity, export round trip, KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import FAMILIES

from posttrain.models import KVCache, Transformer, count_params, from_pretrained, preset, save_pretrained

B, T = 3, 11
LENS = np.array([11, 7, 4])


def _batch(seed=0, vocab=97):
    toks = np.random.default_rng(seed).integers(3, vocab, (B, T))
    mask = (np.arange(T)[None] < LENS[:, None]).astype(np.int64)  # right padding, unequal lengths
    pos = np.broadcast_to(np.arange(T), (B, T)).copy()
    return toks, mask, pos


def _hf_logits(path, toks, mask, pos):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    return out.logits.numpy()


def _ours(model, toks, mask, pos):
    return np.asarray(model(jnp.asarray(toks), jnp.asarray(pos), segment_ids=jnp.asarray(mask)).logits)


def _max_valid_diff(a, b):
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(LENS))


@pytest.mark.parity
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(hf_checkpoints, family):
    toks, mask, pos = _batch()
    ref = _hf_logits(hf_checkpoints[family], toks, mask, pos)
    ours = _ours(from_pretrained(hf_checkpoints[family]), toks, mask, pos)
    assert _max_valid_diff(ours, ref) <= 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_export_round_trip_loads_in_transformers(hf_checkpoints, family, tmp_path):
    toks, mask, pos = _batch(1)
    model = from_pretrained(hf_checkpoints[family])
    out = save_pretrained(model, str(tmp_path / "export"))
    ref = _hf_logits(out, toks, mask, pos)  # transformers reads what posttrain wrote
    assert _max_valid_diff(_ours(model, toks, mask, pos), ref) <= 1e-4
    # and it is the same model as the original folder
    assert _max_valid_diff(ref, _hf_logits(hf_checkpoints[family], toks, mask, pos)) <= 1e-5


def test_sharded_export_reloads(hf_checkpoints, tmp_path):
    model = from_pretrained(hf_checkpoints["qwen3"])
    out = save_pretrained(model, str(tmp_path / "sharded"), max_shard_bytes=50_000)
    import os

    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    toks, mask, pos = _batch(2)
    np.testing.assert_array_equal(_ours(from_pretrained(out), toks, mask, pos), _ours(model, toks, mask, pos))


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3"])
def test_kv_cache_decoding_equals_full_forward(hf_checkpoints, family):
    """Prefill 5 tokens, then decode one at a time: same logits as one full forward."""
    model = from_pretrained(hf_checkpoints[family])
    graphdef, state = nnx.split(model)
    # compiled calls: eager op-by-op dispatch of every decode step was most of this test's time
    fwd = jax.jit(lambda st, x, p, c: nnx.merge(graphdef, st)(x, p, cache=c))
    toks, _, pos = _batch(3)
    full = np.asarray(model(jnp.asarray(toks), jnp.asarray(pos)).logits)
    cache = KVCache.init(model.cfg, B, 16)
    out = fwd(state, jnp.asarray(toks[:, :5]), jnp.asarray(pos[:, :5]), cache)
    steps = [np.asarray(out.logits)]
    cache = out.cache
    for t in range(5, T):
        out = fwd(state, jnp.asarray(toks[:, t:t + 1]), jnp.asarray(pos[:, t:t + 1]), cache)
        cache = out.cache
        steps.append(np.asarray(out.logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)
    assert int(cache.index) == T


def test_left_padding_and_packing_match_unpadded(hf_checkpoints):
    """A left-padded row, and two sequences packed in one row, give each sequence's own logits."""
    graphdef, state = nnx.split(from_pretrained(hf_checkpoints["gemma3"]))
    fwd = jax.jit(lambda st, x, p, seg: nnx.merge(graphdef, st)(x, p, segment_ids=seg))
    rng = np.random.default_rng(4)
    a, b = rng.integers(3, 97, 6), rng.integers(3, 97, 5)

    def model(x, p, segment_ids=None):
        return fwd(state, x, p, segment_ids)

    def alone(x):
        return np.asarray(model(jnp.asarray(x[None]), jnp.arange(len(x))[None]).logits[0])

    pad = np.concatenate([np.zeros(5, int), a])
    seg = np.concatenate([np.zeros(5, int), np.ones(6, int)])
    pos = np.concatenate([np.zeros(5, int), np.arange(6)])
    left = np.asarray(model(jnp.asarray(pad[None]), jnp.asarray(pos[None]), segment_ids=jnp.asarray(seg[None])).logits)
    np.testing.assert_allclose(left[0, 5:], alone(a), atol=1e-5)
    packed = np.concatenate([a, b])
    seg = np.concatenate([np.ones(6, int), 2 * np.ones(5, int)])
    pos = np.concatenate([np.arange(6), np.arange(5)])
    out = model(jnp.asarray(packed[None]), jnp.asarray(pos[None]), segment_ids=jnp.asarray(seg[None]))
    out = np.asarray(out.logits)
    np.testing.assert_allclose(out[0, :6], alone(a), atol=1e-5)
    np.testing.assert_allclose(out[0, 6:], alone(b), atol=1e-5)


def test_hidden_states_and_attention_outputs(hf_checkpoints):
    from transformers import AutoModelForCausalLM

    path = hf_checkpoints["llama"]
    toks, mask, pos = _batch(5)
    full = np.ones_like(mask)
    model = from_pretrained(path)
    out = model(jnp.asarray(toks), jnp.asarray(pos), return_hidden=True, return_attn=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(toks), attention_mask=torch.tensor(full), output_hidden_states=True,
                 output_attentions=True)
    assert len(out.hidden) == len(ref.hidden_states) == model.cfg.num_layers + 1
    for ours, theirs in zip(out.hidden, ref.hidden_states):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-5)
    for ours, theirs in zip(out.attn, ref.attentions):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-5)


# Published totals (model cards / safetensors metadata), text-only for Gemma 3.
PUBLISHED = {"llama3-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "gemma3-1b": 999_885_952,
             "llama3-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920}


@pytest.mark.parametrize("name", sorted(PUBLISHED) + ["gemma3-4b", "mistral-7b"])  # the last two: HF count only
def test_presets_build_abstractly_with_published_sizes(name):
    """eval_shape allocates nothing; the count equals transformers' own model of the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.hf import config_to_hf

    abstract = nnx.eval_shape(lambda: Transformer(preset(name), rngs=nnx.Rngs(0)))
    n = count_params(abstract)
    # abstract leaves are ShapeDtypeStructs: no device buffers were allocated
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))
    hf_cfg = config_to_hf(preset(name))
    mt = hf_cfg.pop("model_type")
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **hf_cfg))
    assert n == sum(p.numel() for p in ref.parameters())
    if name in PUBLISHED:
        assert n == PUBLISHED[name]


def test_plain_weight_gradients_are_bitwise_autodiffs(monkeypatch):
    """layers.project's weight gradient (x^T materialised, one plain product: o, down, an untied lm_head on a CPU)
    equals JAX's own differentiation of x @ w bit for bit, for every parameter of a model."""
    from posttrain.losses import sft_loss
    from posttrain.models import layers

    cfg = preset("tiny-llama", tie_embeddings=False, vocab_size=97, embed_dim=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, mlp_dim=128)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    toks, mask, pos = _batch(1)
    batch = dict(tokens=jnp.asarray(toks, jnp.int32), positions=jnp.asarray(pos, jnp.int32),
                 segment_ids=jnp.asarray(mask, jnp.int32), targets=jnp.asarray(np.roll(toks, -1, 1), jnp.int32),
                 weights=jnp.asarray(mask, jnp.float32))
    graphdef, params = nnx.split(model)

    def grads():
        return jax.jit(jax.grad(lambda p: sft_loss(nnx.merge(graphdef, p), batch)[0]))(params)

    plain = grads()
    monkeypatch.setattr(layers, "PLAIN_WEIGHT_GRADS", False)
    autodiff = grads()
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(autodiff)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
