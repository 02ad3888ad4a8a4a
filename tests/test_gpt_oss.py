"""GPT-OSS (attention sinks, alternating sliding / full layers, YaRN RoPE, biased attention, a biased router and
biased experts with the clamped SwiGLU) against Hugging Face transformers, on a tiny random checkpoint built
locally with `save_pretrained` (sinks, biases and the router drawn large enough that each one matters)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from test_branches import _groups, _shared_batch, _unshared_batch, _use

from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.logps import branch_logps
from posttrain.models import from_pretrained, save_pretrained

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **CONFIG), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "router" in name or "sinks" in name or name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
    path = os.fspath(tmp_path_factory.mktemp("gpt_oss") / "hf")
    model.save_pretrained(path)
    return path


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_logits(hf, toks, mask, pos):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(pos)).logits.numpy()


_fwd = jax.jit(lambda m, x, p, s: m(x, p, segment_ids=s).logits)


def _batch(T, seed=0):
    lens = np.array([T, T // 2 + 1, 4])
    toks = np.random.default_rng(seed).integers(3, 97, (3, T))
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.int64)
    return toks, mask, np.broadcast_to(np.arange(T), (3, T)).copy(), lens


def _diff(a, b, lens):
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(lens))


@pytest.mark.parity
def test_config_reads_every_gpt_oss_field(ckpt):
    cfg = from_pretrained(ckpt).cfg
    assert cfg.layer_types == ("sliding", "full", "sliding") and cfg.sliding_window == 5
    assert cfg.attn_sinks and cfg.o_bias and cfg.qkv_bias and cfg.router_bias and cfg.expert_bias
    assert cfg.expert_act == "gpt_oss" and cfg.num_experts == 4 and cfg.experts_per_token == 2
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 32.0 and cfg.rope.theta == 150_000.0


@pytest.mark.parity
@pytest.mark.parametrize("T", [11, 150])  # 150: the blockwise path, more than two 64-token tiles
def test_logits_match_transformers_with_right_padding(ckpt, T):
    toks, mask, pos, lens = _batch(T)
    ref = _hf_logits(_hf(ckpt), toks, mask, pos)
    out = np.asarray(_fwd(from_pretrained(ckpt), jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask)))
    assert float(ref.max() - ref.min()) > 5  # logits that vary, so a 1e-4 match means something
    assert _diff(out, ref, lens) <= 1e-4


@pytest.mark.parity
def test_packed_segments_equal_separate_rows(ckpt):
    r = np.random.default_rng(3)
    a, b = r.integers(3, 97, 70).tolist(), r.integers(3, 97, 50).tolist()
    toks = np.array([a + b + [0] * 8])
    seg = np.array([[1] * 70 + [2] * 50 + [0] * 8])
    pos = np.array([list(range(70)) + list(range(50)) + [0] * 8])
    out = np.asarray(_fwd(from_pretrained(ckpt), jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(seg)))[0]
    hf = _hf(ckpt)
    for s, start in ((a, 0), (b, 70)):
        ref = _hf_logits(hf, np.array([s]), np.ones((1, len(s)), np.int64), np.arange(len(s))[None])[0]
        assert float(np.abs(out[start:start + len(s)] - ref).max()) <= 1e-4


@pytest.mark.parity
def test_greedy_24_tokens_equal_a_cache_free_transformers_loop(ckpt):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 97, n).tolist() for n in (9, 4, 13)]
    out = Sampler(from_pretrained(ckpt), max_len=64).generate(prompts, SamplingParams(max_new_tokens=24,
                                                                                     temperature=0.0))
    hf = _hf(ckpt)
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(24):  # full forwards, no cache: the reference
            n = len(seq)
            seq.append(int(_hf_logits(hf, np.array([seq]), np.ones((1, n), np.int64), np.arange(n)[None])[0, -1]
                           .argmax()))
        np.testing.assert_array_equal(out.tokens[i], seq[len(p):])


@pytest.mark.parity
def test_export_round_trip_loads_in_transformers(ckpt, tmp_path):
    toks, mask, pos, lens = _batch(11, seed=2)
    path = save_pretrained(from_pretrained(ckpt), str(tmp_path / "export"))
    hf_export, hf_src = _hf(path), _hf(ckpt)
    assert _diff(_hf_logits(hf_export, toks, mask, pos), _hf_logits(hf_src, toks, mask, pos), lens) <= 1e-5


@pytest.mark.parametrize("path", ["blockwise", "dense"])
def test_prefix_shared_rows_equal_unshared_rows_logps_and_gradients(ckpt, path, monkeypatch):
    """Per-token log-probs and the weight gradients (sinks and biases included) of a DPO / GRPO shaped
    objective: a prefix-shared row [prompt | c1 | c2 | c3] against three unshared rows, <= 1e-5."""
    _use(path, monkeypatch)
    graphdef, params = nnx.split(from_pretrained(ckpt))
    groups = _groups(1)
    shared, unshared = _shared_batch(groups), _unshared_batch(groups)
    logps = jax.jit(lambda p, b, k: branch_logps(nnx.merge(graphdef, p), b, k)[0], static_argnums=2)
    tok_s, tok_u = logps(params, shared, 3), logps(params, unshared, 1)
    for g, (_, conts) in enumerate(groups):
        off = 0
        for i, c in enumerate(conts):
            np.testing.assert_allclose(np.asarray(tok_s)[g, off:off + len(c)], np.asarray(tok_u)[g * 3 + i, :len(c)],
                                       atol=1e-5, rtol=0)
            off += len(c)
    n_tokens = sum(len(c) for _, conts in groups for c in conts)
    coef = jnp.asarray([[1.0, -0.5, 2.0], [0.3, 1.5, -1.0]]) / n_tokens
    g_s = jax.jit(jax.grad(lambda p: jnp.sum(branch_logps(nnx.merge(graphdef, p), shared, 3)[1] * coef)))(params)
    g_u = jax.jit(jax.grad(lambda p: jnp.sum(branch_logps(nnx.merge(graphdef, p), unshared, 1)[1][:, 0]
                                             * coef.reshape(-1))))(params)
    flat_s, flat_u = dict(nnx.to_flat_state(g_s)), dict(nnx.to_flat_state(g_u))
    sinks = [k for k in flat_s if k[-1] == "sinks"]
    assert sinks and all(float(jnp.abs(flat_s[k][...]).max()) > 1e-4 for k in sinks)  # the sinks learn
    for k in flat_s:
        np.testing.assert_allclose(np.asarray(flat_s[k][...]), np.asarray(flat_u[k][...]), atol=1e-5, rtol=0,
                                   err_msg=str(k))


def test_sampler_logprobs_equal_the_trainer_forward(ckpt):
    """Sampled at temperature 1 (n = 2, group prefill), 70 tokens each past the 5-token window: the sampler's
    log-probs equal log_softmax of one training forward over the same tokens, <= 1e-5 (what RL relies on)."""
    sampler = Sampler(from_pretrained(ckpt), max_len=128)
    prompts = [np.random.default_rng(5).integers(3, 97, n).tolist() for n in (9, 13)]
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=70, temperature=1.0, n=2), key=jax.random.key(3))
    forward = jax.jit(lambda st, x: nnx.merge(sampler.graphdef, st)(x, jnp.arange(x.shape[1])[None]).logits[0])
    for r in range(len(out.lengths)):
        p = prompts[out.prompt_index[r]]
        seq = np.array(p + out.tokens[r].tolist())
        logp = jax.nn.log_softmax(forward(sampler.state, jnp.asarray(seq[None])), axis=-1)
        ref = np.asarray(logp[len(p) - 1:-1][np.arange(70), out.tokens[r]])
        np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-5, rtol=0)
