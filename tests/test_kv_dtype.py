"""A KV cache stored in float8 (`Sampler(kv_dtype=...)`, `rollout.kv_dtype`, `posttrain generate --kv-dtype`): the
sampler equals transformers run with a cache that rounds every key and value to the same float8 format, and
stays within that format's rounding of transformers' float32 model.

The reference (`Rounding`) is transformers' own DynamicCache with each layer's new keys and values saturated and
rounded by torch's float8 cast before they are stored and attended (what the sampler's cache write does: the
tokens of a call attend their own keys through the cache too), then one float32 forward over prompt + sampled
tokens. Bounds: against that reference, float32 round-off (the roundings themselves agree: 2e-5); against the
float32 model, the rounding's own effect: a float8 format with m mantissa bits rounds each element by at most
2^-(m+1) of it (e4m3: 2^-4 = 0.0625, e5m2: 2^-3 = 0.125), and a log-prob moves by about the relative change of
the attention's output, so the teacher-forced log-probs must differ by less than 2^-(m+1) and, for the test to
see the rounding at all, by more than 1e-3 (measured on this checkpoint: e4m3 0.018, e5m2 0.038: a factor 2 per
mantissa bit)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.generate.sampling import kv_cache_dtype
from posttrain.models import attention as A
from posttrain.models import from_pretrained
from posttrain.models import transformer as T
from posttrain.models.config import ModelConfig

F8 = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0, 3), "float8_e5m2": (torch.float8_e5m2, 57344.0, 2)}
NEW = 70  # several cache phases (the cache grows: its dtype must survive `grow`)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 97, n).tolist() for n in (9, 5, 13)]


def _hf_logps(path, seqs, starts, kv):
    """transformers' float32 log-softmax [len - start, V] predicting each seq[start:], its KV cache rounded to `kv`
    (None: not rounded)."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    class Rounding(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            dt, big, _ = F8[kv]
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
                                        ("float8_e4m3fn", "packed"), ("float8_e4m3fn", "scanned")])
def test_a_float8_cache_equals_transformers_with_a_rounded_cache(hf_checkpoints, monkeypatch, kv, layout):
    """Greedy 70 tokens from left-padded prompts: every token is the rounded-cache reference's argmax, its log-prob
    the reference's within 2e-5, and within the format's rounding (above) of the float32 model's. packed: 2 heads a
    cache row (a TPU's layout, forced here: attention.kv_pack); scanned: the stacked cache of scanned layers."""
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
    rows = np.arange(NEW)
    bound = 2.0 ** -(F8[kv][2] + 1)
    gaps = []
    for i, (rounded, exact) in enumerate(zip(_hf_logps(path, seqs, starts, kv), _hf_logps(path, seqs, starts, None))):
        np.testing.assert_array_equal(out.tokens[i], rounded.argmax(-1))  # greedy under the rounded cache
        np.testing.assert_allclose(out.logprobs[i], rounded[rows, out.tokens[i]], atol=2e-5, rtol=0)
        gaps.append(np.abs(out.logprobs[i] - exact[rows, out.tokens[i]]).max())
    assert 1e-3 < max(gaps) < bound, (gaps, bound)
    # the cache really is float8 (and packed / stacked as asked) after a turn: its arrays, not a cast copy
    _, turn = s.begin(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
    ks = [turn.cache.k] if layout == "scanned" else list(turn.cache.k)
    assert {x.dtype for x in ks + ([turn.cache.v] if layout == "scanned" else list(turn.cache.v))} == {
        jnp.dtype(kv)}
    H, K = s.cfg.head_dim, s.cfg.num_kv_heads
    assert ks[0].shape[-3:][0] == (K // 2 if layout == "packed" else K) and ks[0].shape[-1] == (
        2 * H if layout == "packed" else H)


def test_multi_turn_keeps_the_float8_cache(hf_checkpoints):
    """`begin` then `extend` (the cache kept, re-batched and grown): the continuation samples what one uninterrupted
    greedy decode with the same float8 cache samples, and the kept cache stays float8."""
    s = Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=96, kv_dtype="float8_e4m3fn")
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
    assert {x.dtype for x in turn2.cache.k + turn2.cache.v} == {jnp.dtype(jnp.float8_e4m3fn)}


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


def test_a_float8_write_saturates_instead_of_making_nan():
    """XLA's convert makes NaN of a value beyond float8_e4m3fn's 448 (it has no inf): `store` clips first, so an
    outlier key is stored as +-448 (as vLLM's fp8 cache saturates); other dtypes are a plain cast."""
    x = jnp.asarray([1.0, 500.0, -1e4, 0.3, 448.0], jnp.float32)
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)).sum() == 2  # what a bare cast does
    got = np.asarray(A.store(x, jnp.float8_e4m3fn), np.float32)
    np.testing.assert_array_equal(got, [1.0, 448.0, -448.0, 0.3125, 448.0])
    np.testing.assert_array_equal(np.asarray(A.store(x, jnp.float8_e5m2), np.float32)[:3], [1.0, 512.0, -10240.0])
    np.testing.assert_array_equal(A.store(x, jnp.bfloat16), x.astype(jnp.bfloat16))


def test_unknown_names_are_refused(hf_checkpoints, capsys):
    with pytest.raises(PosttrainError, match="kv_dtype: unknown KV cache dtype 'int4'.*float8_e4m3fn"):
        kv_cache_dtype("int4")
    with pytest.raises(PosttrainError, match="Sampler kv_dtype: unknown KV cache dtype 'fp8'"):
        Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=16, kv_dtype="fp8")
    from posttrain.cli import main

    rc = main(["generate", "--model", hf_checkpoints["llama"], "--prompt", "hi", "--kv-dtype", "int8"])
    err = capsys.readouterr().err
    assert rc == 2 and "--kv-dtype: unknown KV cache dtype 'int8'" in err and "float8_e4m3fn" in err


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
