"""Llama (`llama`), Mistral (`mistral`) and Mixtral (`mixtral`): the plain pre-norm decoder with SwiGLU, RMSNorm
(w), GQA and RoPE (Llama 3's llama3 scaling, linear); Mistral slides every layer's window (`sliding_window`);
Mixtral is Mistral with a routed block of experts on every layer (softmax router, renormalised top-k;
`block_sparse_moe.experts.<e>.w1 / w3 / w2` on disk). Per transformers 5.12's LlamaConfig, MistralConfig and
MixtralConfig (defaults) and their modeling files. A family module: records for `models/family.py`'s table."""

from __future__ import annotations

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.family import Family, no_router_jitter, register_family, routed_expert_names


def _head_dim(d: dict) -> None:
    """LlamaConfig / MistralConfig: head_dim defaults to hidden_size // num_attention_heads."""
    if d.get("head_dim") is None:
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]


LLAMA = register_family(Family(
    name="llama", model_type="llama", architecture="LlamaForCausalLM", classifier="LlamaForSequenceClassification",
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048),
    post_init=_head_dim))

MISTRAL = register_family(Family(
    name="mistral", model_type="mistral", architecture="MistralForCausalLM",
    classifier="MistralForSequenceClassification",
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096),
    post_init=_head_dim, window_everywhere=True))


def _mixtral_fields(hf, where: str) -> dict:
    no_router_jitter(hf, where)
    return dict(num_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                expert_mlp_dim=hf.intermediate_size, norm_topk_prob=True,
                router_aux_loss_coef=float(hf.router_aux_loss_coef))


def _mixtral_to_hf(cfg: ModelConfig, d: dict) -> None:
    if cfg.dense_layers or not cfg.norm_topk_prob or not cfg.num_experts:
        raise PosttrainError("cannot export as mixtral: Mixtral has experts on every layer (dense_layers = ()) "
                             "and renormalised top-k weights (norm_topk_prob = true)")
    d.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
             intermediate_size=cfg.expert_mlp_dim, router_aux_loss_coef=cfg.router_aux_loss_coef,
             router_jitter_noise=0.0)


def _mixtral_experts(m: dict, cfg: ModelConfig, i: int, p: str) -> None:
    routed_expert_names(m, cfg, i, p, block="block_sparse_moe.", names=("w1", "w3", "w2"))


MIXTRAL = register_family(Family(
    name="mixtral", model_type="mixtral", architecture="MixtralForCausalLM",
    classifier="MixtralForSequenceClassification",
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  num_experts_per_tok=2, num_local_experts=8, router_aux_loss_coef=0.001, router_jitter_noise=0.0),
    aliases={"num_experts": "num_local_experts"}, default_theta=1_000_000.0, window_everywhere=True, moe=True,
    config_fields=_mixtral_fields, config_to_hf=_mixtral_to_hf, expert_names=_mixtral_experts))
