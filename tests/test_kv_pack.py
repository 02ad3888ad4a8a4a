"""A KV cache with P heads a row (attention.pack_heads, what a TPU gets for heads narrower than its 128 lanes) gives
the same attention, samples and log-probabilities as the plain [B, K, S, H] cache. The packed path runs on the CPU
here by forcing the choice (transformer.kv_pack)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.generate import Sampler, SamplingParams
from posttrain.models import attention as A
from posttrain.models import from_pretrained
from posttrain.models import transformer as T


def test_kv_pack_choice():
    assert A.kv_pack(64, 8, "tpu") == 2 and A.kv_pack(32, 8, "tpu") == 4 and A.kv_pack(16, 8, "tpu") == 8
    assert A.kv_pack(128, 8, "tpu") == 1 and A.kv_pack(256, 4, "tpu") == 1  # already a lane-wide row
    assert A.kv_pack(64, 1, "tpu") == 1 and A.kv_pack(32, 2, "tpu") == 1  # heads do not fill whole rows
    assert A.kv_pack(96, 8, "tpu") == 1  # 128 is not a multiple of 96
    assert A.kv_pack(64, 8, "cpu") == 1 and A.kv_pack(64, 8, "gpu") == 1


def test_pack_and_unpack_are_inverse_and_put_heads_side_by_side():
    x = jnp.arange(2 * 4 * 3 * 5, dtype=jnp.float32).reshape(2, 4, 3, 5)
    p = A.pack_heads(x, 2)
    assert p.shape == (2, 2, 3, 10)
    np.testing.assert_array_equal(p[1, 1, 2, :5], x[1, 2, 2])  # row 1 = heads 2 and 3
    np.testing.assert_array_equal(p[1, 1, 2, 5:], x[1, 3, 2])
    np.testing.assert_array_equal(A.unpack_heads(p, 5), x)


def _inputs(seed, B=2, T=3, K=4, G=2, H=8, S=11):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, K, G, H), (B, K, S, H), (B, K, S, H)))
    k_pos = jnp.asarray(np.where(rng.random((B, S)) < 0.2, -1, np.arange(S)), jnp.int32)
    q_pos = jnp.asarray(np.arange(S - T, S)[None].repeat(B, 0), jnp.int32)
    layout = A.Layout(q_pos, k_pos, jnp.arange(S - T, S, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32))
    return q, k, v, layout


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("extra", ["plain", "softcap", "sinks", "window"])
def test_dense_reads_a_packed_cache_exactly(P, extra):
    q, k, v, layout = _inputs(P)
    kw = dict(window=4 if extra == "window" else None, scale=0.3, cap=5.0 if extra == "softcap" else None,
              sinks=jnp.full((4, 2), 0.5) if extra == "sinks" else None)
    ref, ref_p = A.attention(q, k, v, layout, impl="dense", return_probs=True, **kw)
    got, got_p = A.attention(q, A.pack_heads(k, P), A.pack_heads(v, P), layout, impl="dense", return_probs=True, **kw)
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got_p, ref_p, atol=1e-6, rtol=0)  # the zero lanes reorder the sums: ulps
    out, _ = A.attention(q, A.pack_heads(k, P), A.pack_heads(v, P), layout, impl="blockwise", **kw)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)  # the tiled paths unpack first


@pytest.fixture
def packed(monkeypatch):
    """Caches built while this fixture is active hold 2 heads a row wherever the head count allows."""
    monkeypatch.setattr(T, "kv_pack", lambda head_dim, kv_heads, backend=None: 2 if kv_heads % 2 == 0 else 1)


def _generate(path, params, prompts, **kw):
    s = Sampler(from_pretrained(path), max_len=96)
    out = s.generate(prompts, params, key=jax.random.key(3), **kw)
    return s, out


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_sampler_with_a_packed_cache_equals_the_plain_one(hf_checkpoints, monkeypatch, family):
    """Greedy 70 tokens (several cache phases) and 4 samples a prompt (the shared prefill repeated) from left-padded
    prompts of different lengths: the same tokens, log-probabilities within float error."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, n).tolist() for n in (9, 5, 13)]
    greedy = SamplingParams(max_new_tokens=70, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, n=4)
    plain_s, plain = _generate(hf_checkpoints[family], greedy, prompts)
    _, plain_n = _generate(hf_checkpoints[family], sampled, prompts)
    monkeypatch.setattr(T, "kv_pack", lambda head_dim, kv_heads, backend=None: 2)
    packed_s, got = _generate(hf_checkpoints[family], greedy, prompts)
    _, got_n = _generate(hf_checkpoints[family], sampled, prompts)
    cache = T.KVCache.init(packed_s.cfg, 1, 8)
    assert cache.k[0].shape[1] * 2 == plain_s.cfg.layer_kv_heads(0)  # the packed path did run
    for a, b in ((plain, got), (plain_n, got_n)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5, rtol=0)


def stop_then_extend_equals_one_decode(s) -> T.KVCache:
    """`begin` stopped at a sequence, then `extend` of row 0 (the cache kept): the continuation samples what one
    uninterrupted greedy decode samples, log-probs within 1e-5. Returns the extended turn's cache."""
    ids = [[5, 6, 7, 8, 9], [11, 12, 13]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    never = [[10**6, 10**6]]
    ref, _ = s.begin(ids, greedy, stop_sequences=never)
    first, turn = s.begin(ids, greedy, stop_sequences=[ref.tokens[0, 4:6].tolist()])
    L = int(first.lengths[0])
    assert first.finish_reasons[0] == "stop"
    again, turn2 = s.extend(turn, [0], [[]], dataclasses.replace(greedy, n=1), max_new_tokens=[12 - L],
                            stop_sequences=never)
    np.testing.assert_array_equal(again.tokens[0, :12 - L], ref.tokens[0, L:])
    np.testing.assert_allclose(again.logprobs[0, :12 - L], ref.logprobs[0, L:], atol=1e-5, rtol=0)
    return turn2.cache


def test_stop_then_extend_with_a_packed_cache(hf_checkpoints, packed):
    """A multi-turn continuation (`begin`, then `extend` of the kept rows) reads and grows the packed cache: it
    samples what one uninterrupted greedy decode samples."""
    s = Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=96)
    assert s.cfg.num_kv_heads % 2 == 0 and T.KVCache.init(s.cfg, 1, 8).k[0].shape[1] == s.cfg.num_kv_heads // 2
    stop_then_extend_equals_one_decode(s)
