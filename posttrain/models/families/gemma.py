"""Gemma (`gemma`), Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`): GeGLU (tanh GELU), RMSNorms that scale
by (1 + w), embeddings times sqrt(hidden_size), tied output head. Gemma 2 adds sandwich norms (after attention,
around the MLP), a query scale of query_pre_attn_scalar^-1/2, tanh soft-capping of attention scores and logits,
and alternating sliding / full layers; Gemma 3 drops the soft-caps for q and k RMSNorms, slides five layers of
six and gives the sliding layers their own RoPE (`rope_parameters` per layer type; legacy `rope_local_base_freq`);
its vision-language folders (`gemma3`) are families/gemma3_vl.py's.
Per transformers 5.12's GemmaConfig, Gemma2Config, Gemma3TextConfig and their modeling files. A family module:
records for `models/family.py`'s table."""

from __future__ import annotations

from posttrain.models.config import ModelConfig
from posttrain.models.families import gemma3_vl
from posttrain.models.family import Family, register_family, sliding_layer_types, standardize_rope

GEMMA_FIELDS = dict(norm_unit_offset=True, embed_scale=True)  # every Gemma (Gemma 4 turns the offset off again)


def gelu_to_hf(d: dict) -> None:
    """Gemma's config classes read hidden_activation (hidden_act is the legacy key)."""
    d["hidden_activation"] = d["hidden_act"]


def _softcap_fields(hf, where: str) -> dict:
    """Gemma 2 / 3: sandwich norms, the query scale, the soft-caps."""
    return dict(sandwich_norm=True, query_scale=hf.query_pre_attn_scalar ** -0.5,
                attn_softcap=getattr(hf, "attn_logit_softcapping", None),
                final_softcap=getattr(hf, "final_logit_softcapping", None))


def _softcap_to_hf(cfg: ModelConfig, d: dict) -> None:
    gelu_to_hf(d)
    scalar = (cfg.query_scale or cfg.head_dim ** -0.5) ** -2
    d.update(query_pre_attn_scalar=int(round(scalar)) if abs(scalar - round(scalar)) < 1e-6 else scalar,
             attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap)


GEMMA = register_family(Family(
    name="gemma", model_type="gemma", architecture="GemmaForCausalLM", classifier="GemmaForSequenceClassification",
    defaults=dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  max_position_embeddings=8192, tie_word_embeddings=True),
    fields=GEMMA_FIELDS, config_to_hf=lambda cfg, d: gelu_to_hf(d)))


def _gemma2_post_init(d: dict) -> None:
    if d.get("layer_types") is None:
        d["layer_types"] = sliding_layer_types(d["num_hidden_layers"], 2)


GEMMA2 = register_family(Family(
    name="gemma2", model_type="gemma2", architecture="Gemma2ForCausalLM",
    classifier="Gemma2ForSequenceClassification",
    defaults=dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                  max_position_embeddings=8192, tie_word_embeddings=True, query_pre_attn_scalar=256,
                  sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    post_init=_gemma2_post_init, fields=GEMMA_FIELDS, config_fields=_softcap_fields, config_to_hf=_softcap_to_hf,
    layer_types_always=True))


def _gemma3_post_init(d: dict) -> None:
    """Gemma3TextConfig.__post_init__: bidirectional windows, the sliding pattern, and its own RoPE upgrade (a
    legacy rope_scaling is the full layers', rope_local_base_freq the sliding layers' base)."""
    if d.get("use_bidirectional_attention"):
        d["sliding_window"] = d["sliding_window"] // 2 + 1
    if d.get("layer_types") is None:
        d["layer_types"] = sliding_layer_types(d["num_hidden_layers"], d.get("sliding_window_pattern", 6))


def _gemma3_rope(d: dict, _theta: float) -> None:
    rp = d.get("rope_parameters") or {"sliding_attention": {"rope_type": "default"},
                                      "full_attention": {"rope_type": "default"}}
    rp = {k: dict(v) if isinstance(v, dict) else v for k, v in rp.items()}
    if d.get("rope_scaling") is not None:
        rp["full_attention"].update(d["rope_scaling"])
    rp.setdefault("full_attention", {"rope_type": "default"})
    rp["full_attention"].setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    rp.setdefault("sliding_attention", {"rope_type": "default"})
    rp["sliding_attention"].setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    d["rope_parameters"] = rp
    standardize_rope(d, None)


GEMMA3 = register_family(Family(
    name="gemma3", model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    classifier="Gemma3TextForSequenceClassification",
    defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                  max_position_embeddings=131072, tie_word_embeddings=True, query_pre_attn_scalar=256,
                  sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                  use_bidirectional_attention=False),
    post_init=_gemma3_post_init, rope_init=_gemma3_rope, fields=dict(GEMMA_FIELDS, qk_norm=True),
    config_fields=_softcap_fields, config_to_hf=_softcap_to_hf, rope_by_layer_type=True, layer_types_always=True,
    # a `gemma3` folder (Gemma3ForConditionalGeneration): whole (families/gemma3_vl.py), or its text model (text_only)
    multimodal=gemma3_vl.MULTIMODAL, text_prefix=gemma3_vl.TEXT_PREFIX,
    other_text_prefixes=gemma3_vl.OTHER_TEXT_PREFIXES, vision=gemma3_vl.GEMMA3_VISION))
