"""Qwen3.5-MoE text (qwen3_5_moe_text: the Qwen3.5 hybrid with a sparse block on every layer, a shared expert gated
per token beside the routed experts) against Hugging Face transformers, on a tiny random checkpoint built locally."""

import pytest
from test_qwen3_5 import build, check_packed_and_greedy, export_error, logits_error

from posttrain.models import from_pretrained

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
    assert logits_error(ckpt, T, seed=T) <= 1e-4


@pytest.mark.parity
def test_export_round_trip_loads_in_transformers(ckpt, tmp_path):
    assert export_error(ckpt, str(tmp_path / "out")) <= 1e-5


@pytest.mark.parity
def test_packed_segments_and_greedy_24_tokens_equal_transformers(ckpt):
    check_packed_and_greedy(ckpt)


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
