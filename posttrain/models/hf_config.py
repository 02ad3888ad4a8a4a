"""Hugging Face config.json <-> ModelConfig: `config_from_hf` (the supported families, MoE and Gemma 4
fields, rope formats) and `config_to_hf` (what an export writes). Weights are in hf.py."""

from __future__ import annotations

from typing import Optional

from posttrain.errors import PosttrainError
from posttrain.models import gemma4
from posttrain.models.config import ModelConfig, RopeConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "gemma4_text", "qwen3_moe",
             "mixtral")
MOE = ("qwen3_moe", "mixtral")  # mixture-of-experts families (models/moe.py)

# ----------------------------------------------------------------------------- config


def _rope(d: Optional[dict], default_theta: float = 10_000.0) -> RopeConfig:
    d = dict(d or {})
    kind = d.get("rope_type", d.get("type", "default")) or "default"
    theta = d.get("rope_theta") or default_theta
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(d["factor"]))
    if kind == "llama3":
        return RopeConfig(theta=theta, kind="llama3", factor=float(d["factor"]),
                          low_freq_factor=float(d["low_freq_factor"]),
                          high_freq_factor=float(d["high_freq_factor"]),
                          original_max_position=int(d["original_max_position_embeddings"]))
    if kind == "proportional":  # Gemma 4 global layers
        return RopeConfig(theta=theta, kind="proportional", factor=float(d.get("factor", 1.0)),
                          partial=float(d.get("partial_rotary_factor", 1.0)))
    raise PosttrainError(f"config.json: rope type {kind!r} is not supported (default, linear, llama3, proportional "
                         "are)")


def config_from_hf(hf, where: str = "config.json") -> ModelConfig:
    """Translate a transformers config object into a ModelConfig."""
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED:
        raise PosttrainError(
            f"{where}: model_type {mt!r} is not supported; posttrain loads {', '.join(SUPPORTED)}. "
            "Convert the checkpoint to one of these architectures or open an issue.")
    if getattr(hf, "mlp_bias", False) or (mt != "qwen2" and getattr(hf, "attention_bias", False)):
        raise PosttrainError(f"{where}: attention_bias / mlp_bias = true is not supported; set them false")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rp = getattr(hf, "rope_parameters", None) or {}
    gemma = mt.startswith("gemma")
    kw = dict(
        family=mt.replace("_text", ""), vocab_size=hf.vocab_size, embed_dim=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
        mlp_dim=hf.intermediate_size, max_position=getattr(hf, "max_position_embeddings", 8192),
        norm_eps=hf.rms_norm_eps, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", gemma)),
    )
    if mt in ("gemma3_text", "gemma4_text"):
        kw["rope"] = _rope(rp.get("full_attention"))
        kw["rope_local"] = _rope(rp.get("sliding_attention"))
    else:
        kw["rope"] = _rope(rp)
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise PosttrainError(f"{where}: activation {act!r} is not supported (silu, gelu_pytorch_tanh are)")
    kw["activation"] = "silu" if act == "silu" else "gelu_tanh"
    if gemma:
        kw.update(norm_unit_offset=True, embed_scale=True)
    if mt in ("gemma2", "gemma3_text"):
        kw.update(sandwich_norm=True, query_scale=hf.query_pre_attn_scalar ** -0.5,
                  attn_softcap=getattr(hf, "attn_logit_softcapping", None),
                  final_softcap=getattr(hf, "final_logit_softcapping", None))
    kw["qkv_bias"] = mt == "qwen2"
    kw["qk_norm"] = mt in ("qwen3", "gemma3_text", "gemma4_text", "qwen3_moe")
    if mt in MOE:
        kw.update(_moe_from_hf(hf, mt, where))
    if mt == "gemma4_text":
        kw.update(gemma4.config_fields(hf, where))
    types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if types and "sliding_attention" in types:
        kw["layer_types"] = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        kw["sliding_window"] = window
    elif mt in ("mistral", "mixtral", "qwen3_moe") and window:
        kw["sliding_window"] = window  # every layer slides (Qwen3-MoE: only with use_sliding_window)
    return ModelConfig(**kw)


def _moe_from_hf(hf, mt: str, where: str) -> dict:
    """The mixture-of-experts fields of a qwen3_moe / mixtral config; unsupported options are errors."""
    L = hf.num_hidden_layers
    if getattr(hf, "router_jitter_noise", 0.0):  # multiplicative noise on the router input while training
        raise PosttrainError(f"{where}: router_jitter_noise = {hf.router_jitter_noise} is not supported; set it to 0")
    if mt == "mixtral":
        return dict(num_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                    expert_mlp_dim=hf.intermediate_size, norm_topk_prob=True,
                    router_aux_loss_coef=float(hf.router_aux_loss_coef))
    E, step = hf.num_experts, hf.decoder_sparse_step or 1
    only = set(hf.mlp_only_layers or ())
    if E <= 0:
        return {}  # every layer dense: a plain Qwen3-style model
    dense = tuple(i for i in range(L) if i in only or (i + 1) % step != 0)
    return dict(num_experts=E, experts_per_token=hf.num_experts_per_tok, expert_mlp_dim=hf.moe_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob), dense_layers=dense,
                router_aux_loss_coef=float(hf.router_aux_loss_coef))


