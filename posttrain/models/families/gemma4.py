"""Gemma 4 text (transformers `gemma4_text`, and the text model of a `gemma4` folder): config fields both ways
and the Hugging Face names of its per-layer parts. A family module, not a model: the one Transformer runs it.

What Gemma 4 text is, per transformers 5.12 `models/gemma4/modeling_gemma4.py` (each a ModelConfig field):
  - sliding and global (full) layers with their own head size (`global_head_dim`) and, when keys are
    values (`attention_k_eq_v`: the raw key projection is also the value, full layers only), their own
    kv heads (`num_global_key_value_heads`);
  - q and k RMSNorms, a scale-free RMSNorm on the values, query scale 1, proportional RoPE on the
    global layers (only `partial_rotary_factor` of the dimension pairs rotate);
  - KV-shared layers (`num_kv_shared_layers`): the last n layers reuse the keys and values of the last
    earlier layer of their type (no k/v weights); with `use_double_wide_mlp` their MLP is twice as wide;
  - per-layer input embeddings (`hidden_size_per_layer_input`): a packed [vocab, L * P] token table plus
    a projection of the embeddings feed every layer a [P] signal after its MLP;
  - `enable_moe_block`: a routed block (`num_experts`, `top_k_experts`, `moe_intermediate_size`) beside the
    dense MLP of every layer; a loaded `layer_scalar` on each layer's output; plain (w, not 1 + w) norms.
Unlike Qwen3-MoE / Mixtral, transformers adds no router loss for Gemma 4: `router_aux_loss_coef` is 0.

transformers 5.15 and later keep the full layers' head size and kv heads in `per_layer_config` ({layer: {head_dim,
num_key_value_heads}}) instead of `global_head_dim` / `num_global_key_value_heads`: both forms are read.

What it is not: the vision and audio towers of a `gemma4` folder (load its text model with
`from_pretrained(path, text_only=True)`), `use_bidirectional_attention="all"`, attention dropout.
"""

from __future__ import annotations

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.families.gemma import GEMMA_FIELDS, gelu_to_hf
from posttrain.models.family import Family, register_family, sliding_layer_types

MULTIMODAL = "gemma4"  # model_type of the multimodal folder; its text model is `text_config`
TEXT_PREFIX = "model.language_model."  # where that folder keeps the text model's weights


def multimodal_error(cfg_file: str, raw: dict) -> PosttrainError:
    """What loading a multimodal `gemma4` folder without text_only=True raises."""
    towers = [k for k in ("vision_config", "audio_config") if raw.get(k)] or ["text_config"]
    return PosttrainError(
        f"{cfg_file}: model_type 'gemma4' is a multimodal Gemma 4 folder ({' and '.join(towers)}); its vision and "
        "audio towers are not supported. Load its text model explicitly: model.text_only: true in a run config, "
        "--text-only for posttrain generate, or posttrain.models.from_pretrained(path, text_only=True)")


def config_fields(hf, where: str) -> dict:
    """The Gemma 4 ModelConfig fields of a transformers Gemma4TextConfig (the rest are hf_config's common ones)."""
    if getattr(hf, "use_bidirectional_attention", None) == "all":
        raise PosttrainError(f"{where}: use_bidirectional_attention = 'all' is not supported (posttrain models are "
                             "causal); set it to null")
    if getattr(hf, "attention_dropout", 0.0):
        raise PosttrainError(f"{where}: attention_dropout = {hf.attention_dropout} is not supported; set it to 0")
    k_eq_v = bool(hf.attention_k_eq_v)
    P = hf.hidden_size_per_layer_input or 0
    kw = dict(norm_unit_offset=False, sandwich_norm=True, v_norm=True, query_scale=1.0, attn_softcap=None,
              final_softcap=hf.final_logit_softcapping, global_head_dim=hf.global_head_dim or None,
              global_kv_heads=(hf.num_global_key_value_heads or None) if k_eq_v else None, k_eq_v=k_eq_v,
              kv_shared_layers=hf.num_kv_shared_layers or 0, double_wide_mlp=bool(hf.use_double_wide_mlp),
              per_layer_dim=P, per_layer_vocab=(hf.vocab_size_per_layer_input or 0) if P else 0, layer_scalar=True)
    if hf.enable_moe_block:
        kw.update(num_experts=hf.num_experts, experts_per_token=hf.top_k_experts,
                  expert_mlp_dim=hf.moe_intermediate_size, norm_topk_prob=True, moe_beside_mlp=True,
                  router_aux_loss_coef=0.0)
    return kw


