"""Qwen3.5-MoE text (qwen3_5_moe_text: the Qwen3.5 hybrid with a sparse block on every layer, a shared expert gated
per token beside the routed experts) against Hugging Face transformers, on a tiny random checkpoint built locally."""

import jax
import numpy as np
import pytest
from test_qwen3_5 import _batch, _diff, _fwd, _hf, _hf_logits, build

from posttrain.models import from_pretrained, save_pretrained

V = 97
CONFIG = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=24, shared_expert_intermediate_size=40, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build(tmp_path_factory, "qwen3_5_moe_text", CONFIG)


def test_config_reads_the_moe_fields(ckpt):
    cfg = from_pretrained(ckpt).cfg
    assert (cfg.family, cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim, cfg.shared_expert_dim) == (
        "qwen3_5_moe", 8, 2, 24, 40)
    assert cfg.layer_types == ("linear", "linear", "linear", "full") and cfg.norm_topk_prob


@pytest.mark.parity
@pytest.mark.parametrize("T", [11, 150])  # 150: more than two 64-token chunks of the delta rule
def test_logits_match_transformers_with_right_padding(ckpt, T):
    hf, ours = _hf(ckpt), from_pretrained(ckpt)
    toks, mask, pos, lens = _batch(T, seed=T)
    want = _hf_logits(hf, toks, mask, pos)
    got = np.asarray(_fwd(ours, jax.numpy.asarray(toks), jax.numpy.asarray(pos), jax.numpy.asarray(mask)))
    err = _diff(got, want, lens)
    print(f"T={T}: max |logits - transformers| {err:.2e} (range {want.max() - want.min():.1f})")
    assert err <= 1e-4


@pytest.mark.parity
def test_export_round_trip_loads_in_transformers(ckpt, tmp_path):
    ours = from_pretrained(ckpt)
    save_pretrained(ours, str(tmp_path / "out"))
    toks, mask, pos, lens = _batch(40, seed=1)
    want = _hf_logits(_hf(ckpt), toks, mask, pos)
    got = _hf_logits(_hf(str(tmp_path / "out")), toks, mask, pos)
    assert _diff(got, want, lens) <= 1e-5


@pytest.mark.parity
def test_packed_segments_and_greedy_24_tokens_equal_transformers(ckpt):
    """Two sequences packed in one row equal transformers on each alone; greedy 24 tokens from left-padded prompts
    equal a cache-free transformers loop (full forwards)."""
    from posttrain.generate import Sampler, SamplingParams

    r = np.random.default_rng(3)
    a, b = (r.integers(3, V, n).tolist() for n in (70, 30))
    toks, seg = np.array([a + b]), np.array([[1] * 70 + [2] * 30])
    pos = np.array([list(range(70)) + list(range(30))])
    ours = from_pretrained(ckpt)
    out = np.asarray(_fwd(ours, jax.numpy.asarray(toks), jax.numpy.asarray(pos), jax.numpy.asarray(seg)))[0]
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


def test_preset_is_transformers_default_config_and_plans():
    """The `qwen3.5-35b-a3b` preset = transformers' Qwen3_5MoeTextConfig defaults read by posttrain; `posttrain
    plan` counts its parameters from the model itself (about 35 B, with the experts)."""
    from posttrain.models import preset
    from posttrain.models.hf_config import HFConfig, config_from_hf
    from posttrain.plan import plan

    assert preset("qwen3.5-35b-a3b") == config_from_hf(HFConfig({"model_type": "qwen3_5_moe_text"}))
    rows = plan(preset("qwen3.5-35b-a3b"), batch=1, seq_len=4096, mesh_shape={"fsdp": 8}, preset="fsdp")
    print(rows)
    assert 30e9 < rows["parameters"] * 8 / 4 < 40e9  # float32 bytes on 8 devices -> parameters