def config_to_hf(cfg: ModelConfig, **extra) -> dict:
    """A transformers config dict (model_type + fields) for a ModelConfig."""
    mt = _text_type(cfg.family)
    if mt not in SUPPORTED:
        raise PosttrainError(f"cannot export family {cfg.family!r}; supported: {SUPPORTED}")
    only = [k for k in gemma4.GEMMA4_ONLY if mt != "gemma4_text" and getattr(cfg, k)]
    if only:
        raise PosttrainError(f"cannot export family {cfg.family!r} with {', '.join(only)} set: Gemma 4 fields")

    def rope(r: RopeConfig) -> dict:
        d = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "linear" or (r.kind == "proportional" and r.factor != 1.0):
            d["factor"] = r.factor
        if r.kind == "proportional":
            d["partial_rotary_factor"] = r.partial
        if r.kind == "llama3":
            d.update(factor=r.factor, low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                     original_max_position_embeddings=r.original_max_position)
        return d

    d = dict(model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim,
             num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim,
             max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_embeddings, architectures=[_ARCH[mt]],
             hidden_act="silu" if cfg.activation == "silu" else "gelu_pytorch_tanh")
    if mt.startswith("gemma"):
        d["hidden_activation"] = d["hidden_act"]
    if mt in ("gemma3_text", "gemma4_text"):
        d["rope_parameters"] = {"full_attention": rope(cfg.rope),
                                "sliding_attention": rope(cfg.rope_local or cfg.rope)}
    else:
        d["rope_parameters"] = rope(cfg.rope)
    if mt in ("gemma2", "gemma3_text"):
        scalar = (cfg.query_scale or cfg.head_dim ** -0.5) ** -2
        d.update(query_pre_attn_scalar=int(round(scalar)) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                 attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap)
    if mt == "gemma4_text":
        d.update(gemma4.config_to_hf(cfg))
    elif cfg.num_experts or mt in MOE:
        d.update(_moe_to_hf(cfg, mt))
    if cfg.sliding_window:
        d["sliding_window"] = cfg.sliding_window
        if mt in ("qwen2", "qwen3", "qwen3_moe"):
            d["use_sliding_window"] = True
    if cfg.layer_types or mt in ("qwen2", "qwen3", "gemma2", "gemma3_text", "gemma4_text"):
        d["layer_types"] = [("sliding_attention" if cfg.layer_type(i) == "sliding" else "full_attention")
                            for i in range(cfg.num_layers)]
    d["dtype"] = cfg.param_dtype
    d.update(extra)
    return d


def _moe_to_hf(cfg: ModelConfig, mt: str) -> dict:
    if mt not in MOE:
        raise PosttrainError(f"cannot export a mixture-of-experts model as family {cfg.family!r}; use "
                             f"{' or '.join(MOE)}")
    if mt == "mixtral":
        if cfg.dense_layers or not cfg.norm_topk_prob or not cfg.num_experts:
            raise PosttrainError("cannot export as mixtral: Mixtral has experts on every layer (dense_layers = ()) "
                                 "and renormalised top-k weights (norm_topk_prob = true)")
        return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                    intermediate_size=cfg.expert_mlp_dim, router_aux_loss_coef=cfg.router_aux_loss_coef,
                    router_jitter_noise=0.0)
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=max(cfg.experts_per_token, 1),
                moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
                decoder_sparse_step=1, mlp_only_layers=sorted(cfg.dense_layers),
                router_aux_loss_coef=cfg.router_aux_loss_coef)


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
         "gemma3_text": "Gemma3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "mixtral": "MixtralForCausalLM"}
# transformers' sequence-classification class of each family (gemma3_text: the text-only one).
_CLS_ARCH = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
             "qwen3": "Qwen3ForSequenceClassification", "mistral": "MistralForSequenceClassification",
             "gemma": "GemmaForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification",
             "gemma3_text": "Gemma3TextForSequenceClassification",
             "qwen3_moe": "Qwen3MoeForSequenceClassification", "mixtral": "MixtralForSequenceClassification"}


def _text_type(family: str) -> str:
    """The transformers model_type of a family (Gemma 3 and 4 export their text-only model types)."""
    return {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(family, family)
