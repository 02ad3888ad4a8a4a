"""Qwen2 / Qwen2.5 (`qwen2`: q/k/v biases), Qwen3 (`qwen3`: q and k RMSNorms per head) and Qwen3-MoE
(`qwen3_moe`: Qwen3 with a routed block of experts, softmax router, optionally renormalised top-k, dense layers
where `mlp_only_layers` / `decoder_sparse_step` say). Sliding windows only with `use_sliding_window` (Qwen2 /
Qwen3: the layers from `max_window_layers` on slide; Qwen3-MoE: every layer). Per transformers 5.12's
Qwen2Config, Qwen3Config, Qwen3MoeConfig and their modeling files. A family module: records for
`models/family.py`'s table."""

from __future__ import annotations

from posttrain.models.config import ModelConfig
from posttrain.models.family import Family, no_router_jitter, register_family


def _windows(d: dict) -> None:
    """Qwen's config classes drop sliding_window unless use_sliding_window."""
    d["sliding_window"] = d.get("sliding_window") if d.get("use_sliding_window") else None


def _dense_post_init(d: dict) -> None:
    """Qwen2Config / Qwen3Config: the layers from max_window_layers on slide (with use_sliding_window)."""
    _windows(d)
    if d.get("layer_types") is None:
        d["layer_types"] = ["sliding_attention" if d["sliding_window"] is not None and i >= d["max_window_layers"]
                            else "full_attention" for i in range(d["num_hidden_layers"])]


QWEN2 = register_family(Family(
    name="qwen2", model_type="qwen2", architecture="Qwen2ForCausalLM", classifier="Qwen2ForSequenceClassification",
    defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    post_init=_dense_post_init, fields=dict(qkv_bias=True), attention_bias=True, use_sliding_window=True,
    layer_types_always=True))

QWEN3 = register_family(Family(
    name="qwen3", model_type="qwen3", architecture="Qwen3ForCausalLM", classifier="Qwen3ForSequenceClassification",
    defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    post_init=_dense_post_init, fields=dict(qk_norm=True), use_sliding_window=True, layer_types_always=True))


def _moe_post_init(d: dict) -> None:
    _windows(d)
    if d.get("mlp_only_layers") is None:
        d["mlp_only_layers"] = []


def _moe_fields(hf, where: str) -> dict:
    """Experts on the layers not in mlp_only_layers and every decoder_sparse_step-th; none at all: a Qwen3."""
    no_router_jitter(hf, where)
    L, E, step = hf.num_hidden_layers, hf.num_experts, hf.decoder_sparse_step or 1
    only = set(hf.mlp_only_layers or ())
    if E <= 0:
        return {}  # every layer dense: a plain Qwen3-style model
    dense = tuple(i for i in range(L) if i in only or (i + 1) % step != 0)
    return dict(num_experts=E, experts_per_token=hf.num_experts_per_tok, expert_mlp_dim=hf.moe_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob), dense_layers=dense,
                router_aux_loss_coef=float(hf.router_aux_loss_coef))


def _moe_to_hf(cfg: ModelConfig, d: dict) -> None:
    d.update(num_experts=cfg.num_experts, num_experts_per_tok=max(cfg.experts_per_token, 1),
             moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
             decoder_sparse_step=1, mlp_only_layers=sorted(cfg.dense_layers),
             router_aux_loss_coef=cfg.router_aux_loss_coef)


QWEN3_MOE = register_family(Family(
    name="qwen3_moe", model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    classifier="Qwen3MoeForSequenceClassification",
    defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
                  num_experts_per_tok=8, num_local_experts=128, norm_topk_prob=False, router_aux_loss_coef=0.001,
                  mlp_only_layers=None),
    aliases={"num_experts": "num_local_experts"}, post_init=_moe_post_init, fields=dict(qk_norm=True),
    config_fields=_moe_fields, config_to_hf=_moe_to_hf, use_sliding_window=True, window_everywhere=True, moe=True))
