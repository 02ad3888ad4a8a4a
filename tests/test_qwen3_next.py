"""Qwen3-Next (qwen3_next: the hybrid with fused, key-head-interleaved in_proj_qkvz / in_proj_ba on disk, dense
layers beside sparse ones, top-k weights renormalised or not) against Hugging Face transformers, on a tiny random
checkpoint built locally."""

import json

import jax
import numpy as np
import pytest
from test_qwen3_5 import (
    _batch,
    _diff,
    _fwd,
    _hf,
    _hf_logits,
    build,
    check_packed_and_greedy,
    export_error,
    logits_error,
)

from posttrain.models import from_pretrained

V = 97
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=56, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
              mlp_only_layers=[1], norm_topk_prob=False, max_position_embeddings=512, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build(tmp_path_factory, "qwen3_next", CONFIG)


def test_config_reads_the_next_fields(ckpt):
    cfg = from_pretrained(ckpt).cfg
    assert (cfg.family, cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim, cfg.shared_expert_dim,
            cfg.mlp_dim, cfg.dense_layers, cfg.norm_topk_prob) == ("qwen3_next", 8, 2, 24, 40, 56, (1,), False)
    assert cfg.layer_types == ("linear", "linear", "linear", "full")
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim) == (2, 6, 8, 12)


def test_fused_projections_split_and_join_back_exactly():
    """The on-disk qkvz / ba layout <-> Qwen3.5's separate projections: value head h (of r = 3 per key head) gets
    rows from key-head group h // 3, and join(split(w)) = w."""
    from posttrain.models.config import ModelConfig
    from posttrain.models.families.qwen3_5 import fused_names

    cfg = ModelConfig(family="qwen3_next", vocab_size=V, embed_dim=5, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=4, mlp_dim=8, layer_types=("linear",), linear_key_heads=2, linear_value_heads=6,
                      linear_key_dim=2, linear_value_dim=3, norm_unit_offset=True, attn_output_gate=True)
    (k1, (_, split1, join1)), (k2, (_, split2, join2)) = fused_names(cfg).items()
    assert k1.endswith("in_proj_qkvz.weight") and k2.endswith("in_proj_ba.weight")
    per_group = 2 + 2 + 3 * 3 + 3 * 3  # q, k, then v and z of three value heads
    w = np.arange(2 * per_group)[:, None] * 10 + np.arange(5)[None]  # row id * 10 + column
    qkv, z = split1(w)
    rows = lambda a: (a[:, 0] // 10).tolist()  # noqa: E731
    assert rows(qkv) == [0, 1, 22, 23, 2, 3, 24, 25] + list(range(4, 13)) + list(range(26, 35))
    assert rows(z) == list(range(13, 22)) + list(range(35, 44))
    np.testing.assert_array_equal(join1(qkv, z), w)
    ba = np.arange(12)[:, None] * np.ones((1, 5), int)
    b, a = split2(ba)
    assert b[:, 0].tolist() == [0, 1, 2, 6, 7, 8] and a[:, 0].tolist() == [3, 4, 5, 9, 10, 11]
    np.testing.assert_array_equal(join2(b, a), ba)


@pytest.mark.parity
@pytest.mark.parametrize("T", [11, 150])  # 150: more than two 64-token chunks of the delta rule
def test_logits_match_transformers_with_right_padding(ckpt, T):
    assert logits_error(ckpt, T, seed=T) <= 1e-4


@pytest.mark.parity
def test_export_round_trip_loads_in_transformers(ckpt, tmp_path):
    assert export_error(ckpt, str(tmp_path / "out")) <= 1e-5
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert (written["model_type"], written["mlp_only_layers"], written["norm_topk_prob"]) == ("qwen3_next", [1],
                                                                                            False)


@pytest.mark.parity
def test_packed_segments_and_greedy_24_tokens_equal_transformers(ckpt):
    check_packed_and_greedy(ckpt)


@pytest.mark.parametrize("name,model_type,billions", [("qwen3-next-80b-a3b", "qwen3_next", 79.7),
                                                       ("qwen3.5-9b", "qwen3_5_text", 8.95),
                                                       ("qwen3.5-27b", "qwen3_5_text", 26.9)])
def test_presets_count_like_transformers(name, model_type, billions):
    """Each preset's parameters (eval_shape) = transformers' model of its exported config on the meta device;
    qwen3-next-80b-a3b and qwen3.5-9b are transformers' default configs of their classes. (qwen3.5-27b's 26.9 B
    text parameters + its vision tower and MTP layer, about 0.9 B, give the 27.8 B its bfloat16 shards hold.)"""
    import torch
    from flax import nnx
    from test_gemma4 import _OneKey
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models import Transformer, count_params, preset
    from posttrain.models.hf_config import HFConfig, config_from_hf, config_to_hf

    if name != "qwen3.5-27b":
        assert preset(name) == config_from_hf(HFConfig({"model_type": model_type}))
    n = count_params(nnx.eval_shape(lambda: Transformer(preset(name), rngs=_OneKey())))
    hf_cfg = config_to_hf(preset(name))
    assert hf_cfg["model_type"] == model_type
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg))
    assert n == sum(p.numel() for p in ref.parameters())
    assert abs(n / 1e9 - billions) < 0.05


@pytest.mark.parity
@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1000.0}])  # legacy: 0.25 by default
def test_scaled_rope_keeps_the_partial_rotary_factor(tmp_path_factory, rope):
    """YaRN / linear RoPE on a Qwen3-Next model rotate the first quarter of each head as transformers does (the
    partial factor was dropped for scaled kinds: the whole head rotated)."""
    path = build(tmp_path_factory, "qwen3_next", dict(CONFIG, **rope))
    ours = from_pretrained(path)
    assert ours.cfg.rope.partial == 0.25 and ours.cfg.rope.kind == rope.get("rope_parameters",
                                                                           rope.get("rope_scaling"))["rope_type"]
    toks, mask, pos, lens = _batch(80, seed=5)
    want = _hf_logits(_hf(path), toks, mask, pos)
    got = np.asarray(_fwd(ours, jax.numpy.asarray(toks), jax.numpy.asarray(pos), jax.numpy.asarray(mask)))
    assert _diff(got, want, lens) <= 1e-4


def test_a_sparse_layer_without_a_shared_expert_is_an_error_naming_the_key(tmp_path):

    from posttrain.errors import PosttrainError
    from posttrain.models.hf import load_config

    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen3_next", num_hidden_layers=4,
                                                          shared_expert_intermediate_size=0)))
    with pytest.raises(PosttrainError, match="shared_expert_intermediate_size = 0"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("field,value", [("linear_value_head_dim", 10), ("linear_num_key_heads", 3)])
def test_fused_tensors_that_do_not_match_config_json_are_an_error(ckpt, tmp_path, field, value):
    """A config.json whose linear heads do not split the fused tensors: a PosttrainError naming a tensor, not a
    numpy reshape error or a silently wrong model."""
    import shutil

    from posttrain.errors import PosttrainError

    folder = tmp_path / "bad"
    shutil.copytree(ckpt, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PosttrainError, match="in_proj_qkvz|in_proj_ba|tensor shape mismatch"):
        from_pretrained(str(folder))
