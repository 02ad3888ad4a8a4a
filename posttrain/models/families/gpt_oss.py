"""GPT-OSS (`gpt_oss`): alternating sliding / full attention with biases on q/k/v/o (`attention_bias`) and a
learned sink logit per query head, YaRN RoPE, and a routed block of biased experts on every layer (softmax over
the top-k router logits, the clamped gate * sigmoid(1.702 gate) * (up + 1) activation). On disk the experts are
fused (`mlp.experts.gate_up_proj` [E, D, 2F] with gate and up interleaved). Per transformers 5.12's GptOssConfig
and modeling_gpt_oss.py. A family module: records for `models/family.py`'s table."""

from __future__ import annotations

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.family import Family, no_router_jitter, register_family, sliding_layer_types


def _post_init(d: dict) -> None:
    if d.get("layer_types") is None:
        d["layer_types"] = sliding_layer_types(d["num_hidden_layers"], 2)
    if d.get("rope_parameters") is None:
        d["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}


def _fields(hf, where: str) -> dict:
    """Biases where attention_bias says; experts on every layer, renormalised top-k (softmax over the top k)."""
    no_router_jitter(hf, where)
    bias = bool(hf.attention_bias)
    return dict(qkv_bias=bias, o_bias=bias, num_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                expert_mlp_dim=hf.intermediate_size, norm_topk_prob=True, router_bias=True, expert_bias=True,
                expert_act="gpt_oss", router_aux_loss_coef=float(hf.router_aux_loss_coef))


def _to_hf(cfg: ModelConfig, d: dict) -> None:
    if cfg.dense_layers or not cfg.norm_topk_prob or not cfg.num_experts or cfg.expert_act != "gpt_oss":
        raise PosttrainError("cannot export as gpt_oss: GPT-OSS has biased experts with its clamped activation "
                             "on every layer and renormalised top-k weights")
    d.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
             intermediate_size=cfg.expert_mlp_dim, router_aux_loss_coef=cfg.router_aux_loss_coef,
             attention_bias=cfg.qkv_bias)


def _experts(m: dict, cfg: ModelConfig, i: int, p: str) -> None:
    """On disk: `mlp.router.{weight [E, D], bias [E]}`, `mlp.experts.gate_up_proj` [E, D, 2F] with gate and up
    interleaved (gate the even columns), `gate_up_proj_bias` [E, 2F], `down_proj` [E, F, D], `down_proj_bias`
    [E, D]."""
    E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_mlp_dim
    b, L = p + "mlp.", ("layers", i, "mlp")
    m[L + ("router",)] = ([b + "router.weight"], lambda w: w.T, lambda w: [w.T])
    m[L + ("router_bias",)] = ([b + "router.bias"], lambda w: w, lambda w: [w])
    m[L + ("expert_gate_up",)] = ([b + "experts.gate_up_proj"], lambda w: w.reshape(E, D, F, 2).transpose(0, 1, 3, 2),
                                  lambda w: [w.transpose(0, 1, 3, 2).reshape(E, D, 2 * F)])
    m[L + ("expert_gate_up_bias",)] = ([b + "experts.gate_up_proj_bias"],
                                       lambda w: w.reshape(E, F, 2).transpose(0, 2, 1),
                                       lambda w: [w.transpose(0, 2, 1).reshape(E, 2 * F)])
    m[L + ("expert_down",)] = ([b + "experts.down_proj"], lambda w: w, lambda w: [w])
    m[L + ("expert_down_bias",)] = ([b + "experts.down_proj_bias"], lambda w: w, lambda w: [w])


GPT_OSS = register_family(Family(
    name="gpt_oss", model_type="gpt_oss", architecture="GptOssForCausalLM",
    defaults=dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, head_dim=64,
                  num_attention_heads=64, num_key_value_heads=8, sliding_window=128, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, num_experts_per_tok=4, num_local_experts=128, router_aux_loss_coef=0.001,
                  attention_bias=True),
    aliases={"num_experts": "num_local_experts"}, default_theta=150_000.0, post_init=_post_init,
    fields=dict(attn_sinks=True), config_fields=_fields, config_to_hf=_to_hf, attention_bias=True, moe=True,
    expert_names=_experts))
