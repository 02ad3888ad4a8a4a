"""A KV cache stored in 8 bits (`Sampler(kv_dtype=...)`, `rollout.kv_dtype`, `posttrain generate --kv-dtype`;
models/kv_store.py): the sampler equals transformers run with a cache that rounds every key and value the same
way, and stays within that rounding of transformers' float32 model.

The reference (`Rounding`) is transformers' own DynamicCache with each layer's new keys and values rounded before
they are stored and attended (what the sampler's cache write does: the tokens of a call attend their own keys
through the cache too): float8 by torch's saturated cast; int8 as round(x / s) * s, s = max |x| * float32(1 / 127)
over a head's slot (over the two heads of a packed row), then one float32 forward over prompt + sampled tokens.
Against that reference: float8, float32 round-off (2e-5; measured 4.8e-7 e4m3, 1.9e-6 e5m2); int8, 1e-3
(measured 3.7e-4): a float32 difference of 1e-7 in a key flips the rounding of the few elements that lie on a step's
midpoint, and int8's absolute steps catch ~10x more of them than float8's relative ones; each flip moves an element
by one step. Every sampled token is the reference's argmax within that tolerance.
Against the float32 model: the format's step u (a relative 2^-m for m mantissa bits: e4m3 0.125, e5m2 0.25; int8
1/127 of the slot's max), since each element moves by at most u/2 and a log-prob moves by about the relative change
of the attention it reads, so less than u (measured: e4m3 0.018, e5m2 0.038, a factor 2 per mantissa bit; int8
0.0039), and by more than twice the reference tolerance, or the two references could not be told apart."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from test_kv_pack import stop_then_extend_equals_one_decode

from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.generate.sampling import kv_cache_dtype
from posttrain.models import from_pretrained, kv_store
from posttrain.models import transformer as T
from posttrain.models.config import ModelConfig
from posttrain.models.kv_store import QuantKV

F8 = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}
STEP = {"float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2, "int8": 1 / 127}  # u above
TOL = {"float8_e4m3fn": 2e-5, "float8_e5m2": 2e-5, "int8": 1e-3}  # against the rounded reference
NEW = 70  # several cache phases (the cache grows: its dtype must survive `grow`)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 97, n).tolist() for n in (9, 5, 13)]


def _int8(x, group):
    """round(x / s) * s with s = max |x| / 127 over each slot of `group` heads side by side (x [B, K, T, H])."""
    B, K, T, H = x.shape
    g = x.reshape(B, K // group, group, T, H)
    s = g.abs().amax(dim=(2, 4), keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(g / safe).clamp(-127, 127) * s).reshape(B, K, T, H)


def _hf_logps(path, seqs, starts, kv, group=1):
    """transformers' float32 log-softmax [len - start, V] predicting each seq[start:], its KV cache rounded to `kv`
    (None: not rounded; int8 scales over `group` heads)."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    class Rounding(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            if kv == "int8":
                r = functools.partial(_int8, group=group)
            else:
                dt, big = F8[kv]
                r = lambda x: x.clamp(-big, big).to(dt).to(x.dtype)  # noqa: E731
            return super().update(r(k), r(v), layer_idx, *args, **kwargs)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for seq, start in zip(seqs, starts):
        with torch.no_grad():
            cache = Rounding(config=hf.config) if kv else None
            logits = hf(torch.tensor([seq]), past_key_values=cache, use_cache=cache is not None).logits[0]
        out.append(torch.log_softmax(logits.float(), -1).numpy()[start - 1:len(seq) - 1])
    return out


def _scanned(model):
    for _, m in nnx.iter_modules(model):  # the layers as one lax.scan (models/scan.py): a stacked [L, ...] cache
        if isinstance(getattr(m, "cfg", None), ModelConfig):
            m.cfg = m.cfg.replace(scan_layers=True)
    return model


@pytest.mark.parametrize("kv, layout", [("float8_e4m3fn", "plain"), ("float8_e5m2", "plain"),
                                        ("float8_e4m3fn", "packed"), ("float8_e4m3fn", "scanned"),
                                        ("int8", "plain"), ("int8", "packed"), ("int8", "scanned")])