# The fixed choices of Gemma 4: a ModelConfig of family "gemma4" must have these to export as gemma4_text.
_FIXED = dict(norm_unit_offset=False, sandwich_norm=True, qk_norm=True, v_norm=True, embed_scale=True, query_scale=1.0,
              attn_softcap=None, layer_scalar=True, qkv_bias=False)
_FIXED_MOE = dict(moe_beside_mlp=True, norm_topk_prob=True, dense_layers=())
GEMMA4_ONLY = ("moe_beside_mlp", "global_head_dim", "global_kv_heads", "k_eq_v", "v_norm", "kv_shared_layers",
               "double_wide_mlp", "per_layer_dim", "per_layer_vocab", "layer_scalar")


def config_to_hf(cfg: ModelConfig, d: dict) -> None:
    """The Gemma 4 fields of a gemma4_text config.json, into d (hf_config writes the common ones)."""
    fixed = {**_FIXED, **(_FIXED_MOE if cfg.num_experts else {})}
    bad = {k: v for k, v in fixed.items() if getattr(cfg, k) != v}
    if bad:
        fix = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        raise PosttrainError(f"cannot export as gemma4_text: Gemma 4 has {fix}")
    if cfg.global_kv_heads and not cfg.k_eq_v:
        raise PosttrainError("cannot export as gemma4_text: global_kv_heads needs k_eq_v (transformers reads "
                             "num_global_key_value_heads only with attention_k_eq_v)")
    moe = cfg.num_experts > 0
    gelu_to_hf(d)
    d.update(final_logit_softcapping=cfg.final_softcap, global_head_dim=cfg.global_head_dim or cfg.head_dim,
                num_global_key_value_heads=(cfg.global_kv_heads or cfg.num_kv_heads) if cfg.k_eq_v else None,
                attention_k_eq_v=cfg.k_eq_v,
                num_kv_shared_layers=cfg.kv_shared_layers, use_double_wide_mlp=cfg.double_wide_mlp,
                hidden_size_per_layer_input=cfg.per_layer_dim,
                vocab_size_per_layer_input=cfg.per_layer_vocab or cfg.vocab_size, enable_moe_block=moe,
                num_experts=cfg.num_experts if moe else None, top_k_experts=cfg.experts_per_token if moe else None,
                moe_intermediate_size=cfg.expert_mlp_dim if moe else None, attention_bias=False)


