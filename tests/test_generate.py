"""The sampler: greedy parity with transformers, exact log-probabilities, correct sampling, no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams, truncate
from posttrain.generate.sampler import phase_sizes
from posttrain.models import from_pretrained


@pytest.fixture(scope="module")
def samplers(hf_checkpoints):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = Sampler(from_pretrained(hf_checkpoints[family]), max_len=128)
        return cache[family]

    return get


def _prompts(seed, lengths=(9, 5, 13)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 97, n).tolist() for n in lengths]


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_greedy_matches_transformers_generate(hf_checkpoints, samplers, family):
    from transformers import AutoModelForCausalLM

    new = 100  # >= 64, and long enough that the decode runs in several cache phases
    assert len(phase_sizes(16, new)) == 3
    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoints[family], dtype=torch.float32,
                                              attn_implementation="eager").eval()  # sdpa drops Gemma 2 soft-caps
    # no end-of-sequence token on either side (the sampler has no stop tokens here): with min_new_tokens transformers
    # would mask EOS's logit instead, a different argmax wherever EOS is the greedy token
    hf.generation_config.eos_token_id = None
    prompts = _prompts(0)
    out = samplers(family).generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, pad_token_id=0)
        np.testing.assert_array_equal(out.tokens[i], ref[0, len(p):].numpy())
    assert (out.lengths == new).all() and set(out.finish_reasons) == {"length"}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_trainer_forward(samplers, temperature):
    """Sampler log-probs equal log_softmax(forward logits / T) on the same tokens (the RL basis)."""
    s = samplers("qwen3")
    prompts = _prompts(1)
    new = 70  # two cache phases (the cache grows after the n-fold repeat)
    assert len(phase_sizes(16, new)) == 2
    out = s.generate(prompts, SamplingParams(max_new_tokens=new, temperature=temperature, n=2),
                     key=jax.random.key(3))
    from flax import nnx

    # one compiled forward (eager op-by-op dispatch of the blockwise attention loops is slow)
    forward = jax.jit(lambda st, x: nnx.merge(s.graphdef, st)(x, jnp.arange(x.shape[1])[None]).logits[0])
    for r in range(len(out.lengths)):
        p = prompts[out.prompt_index[r]]
        seq = np.array(p + out.tokens[r].tolist())
        logits = forward(s.state, jnp.asarray(seq[None]))
        logp = jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1)
        ref = np.asarray(logp[len(p) - 1:-1][np.arange(new), out.tokens[r]])
        np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-5, rtol=0)


def _chi2_p(counts, probs):
    from jax.scipy.special import gammaincc

    expected = probs * counts.sum()
    keep = expected >= 5  # pool rare tokens into one cell, as the test requires
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    return float(gammaincc((len(obs) - 1) / 2, chi2 / 2))


@functools.partial(jax.jit, static_argnums=0)
def _forward_last(graphdef, state, x):
    from flax import nnx

    return nnx.merge(graphdef, state)(x, jnp.arange(x.shape[1])[None]).logits[0, -1]


def _next_token_probs(s, prompt, temperature=1.0):

    logits = _forward_last(s.graphdef, s.state, jnp.asarray([prompt]))
    return np.asarray(jax.nn.softmax(logits.astype(jnp.float32) / temperature), np.float64)


def test_sampling_matches_softmax_chi_square(samplers):
    s = samplers("llama")
    prompt = _prompts(2, (6,))[0]
    n = 20_000
    out = s.generate([prompt], SamplingParams(max_new_tokens=1, temperature=1.0, n=n), key=jax.random.key(7))
    counts = np.bincount(out.tokens[:, 0], minlength=97).astype(np.float64)
    probs = _next_token_probs(s, prompt)
    assert _chi2_p(counts, probs) > 0.001
    # and the test has power: draws from a different (tempered) distribution are rejected
    assert _chi2_p(counts, _next_token_probs(s, prompt, 0.5)) < 0.001


def test_top_k_one_is_greedy(samplers):
    s = samplers("gemma2")
    prompts = _prompts(3)
    greedy = s.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    topk = s.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.3, top_k=1), key=jax.random.key(5))
    np.testing.assert_array_equal(greedy.tokens, topk.tokens)


def test_top_p_keeps_exactly_the_nucleus():
    probs = np.array([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]], np.float32)
    logits = jnp.log(jnp.asarray(probs))
    kept = np.asarray(truncate(logits, 0, 0.7)) > -1e30
    # row 0: 0.5 alone < 0.7, 0.5 + 0.3 >= 0.7 -> {1, 3}; row 1: three equal tokens reach 0.75
    np.testing.assert_array_equal(kept[0], [False, True, False, True])
    assert kept[1].sum() == 3
    kept = np.asarray(truncate(logits, 0, 0.85)) > -1e30
    np.testing.assert_array_equal(kept[0], [False, True, True, True])
    kept = np.asarray(truncate(logits, 2, 1.0)) > -1e30
    np.testing.assert_array_equal(kept[0], [False, True, False, True])


def test_top_p_draws_follow_renormalised_nucleus(samplers):
    s = samplers("llama")
    prompt = _prompts(4, (5,))[0]
    probs = _next_token_probs(s, prompt)
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = order[before < 0.5]
    out = s.generate([prompt], SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.5, n=20_000),
                     key=jax.random.key(11))
    counts = np.bincount(out.tokens[:, 0], minlength=97).astype(np.float64)
    assert set(np.nonzero(counts)[0]) <= set(nucleus.tolist())
    target = np.zeros_like(probs)
    target[nucleus] = probs[nucleus] / probs[nucleus].sum()
    assert _chi2_p(counts, target) > 0.001


def test_same_bucket_does_not_recompile_and_groups_prefill_once(samplers):
    s = samplers("mistral")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4)
    s.generate(_prompts(5, (9, 11)), params)  # warm-up: lengths 9..16 share bucket 16
    before = dict(s.traces)
    rows = s.prefill_rows
    out = s.generate(_prompts(6, (3, 16)), params, key=jax.random.key(1))
    assert dict(s.traces) == before  # no new trace of prefill or decode
    assert s.prefill_rows - rows == 2  # two prompts prefilled once each, not 2 x 4 times
    assert out.tokens.shape == (8, 8) and list(out.prompt_index) == [0, 0, 0, 0, 1, 1, 1, 1]
    s.generate(_prompts(7, (17,)), params)  # a longer bucket compiles once more
    assert s.traces["prefill"] == before["prefill"] + 1


def test_stop_tokens_and_per_row_limits(samplers):
    s = samplers("llama")
    prompts = _prompts(8)
    free = s.generate(prompts, SamplingParams(max_new_tokens=70, temperature=0.0))
    stop_tok = int(free.tokens[0, 4])  # row 0's fifth token becomes its stop token
    first = int(np.argmax(free.tokens[0] == stop_tok))
    out = s.generate(prompts, SamplingParams(max_new_tokens=70, temperature=0.0),
                     stop_ids=[[stop_tok], [], []], max_new_tokens=[70, 7, 70])
    assert out.lengths[0] == first + 1 and out.finish_reasons[0] == "stop"
    np.testing.assert_array_equal(out.tokens[0, :first + 1], free.tokens[0, :first + 1])
    assert (out.tokens[0, first + 1:] == 0).all() and (out.logprobs[0, first + 1:] == 0).all()
    assert out.lengths[1] == 7 and out.finish_reasons[1] == "length"
    np.testing.assert_array_equal(out.tokens[1, :7], free.tokens[1, :7])
    np.testing.assert_array_equal(out.tokens[2], free.tokens[2])
    short = s.generate(prompts, SamplingParams(max_new_tokens=70, temperature=0.0), max_new_tokens=[3, 3, 3])
    assert (short.lengths == 3).all()  # every row done in the first cache phase: later phases run no step
    np.testing.assert_array_equal(short.tokens[:, :3], free.tokens[:, :3])
    assert (short.tokens[:, 3:] == 0).all()
    one = s.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0))  # the prefill's token only
    assert one.tokens.shape == (3, 1) and (one.lengths == 1).all()
    np.testing.assert_array_equal(one.tokens[:, 0], free.tokens[:, 0])
    np.testing.assert_allclose(one.logprobs[:, 0], free.logprobs[:, 0], atol=1e-6)


def test_same_key_same_samples(samplers):
    s = samplers("llama")
    p = SamplingParams(max_new_tokens=6, temperature=1.0, n=3)
    a = s.generate(_prompts(9), p, key=jax.random.key(42))
    b = s.generate(_prompts(9), p, key=jax.random.key(42))
    c = s.generate(_prompts(9), p, key=jax.random.key(43))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()


@pytest.mark.parametrize("bad", [
    dict(prompts=[[]], match="prompt 0 is empty"),
    dict(prompts=[list(range(3, 100))], params=dict(max_new_tokens=40), match="exceeds the cache limit"),
    dict(params=dict(max_new_tokens=0), match="max_new_tokens must be > 0"),
    dict(params=dict(top_p=0.0), match="top_p must be in"),
    dict(params=dict(top_p=1.5), match="top_p must be in"),
])
def test_bad_input(samplers, bad):
    s = samplers("llama")
    with pytest.raises(PosttrainError, match=bad["match"]):
        s.generate(bad.get("prompts", [[5, 6]]), SamplingParams(**bad.get("params", {})))


def test_phase_sizes_aligned_for_a_tpu(monkeypatch, hf_checkpoints):
    """On a TPU each decode phase's cache is a whole number of 32-slot tiles (an unaligned one made XLA copy the
    cache inside the phase); sizes that round alike merge. The aligned phases hold more empty slots, which attention
    masks: the tokens are the unaligned run's and the log-probs agree to round-off."""
    from posttrain.generate import shapes

    assert shapes.phase_sizes(128, 512, align=1) == [256, 384, 512, 639]
    assert shapes.phase_sizes(128, 512, align=32) == [256, 384, 512, 640]
    assert shapes.phase_sizes(128, 480, align=32) == [256, 384, 512, 608]
    assert shapes.phase_sizes(100, 70, align=32) == [160, 192]  # 135, 169 rounded
    assert shapes.phase_sizes(16, 100, align=128) == [128]  # 49, 82, 115: one phase
    assert shapes.phase_sizes(16, 2, align=32) == [32]
    assert shapes.phase_align("tpu") == 32 and shapes.phase_align("cpu") == 1
    prompts, params = _prompts(4), SamplingParams(max_new_tokens=100, temperature=0.0)
    plain = Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=128).generate(prompts, params)
    monkeypatch.setattr(shapes, "phase_align", lambda backend=None: 32)
    assert phase_sizes(16, 100) == [64, 96, 128]  # against 49, 82, 115 unaligned
    aligned = Sampler(from_pretrained(hf_checkpoints["llama"]), max_len=128).generate(prompts, params)
    np.testing.assert_array_equal(aligned.tokens, plain.tokens)
    np.testing.assert_allclose(aligned.logprobs, plain.logprobs, atol=1e-5)