def test_an_8_bit_cache_equals_transformers_with_a_rounded_cache(hf_checkpoints, monkeypatch, kv, layout):
    """Greedy 70 tokens from left-padded prompts: every token is the rounded-cache reference's argmax and its
    log-prob the reference's (within TOL), and within the format's step (above) of the float32 model's. packed: 2
    heads a cache row (a TPU's layout, forced here: attention.kv_pack; an int8 scale then covers both); scanned: the
    stacked cache of scanned layers."""
    path = hf_checkpoints["llama"]
    if layout == "packed":
        monkeypatch.setattr(T, "kv_pack", lambda head_dim, kv_heads, backend=None: 2)
    model = from_pretrained(path)
    s = Sampler(_scanned(model) if layout == "scanned" else model, max_len=96, kv_dtype=kv)
    assert s._scan == (layout == "scanned")
    prompts = _prompts()
    out = s.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0))
    assert (out.lengths == NEW).all()
    seqs, starts = [p + t.tolist() for p, t in zip(prompts, out.tokens)], [len(p) for p in prompts]
    rows, tol = np.arange(NEW), TOL[kv]
    group = 2 if layout == "packed" else 1
    gaps = []
    for i, (rounded, exact) in enumerate(zip(_hf_logps(path, seqs, starts, kv, group),
                                             _hf_logps(path, seqs, starts, None))):
        chosen = rounded[rows, out.tokens[i]]
        assert (rounded.max(-1) - chosen).max() <= tol  # greedy under the rounded cache
        np.testing.assert_allclose(out.logprobs[i], chosen, atol=tol, rtol=0)
        gaps.append(np.abs(out.logprobs[i] - exact[rows, out.tokens[i]]).max())
    assert 2 * tol < max(gaps) < STEP[kv], (gaps, STEP[kv])
    # the cache really is 8-bit (and packed / stacked as asked) after a turn: its arrays, not a cast copy
    _, turn = s.begin(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
    ks, vs = ([turn.cache.k], [turn.cache.v]) if layout == "scanned" else (list(turn.cache.k), list(turn.cache.v))
    assert {x.dtype for x in ks + vs} == {jnp.dtype(kv)}
    H, K = s.cfg.head_dim, s.cfg.num_kv_heads
    assert ks[0].shape[-3] == (K // 2 if layout == "packed" else K) and ks[0].shape[-1] == (
        2 * H if layout == "packed" else H)
    if kv == "int8":  # a float32 scale per (row, cache row, slot)
        assert isinstance(ks[0], QuantKV) and ks[0].scale.shape == ks[0].shape[:-1]
        assert ks[0].scale.dtype == jnp.float32 and float(ks[0].scale.max()) > 0


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "int8"])
def test_multi_turn_keeps_the_8_bit_cache(hf_checkpoints, kv):
    """`begin` then `extend` (the cache kept, re-batched and grown): the continuation samples what one uninterrupted
    greedy decode with the same 8-bit cache samples, and the kept cache stays 8-bit."""
    s = Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=96, kv_dtype=kv)
    cache = stop_then_extend_equals_one_decode(s)
    assert {x.dtype for x in cache.k + cache.v} == {jnp.dtype(kv)}


def test_the_default_cache_is_the_compute_dtype(hf_checkpoints):
    """No kv_dtype (or the compute dtype's own name): the cache is float32, the sampler's kv_dtype None (exact
    log-probs, the RL rows' old_logps); a float8 one differs from it."""
    model = from_pretrained(hf_checkpoints["llama"])
    assert Sampler(model, max_len=32).kv_dtype is None
    assert Sampler(model, max_len=32, kv_dtype="float32").kv_dtype is None
    assert Sampler(model, max_len=32, kv_dtype="float8_e4m3fn").kv_dtype == jnp.dtype(jnp.float8_e4m3fn)
    assert Sampler(model, max_len=32, dtype="bfloat16", kv_dtype="bfloat16").kv_dtype is None
    cfg = model.cfg
    assert T.KVCache.init(cfg, 1, 4).k[0].dtype == jnp.float32
    c = T.KVCache.init(cfg, 1, 4, kv_dtype="float8_e5m2")
    assert c.k[0].dtype == c.v[-1].dtype == jnp.dtype(jnp.float8_e5m2) and c.pos.dtype == jnp.int32
    c = T.KVCache.init(cfg, 2, 4, kv_dtype="int8", stacked=True)
    assert isinstance(c.k, QuantKV) and c.k.data.shape == (cfg.num_layers, 2, cfg.num_kv_heads, 4, cfg.head_dim)
    grown = c.map_kv(lambda x, a: jnp.repeat(x, 3, axis=a))  # values and scales alike (the sampler's n samples)
    assert grown.k.data.shape[1] == grown.k.scale.shape[1] == 6


def test_a_float8_write_saturates_instead_of_making_nan():
    """XLA's convert makes NaN of a value beyond float8_e4m3fn's 448 (it has no inf): `store` clips first, so an
    outlier key is stored as +-448 (as vLLM's fp8 cache saturates); other dtypes are a plain cast."""
    x = jnp.asarray([1.0, 500.0, -1e4, 0.3, 448.0], jnp.float32)
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)).sum() == 2  # what a bare cast does
    got = np.asarray(kv_store.store(x, jnp.float8_e4m3fn), np.float32)
    np.testing.assert_array_equal(got, [1.0, 448.0, -448.0, 0.3125, 448.0])
    e5m2 = np.asarray(kv_store.store(x, jnp.float8_e5m2), np.float32)
    np.testing.assert_array_equal(e5m2[:3], [1.0, 512.0, -10240.0])
    np.testing.assert_array_equal(kv_store.store(x, jnp.bfloat16), x.astype(jnp.bfloat16))


