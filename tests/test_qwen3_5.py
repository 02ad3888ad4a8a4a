"""Qwen3.5 text (Gated DeltaNet layers beside gated full attention, partial RoPE, (1 + w) norms) against Hugging Face
transformers, on tiny random checkpoints built locally with `save_pretrained` (norms and embeddings drawn large
enough that each one matters)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from posttrain.generate import Sampler, SamplingParams
from posttrain.models import from_pretrained, save_pretrained

V = 97
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build(tmp_path_factory, "qwen3_5_text", CONFIG)


def build(tmp_path_factory, model_type: str, config: dict) -> str:
    """A tiny random transformers checkpoint of `model_type`, saved; its vectors drawn away from their init so each
    one matters (routers and the shared-expert gate of an MoE too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name or name.endswith(("mlp.gate.weight",
                                                                         "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
            elif "dt_bias" in name:
                p.add_(0.5 * torch.randn_like(p))
            elif "A_log" in name:  # mild decay (HF draws A up to 16: the state would be forgotten at once)
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())
    path = os.fspath(tmp_path_factory.mktemp(model_type) / "hf")
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
    toks = np.random.default_rng(seed).integers(3, V, (3, T))
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.int64)
    return toks, mask, np.broadcast_to(np.arange(T), (3, T)).copy(), lens


def _diff(a, b, lens):
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(lens))


def logits_error(ckpt, T, seed):
    """max |our logits - transformers'| over the real tokens of a right-padded batch of length T (printed with
    the logit range)."""
    toks, mask, pos, lens = _batch(T, seed=seed)
    want = _hf_logits(_hf(ckpt), toks, mask, pos)
    got = np.asarray(_fwd(from_pretrained(ckpt), jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask)))
    err = _diff(got, want, lens)
    print(f"T={T}: max |logits - transformers| {err:.2e} (range {want.max() - want.min():.1f})")
    return err


def export_error(ckpt, out):
    """max |transformers' logits of our export of ckpt - of ckpt itself|, 40 right-padded tokens."""
    save_pretrained(from_pretrained(ckpt), out)
    toks, mask, pos, lens = _batch(40, seed=1)
    return _diff(_hf_logits(_hf(out), toks, mask, pos), _hf_logits(_hf(ckpt), toks, mask, pos), lens)


def check_packed_and_greedy(ckpt):
    """Two sequences packed in one row equal transformers on each alone; greedy 24 tokens from left-padded prompts
    equal a cache-free transformers loop (full forwards)."""
    r = np.random.default_rng(3)
    a, b = (r.integers(3, V, n).tolist() for n in (70, 30))
    toks, seg = np.array([a + b]), np.array([[1] * 70 + [2] * 30])
    pos = np.array([list(range(70)) + list(range(30))])
    ours = from_pretrained(ckpt)
    out = np.asarray(_fwd(ours, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(seg)))[0]
    hf = _hf(ckpt)
    for s, start in ((a, 0), (b, 70)):
        ref = _hf_logits(hf, np.array([s]), np.ones((1, len(s)), np.int64), np.arange(len(s))[None])[0]
        assert float(np.abs(out[start:start + len(s)] - ref).max()) <= 1e-4
    prompts = [r.integers(3, V, n).tolist() for n in (9, 4)]
    gen = Sampler(ours, max_len=64).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(24):
            n = len(seq)
            seq.append(int(_hf_logits(hf, np.array([seq]), np.ones((1, n), np.int64), np.arange(n)[None])[0, -1]
                           .argmax()))
        np.testing.assert_array_equal(gen.tokens[i], seq[len(p):])


@pytest.mark.parity
def test_config_reads_every_qwen3_5_field(ckpt):
    cfg = from_pretrained(ckpt).cfg
    assert cfg.family == "qwen3_5" and cfg.layer_types == ("linear", "linear", "linear", "full")
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim) == (2, 4, 8, 8)
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.norm_unit_offset and cfg.linear_conv_kernel == 4
    assert cfg.rope.kind == "default" and cfg.rope.partial == 0.25


@pytest.mark.parity
@pytest.mark.parametrize("T", [11, 150])  # 150: more than two 64-token chunks of the delta rule
def test_logits_match_transformers_with_right_padding(ckpt, T):
    toks, mask, pos, lens = _batch(T)
    ref = _hf_logits(_hf(ckpt), toks, mask, pos)
    out = np.asarray(_fwd(from_pretrained(ckpt), jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask)))
    assert float(ref.max() - ref.min()) > 5  # logits that vary, so a 1e-4 match means something
    assert _diff(out, ref, lens) <= 1e-4


