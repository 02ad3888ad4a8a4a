"""Scanned layers (models/scan.py, `ModelConfig.scan_layers`) give the loop's numbers: logits and hidden states
with and without a cache, greedy samples and their log-probabilities (cache phases, n samples a prompt, a packed
cache, multi-turn), train losses and gradients (remat policies, LoRA, micro-batches). Scan is forced on the CPU
here; the default (None) scans on a TPU only, and layers that differ keep the loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.generate import Sampler, SamplingParams
from posttrain.losses import sft_loss
from posttrain.models import Transformer, preset, scan
from posttrain.models import transformer as T
from posttrain.models.lora import LoraParam, apply_lora
from posttrain.train import init_state, make_train_step

TINY = dict(vocab_size=97, embed_dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


def _pair(lora=None, **kw):
    """(scanned, looped) models with the same weights."""
    out = []
    for on in (True, False):
        m = Transformer(preset("tiny-llama", **TINY, scan_layers=on, **kw), rngs=nnx.Rngs(0))
        if lora is not None:
            apply_lora(m, rank=2, seed=1, **lora)
            for _, mod in nnx.iter_modules(m):  # B starts at zero: give it values so the adapters count
                if hasattr(mod, "b") and isinstance(mod.b, LoraParam):
                    mod.b[...] = 0.1 * jax.random.normal(jax.random.key(2), mod.b[...].shape)
        out.append(m)
    return out


def _batch(B=4, L=12, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 97, (B, L + 1)).astype(np.int32)
    seg = np.ones((B, L), np.int32)
    seg[1, :4] = 0  # a padded row
    seg[2, 6:] = 2  # two packed sequences
    pos = np.where(seg[2:3] == 2, np.arange(L) - 6, np.arange(L)).repeat(B, 0)
    return {k: jnp.asarray(v) for k, v in dict(tokens=ids[:, :-1], targets=ids[:, 1:], positions=pos,
                                                segment_ids=seg, weights=(seg > 0).astype(np.float32)).items()}


def _close(a, b, rtol=1e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_which_layers_scan():
    on, off = _pair()
    assert scan.applies(on) and not scan.applies(off)
    assert not scan.enabled(preset("tiny-llama", **TINY))  # the default scans on a TPU only
    mixed = dict(TINY, layer_types=("sliding", "full", "sliding"), sliding_window=4)
    for kw in (mixed, dict(TINY, num_experts=4, experts_per_token=2, expert_mlp_dim=16),
               dict(TINY, num_layers=1)):
        assert not scan.enabled(preset("tiny-llama", **{**kw, "scan_layers": True}))
    assert scan.enabled(preset("tiny-llama", **dict(TINY, sliding_window=4), scan_layers=True))  # all sliding
    part, _ = _pair(lora=dict(targets=(r"layers\.0\.attn\.qkv",)))  # LoRA on one layer: the layers differ
    assert not scan.applies(part)
    drop, _ = _pair(lora=dict(dropout=0.1))  # dropout's shared RNG counts are state beside the weights
    assert not scan.applies(drop)
    whole, _ = _pair(lora={})
    assert scan.applies(whole)
    cache = T.KVCache.init(on.cfg, 2, 8, stacked=True)
    assert cache.k.shape == (3, 2, 2, 8, 8)
    assert cache.map_kv(lambda x, a: jnp.take(x, jnp.array([1]), a)).k.shape == (3, 1, 2, 8, 8)


@pytest.mark.parametrize("remat", [None, "full", "dots"])
def test_forward_equals_the_loop(remat):
    on, off = _pair(remat=remat is not None, remat_policy=remat or "full")
    b = _batch()
    # each forward one compiled program (op by op, the looped model compiled ~80 small programs)
    hidden = nnx.jit(lambda m, b: m(b["tokens"], b["positions"], segment_ids=b["segment_ids"], return_hidden=True))
    probs = nnx.jit(lambda m, b: m(b["tokens"], b["positions"], return_attn=[1]).attn[1])
    got, ref = hidden(on, b), hidden(off, b)
    _close(got.logits, ref.logits)
    assert len(got.hidden) == len(ref.hidden) == 4
    for g, r in zip(got.hidden, ref.hidden):
        _close(g, r)
    _close(probs(on, b), probs(off, b))  # probabilities asked for: the loop runs


def test_cached_forward_equals_the_loop():
    """A prefill then two single-token steps on a stacked cache (and on a per-layer one, stacked on the way)."""
    on, off = _pair()
    tok = jnp.asarray(np.random.default_rng(1).integers(3, 97, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    caches = [T.KVCache.init(on.cfg, 2, 9, stacked=True), T.KVCache.init(on.cfg, 2, 9),
              T.KVCache.init(off.cfg, 2, 9)]
    outs = []
    for m, c in zip((on, on, off), caches):
        logits = []
        o = m(tok, pos, cache=c)
        logits.append(o.logits)
        for t in range(2):
            o = m(tok[:, t:t + 1], pos[:, -1:] + 1 + t, cache=o.cache)
            logits.append(o.logits)
        outs.append((logits, o.cache))
    assert outs[0][1].k.shape[0] == 3 and isinstance(outs[1][1].k, tuple)
    for logits, cache in outs[:2]:
        for g, r in zip(logits, outs[2][0]):
            _close(g, r)
        _close(jnp.stack(cache.k) if isinstance(cache.k, tuple) else cache.k, jnp.stack(outs[2][1].k))
    with pytest.raises(ValueError, match="stacked KV cache"):
        on(tok, pos, cache=caches[0], return_attn=True)


@pytest.mark.parametrize("pack", [1, 2])
def test_sampler_equals_the_loop(monkeypatch, pack):
    """Greedy 70 new tokens (cache phases), 3 samples a prompt (the prefill repeated), then multi-turn: the same
    tokens and log-probabilities. pack 2: the cache holds 2 heads a row (what a TPU gets: attention.kv_pack)."""
    monkeypatch.setattr(T, "kv_pack", lambda head_dim, kv_heads, backend=None: pack)
    on, off = _pair()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, n).tolist() for n in (9, 5, 13)]
    s_on, s_off = Sampler(on, max_len=96), Sampler(off, max_len=96)
    assert s_on._scan and not s_off._scan
    for params in (SamplingParams(max_new_tokens=70, temperature=0.0),
                   SamplingParams(max_new_tokens=12, temperature=1.0, n=3)):
        got, ref = (s.generate(prompts, params, key=jax.random.key(1)) for s in (s_on, s_off))
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        _close(got.logprobs, ref.logprobs, atol=2e-5)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, n=2)
    turns = [s.begin(prompts[:2], greedy) for s in (s_on, s_off)]
    assert turns[0][1].cache.k.shape[:2] == (3, 4)  # stacked: [L, rows, ...]
    again = [s.extend(t, [0, 2], [[5, 6], [7]], dataclasses.replace(greedy, n=1))[0]
             for s, (_, t) in zip((s_on, s_off), turns)]
    np.testing.assert_array_equal(again[0].tokens, again[1].tokens)
    _close(again[0].logprobs, again[1].logprobs, atol=2e-5)


def _grads(model, batch):
    graphdef, params, rest = nnx.split(model, LoraParam if model.layers[0].attn.qkv_lora else nnx.Param, ...)

    def f(p):
        total, m = sft_loss(nnx.merge(graphdef, p, rest), batch)
        return total / m["denom"]

    return jax.jit(jax.value_and_grad(f))(params)


@pytest.mark.parametrize("remat,lora", [(None, False), ("full", False), ("dots", True)])
def test_loss_and_grads_equal_the_loop(remat, lora):
    on, off = _pair(lora={} if lora else None, remat=remat is not None, remat_policy=remat or "full")
    b = _batch()
    (l_on, g_on), (l_off, g_off) = _grads(on, b), _grads(off, b)
    _close(l_on, l_off)
    assert len(jax.tree.leaves(g_on)) == len(jax.tree.leaves(g_off)) > 0
    for a, r in zip(jax.tree.leaves(g_on), jax.tree.leaves(g_off)):
        _close(a, r, rtol=1e-5, atol=1e-6)


def test_train_steps_equal_the_loop():
    """Two SGD steps with 2 micro-batches: the scanned step's losses and weights are the loop's."""
    out = []
    for m in _pair():
        opt = optax.sgd(0.1)
        graphdef, state = init_state(m, opt)
        step = make_train_step(sft_loss, opt, graphdef, micro_batches=2)
        losses = []
        for _ in range(2):
            state, met = step(state, _batch())
            losses.append(float(met["loss"]))
        out.append((losses, state.params))
    _close(out[0][0], out[1][0])
    for a, r in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1])):
        _close(a, r, rtol=1e-5, atol=1e-6)