def test_int8_rounds_each_slot_to_its_own_scale():
    """quantize: s = max |x| * float32(1 / 127) per slot, values round(x / s) in [-127, 127] (numpy's
    round-half-even), so the largest element comes back exactly and every other within s / 2; an all-zero slot
    (padding) is 0 with scale 0; a write lands at its slot, values and scale together."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5, 8)).astype(np.float32) * rng.uniform(0.01, 100, size=(2, 3, 5, 1)).astype(np.float32)
    x[1, 2, 4] = 0.0
    q, scale = kv_store.quantize(jnp.asarray(x))
    s = np.abs(x).max(-1) * np.float32(1 / 127)
    np.testing.assert_array_equal(scale, s)
    ref = np.clip(np.round(x / np.where(s > 0, s, 1)[..., None]), -127, 127)
    np.testing.assert_array_equal(np.asarray(q), ref.astype(np.int8))
    back = np.asarray(kv_store.load(kv_store.QuantKV(q, scale), jnp.float32))
    assert (np.abs(back - x) <= s[..., None] / 2 * (1 + 1e-6)).all() and (back[1, 2, 4] == 0).all()
    am = np.abs(x).argmax(-1)
    np.testing.assert_allclose(np.take_along_axis(back, am[..., None], -1), np.take_along_axis(x, am[..., None], -1),
                               rtol=1e-6)
    cache = kv_store.empty((2, 3, 9, 8), "int8")
    zero = jnp.zeros((), jnp.int32)
    got = kv_store.write(cache, jnp.asarray(x), (zero, zero, jnp.int32(3), zero))
    np.testing.assert_array_equal(got.data[:, :, 3:8], q)
    np.testing.assert_array_equal(got.scale[:, :, 3:8], scale)
    assert not np.asarray(got.data[:, :, :3]).any() and not np.asarray(got.scale[:, :, 8:]).any()


def test_unknown_names_are_refused(hf_checkpoints, capsys):
    with pytest.raises(PosttrainError, match="kv_dtype: unknown KV cache dtype 'int4'.*float8_e4m3fn"):
        kv_cache_dtype("int4")
    with pytest.raises(PosttrainError, match="Sampler kv_dtype: unknown KV cache dtype 'fp8'"):
        Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=16, kv_dtype="fp8")
    from posttrain.cli import main

    rc = main(["generate", "--model", hf_checkpoints["llama"], "--prompt", "hi", "--kv-dtype", "int4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--kv-dtype: unknown KV cache dtype 'int4'" in err and "float8_e4m3fn" in err


def test_the_rollout_setting_is_checked(tmp_path):
    """rollout.kv_dtype: an unknown name is refused by the config; a float8 cache is not the trainer's precision,
    so GRPO takes it as it takes rollout.dtype (num_iterations 1, the correction allowed) and PPO, whose old
    log-probs are the sampler's, refuses it by name."""
    from test_grpo import config as grpo_config
    from test_ppo import config as ppo_config

    from posttrain.trainers.ppo import PPOTrainer

    with pytest.raises(Exception, match="kv_dtype"):
        grpo_config(tmp_path, **{"rollout.kv_dtype": "int4"})
    with pytest.raises(PosttrainError, match="needs grpo.num_iterations=1"):
        grpo_config(tmp_path, **{"rollout.kv_dtype": "float8_e4m3fn", "grpo.num_iterations": 2})
    grpo_config(tmp_path, **{"rollout.kv_dtype": "float8_e4m3fn", "rollout.is_mode": "token_truncate"})
    with pytest.raises(PosttrainError, match="rollout.kv_dtype is not supported by ppo"):
        PPOTrainer(ppo_config(tmp_path / "ppo", **{"rollout.kv_dtype": "float8_e4m3fn"}), progress=False)


def test_grpo_samples_with_a_float8_cache(tmp_path):
    """rollout.kv_dtype reaches the sampler (float8 cache arrays), and its log-probs go to the rows as
    sampler_logps, not old_logps (the old policy is then the trainer's own, as with rollout.dtype)."""
    from test_grpo import config as grpo_config

    from posttrain.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(grpo_config(tmp_path, **{"rollout.kv_dtype": "float8_e4m3fn", "train.steps": 1}),
                          progress=False)
    parts = trainer.setup()
    sampler = parts.batches.sampler
    assert sampler.kv_dtype == jnp.dtype(jnp.float8_e4m3fn)
    _, turn = sampler.begin([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert {x.dtype for x in jax.tree.leaves((turn.cache.k, turn.cache.v))} == {jnp.dtype(jnp.float8_e4m3fn)}
    batch = parts.batches(parts.state)
    assert "sampler_logps" in batch and "old_logps" not in batch
    assert np.isfinite(batch["sampler_logps"]).all() and (batch["sampler_logps"] <= 0).all()