@pytest.mark.parity
def test_packed_segments_equal_separate_rows(ckpt):
    """Three sequences in one row (the second starts inside a 64-token chunk, the third right after a padding
    gap): each equals transformers on the sequence alone, so no state or convolution input crosses a boundary."""
    r = np.random.default_rng(3)
    a, b, c = (r.integers(3, V, n).tolist() for n in (70, 50, 9))
    toks = np.array([a + b + [0] * 3 + c + [0] * 5])
    seg = np.array([[1] * 70 + [2] * 50 + [0] * 3 + [3] * 9 + [0] * 5])
    pos = np.array([list(range(70)) + list(range(50)) + [0] * 3 + list(range(9)) + [0] * 5])
    out = np.asarray(_fwd(from_pretrained(ckpt), jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(seg)))[0]
    hf = _hf(ckpt)
    for s, start in ((a, 0), (b, 70), (c, 123)):
        ref = _hf_logits(hf, np.array([s]), np.ones((1, len(s)), np.int64), np.arange(len(s))[None])[0]
        assert float(np.abs(out[start:start + len(s)] - ref).max()) <= 1e-4


@pytest.mark.parity
def test_greedy_24_tokens_equal_a_cache_free_transformers_loop(ckpt):
    """The sampler carries each linear layer's state (conv inputs, delta-rule state) beside the KV cache of the
    full-attention layer; left-padded prompts of different lengths."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, V, n).tolist() for n in (9, 4, 13)]
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


@pytest.mark.parametrize("chunk", [64, 8])  # 8: branches start inside chunks, several in one chunk
def test_prefix_shared_rows_equal_unshared_rows_logps_and_gradients(ckpt, chunk, monkeypatch):
    """Per-token log-probs and the weight gradients of a DPO / GRPO shaped objective: a prefix-shared row
    [prompt | c1 | c2 | c3] against three unshared rows, <= 1e-5: every branch of a linear layer starts from the
    prompt's state and convolution inputs, never a sibling's."""
    from flax import nnx
    from test_branches import _groups, _shared_batch, _unshared_batch

    from posttrain.losses.logps import branch_logps
    from posttrain.models import deltanet

    monkeypatch.setattr(deltanet, "CHUNK", chunk)
    graphdef, params = nnx.split(from_pretrained(ckpt))
    groups = _groups(1)
    shared, unshared = _shared_batch(groups), _unshared_batch(groups)
    # the reference rows [prompt | ci] without branch ids: the linear layers' plain path, not the branched one
    unshared = dict(unshared, branch_ids=jnp.zeros_like(unshared["branch_ids"]))
    n_tokens = sum(len(c) for _, conts in groups for c in conts)
    coef = jnp.asarray([[1.0, -0.5, 2.0], [0.3, 1.5, -1.0]]) / n_tokens

    def objective(p, batch, k):  # (the weighted sum of the branches' log-probs, the per-token log-probs)
        tok, sums, _ = branch_logps(nnx.merge(graphdef, p), batch, k)
        return jnp.sum(sums * coef if k == 3 else sums[:, 0] * coef.reshape(-1)), tok

    # one compiled forward + backward per layout gives both the log-probs and the gradients (two programs where
    # four were compiled: the log-probs' own forward, then the gradient's)
    grad = jax.jit(jax.grad(objective, has_aux=True), static_argnums=2)
    (g_s, tok_s), (g_u, tok_u) = grad(params, shared, 3), grad(params, unshared, 1)
    for g, (_, conts) in enumerate(groups):
        off = 0
        for i, c in enumerate(conts):
            np.testing.assert_allclose(np.asarray(tok_s)[g, off:off + len(c)], np.asarray(tok_u)[g * 3 + i, :len(c)],
                                       atol=1e-5, rtol=0)
            off += len(c)
    flat_s, flat_u = dict(nnx.to_flat_state(g_s)), dict(nnx.to_flat_state(g_u))
    linear = [k for k in flat_s if "linear" in k]
    assert linear and all(float(jnp.abs(flat_s[k][...]).max()) > 1e-4 for k in linear)  # every linear part learns
    for k in flat_s:
        np.testing.assert_allclose(np.asarray(flat_s[k][...]), np.asarray(flat_u[k][...]), atol=1e-5, rtol=0,
                                   err_msg=str(k))


def test_sampler_logprobs_equal_the_trainer_forward(ckpt):
    """Sampled at temperature 1 (n = 2, group prefill: the prompt's linear states repeated), 70 tokens each (past a
    64-token chunk): the sampler's log-probs equal log_softmax of one training forward over the same tokens,
    <= 1e-5 (what RL relies on)."""
    from flax import nnx

    sampler = Sampler(from_pretrained(ckpt), max_len=128)
    prompts = [np.random.default_rng(5).integers(3, V, n).tolist() for n in (9, 13)]
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=70, temperature=1.0, n=2), key=jax.random.key(3))
    forward = jax.jit(lambda st, x: nnx.merge(sampler.graphdef, st)(x, jnp.arange(x.shape[1])[None]).logits[0])
    for r in range(len(out.lengths)):
        p = prompts[out.prompt_index[r]]
        seq = np.array(p + out.tokens[r].tolist())
        logp = jax.nn.log_softmax(forward(sampler.state, jnp.asarray(seq[None])), axis=-1)
        ref = np.asarray(logp[len(p) - 1:-1][np.arange(70), out.tokens[r]])
        np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-5, rtol=0)


def test_stop_sequence_then_extend_continues_exactly(ckpt):
    """Greedy: a row stops at a stop sequence, then `extend` with nothing appended samples exactly what the
    uninterrupted decode sampled: a stopped row's padding never entered its linear states, and the stop token is
    fed again as the attention slots are."""
    sampler = Sampler(from_pretrained(ckpt), max_len=64)
    ids = [np.random.default_rng(7).integers(3, V, n).tolist() for n in (9, 5)]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    never = [[10**6, 10**6]]
    ref, _ = sampler.begin(ids, greedy, stop_sequences=never)
    seq = ref.tokens[0, 3:5].tolist()
    first, turn = sampler.begin(ids, greedy, stop_sequences=[seq])
    L = int(first.lengths[0])
    assert L <= 5 and first.finish_reasons[0] == "stop" and first.tokens[0, L - 2:L].tolist() == seq
    again, _ = sampler.extend(turn, [0], [[]], greedy, max_new_tokens=[16 - L], stop_sequences=never)
    np.testing.assert_array_equal(again.tokens[0, :16 - L], ref.tokens[0, L:])
    np.testing.assert_allclose(again.logprobs[0, :16 - L], ref.logprobs[0, L:], atol=1e-5, rtol=0)


def test_lora_on_linear_layers_targets_by_name_and_merges_exactly(ckpt):
    """LoRA's default targets adapt the Gated DeltaNet projections too; a projection's name matches that
    projection only ('o' adapts attention's o, not `down` or `out_proj`); with random adapters the adapted
    forward equals the merged model's (<= 1e-5 of the logits' range) and differs from the base."""
    from flax import nnx

    from posttrain.config import LoraSection
    from posttrain.models.lora import Lora, LoraParam, apply_lora, merge_lora

    def adapted(model):
        return sorted(".".join(map(str, p)) for p, m in nnx.iter_graph(model) if isinstance(m, Lora))

    only_o = adapted(apply_lora(from_pretrained(ckpt), targets=("o",)))
    assert only_o and all(p.endswith(".o_lora") for p in only_o)
    model = apply_lora(from_pretrained(ckpt), rank=4, targets=LoraSection().targets)
    names = {p.rsplit(".", 1)[1] for p in adapted(model)}
    assert {"in_proj_qkv_lora", "in_proj_z_lora", "in_proj_b_lora", "in_proj_a_lora", "out_proj_lora"} <= names
    x = jnp.asarray(np.random.default_rng(2).integers(3, V, (2, 40)))
    pos = jnp.broadcast_to(jnp.arange(40), x.shape)
    base = np.asarray(_fwd(model, x, pos, None))
    graphdef, lora, rest = nnx.split(model, LoraParam, ...)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(lora))))
    lora = jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape), lora)
    model = nnx.merge(graphdef, lora, rest)
    got = np.asarray(_fwd(model, x, pos, None))
    assert np.abs(got - base).max() > 1e-2
    err = np.abs(np.asarray(_fwd(merge_lora(model), x, pos, None)) - got).max()
    assert err <= 1e-5 * (got.max() - got.min()), (err, got.max() - got.min())