def weight_names(m: dict, cfg: ModelConfig, prefix: str) -> None:
    """Add the per-layer-input, MoE-beside-MLP and layer-scalar entries to hf.py's weight map `m`
    (posttrain path -> (HF keys, load, save)); HF stores Gemma 4's experts fused: gate_up_proj [E, 2F, D]
    (gate rows, then up rows), down_proj [E, D, F]."""
    ident = (lambda a: a, lambda a: [a])
    tr = (lambda w: w.T, lambda w: [w.T])
    if cfg.per_layer_dim:
        m[("ple_embed",)] = ([prefix + "embed_tokens_per_layer.weight"], *ident)
        m[("ple_model_proj",)] = ([prefix + "per_layer_model_projection.weight"], *tr)
        m[("ple_norm", "scale")] = ([prefix + "per_layer_projection_norm.weight"], *ident)
    E, F = cfg.num_experts, cfg.expert_mlp_dim
    for i in range(cfg.num_layers):
        p, L = f"{prefix}layers.{i}.", ("layers", i)
        if cfg.layer_scalar:
            m[L + ("layer_scalar",)] = ([p + "layer_scalar"], *ident)
        if cfg.per_layer_dim:
            m[L + ("ple_gate",)] = ([p + "per_layer_input_gate.weight"], *tr)
            m[L + ("ple_proj",)] = ([p + "per_layer_projection.weight"], *tr)
            m[L + ("ple_norm", "scale")] = ([p + "post_per_layer_input_norm.weight"], *ident)
        if cfg.moe_beside_mlp and cfg.is_moe_layer(i):
            m[L + ("moe", "router")] = ([p + "router.proj.weight"], *tr)
            m[L + ("moe", "router_scale")] = ([p + "router.scale"], *ident)
            m[L + ("moe", "expert_scale")] = ([p + "router.per_expert_scale"], *ident)
            m[L + ("moe", "expert_gate_up")] = (
                [p + "experts.gate_up_proj"], lambda w: w.reshape(E, 2, F, -1).transpose(0, 3, 1, 2),
                lambda w: [w.transpose(0, 2, 3, 1).reshape(E, 2 * F, -1)])
            m[L + ("moe", "expert_down")] = ([p + "experts.down_proj"], lambda w: w.transpose(0, 2, 1),
                                             lambda w: [w.transpose(0, 2, 1)])
            for ours, theirs in (("moe_norm", "pre_feedforward_layernorm_2"), ("post_dense_norm",
                                 "post_feedforward_layernorm_1"), ("post_moe_norm", "post_feedforward_layernorm_2")):
                m[L + (ours, "scale")] = ([p + theirs + ".weight"], *ident)


def post_init(d: dict) -> None:
    """Gemma4TextConfig.__post_init__: bidirectional windows, five sliding layers of six with the last one full,
    proportional RoPE on the full layers by default."""
    if d.get("use_bidirectional_attention") == "all":
        d["sliding_window"] = d["sliding_window"] // 2 + 1
    if d.get("layer_types") is None:
        d["layer_types"] = sliding_layer_types(d["num_hidden_layers"], 6)
    if d["layer_types"] and d["layer_types"][-1] != "full_attention":
        d["layer_types"] = list(d["layer_types"][:-1]) + ["full_attention"]
    per_layer = d.get("per_layer_config")
    if isinstance(per_layer, dict):  # transformers >= 5.15 writes the full layers' head size / kv heads per layer
        full = [v for k, v in sorted(per_layer.items(), key=lambda kv: int(kv[0]))
                if d["layer_types"][int(k)] == "full_attention" and isinstance(v, dict)]
        d["global_head_dim"] = next((v["head_dim"] for v in full if "head_dim" in v), d.get("head_dim"))
        d["num_global_key_value_heads"] = next((v["num_key_value_heads"] for v in full if "num_key_value_heads" in v),
                                               None)
    if d.get("rope_parameters") is None:
        d["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


GEMMA4 = register_family(Family(
    name="gemma4", model_type="gemma4_text", architecture="Gemma4ForCausalLM",
    defaults=dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                  max_position_embeddings=131072, tie_word_embeddings=True, sliding_window=512,
                  final_logit_softcapping=None, use_bidirectional_attention=None, vocab_size_per_layer_input=262144,
                  hidden_size_per_layer_input=256, num_global_key_value_heads=None, global_head_dim=512,
                  attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
                  use_double_wide_mlp=False, num_experts=None, top_k_experts=None, moe_intermediate_size=None),
    post_init=post_init, fields=dict(GEMMA_FIELDS, qk_norm=True), config_fields=config_fields,
    config_to_hf=config_to_hf, rope_by_layer_type=True, layer_types_always=True, moe=True, owns=GEMMA4_ONLY,
    weight_names=weight_names, multimodal=MULTIMODAL, text_prefix=TEXT_PREFIX, multimodal_error=multimodal_error))
