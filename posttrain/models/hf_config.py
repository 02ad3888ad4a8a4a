"""Hugging Face config.json <-> ModelConfig: `config_from_hf` (the supported families, MoE and Gemma 4
fields, rope formats) and `config_to_hf` (what an export writes). Weights are in hf.py."""

from __future__ import annotations

from typing import Optional

from posttrain.errors import PosttrainError
from posttrain.models import gemma4, qwen3_5
from posttrain.models.config import ModelConfig, RopeConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "gemma4_text", "qwen3_moe",
             "mixtral", "gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# mixture-of-experts families (models/moe.py)
MOE = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")

# ----------------------------------------------------------------------------- config

# What transformers (5.12) gives a config field that config.json leaves out: each family's config-class defaults
# for the fields config_from_hf reads (tests/test_models.py checks this reader against AutoConfig).
_COMMON_DEFAULTS = dict(mlp_bias=False, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
                        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, layer_types=None,
                        head_dim=None, num_key_value_heads=None, sliding_window=None)
_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096),
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  max_position_embeddings=8192, tie_word_embeddings=True),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, tie_word_embeddings=True, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False),
    "gemma4_text": dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                        tie_word_embeddings=True, sliding_window=512, final_logit_softcapping=None,
                        use_bidirectional_attention=None, vocab_size_per_layer_input=262144,
                        hidden_size_per_layer_input=256, num_global_key_value_heads=None, global_head_dim=512,
                        attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
                        use_double_wide_mlp=False, num_experts=None, top_k_experts=None, moe_intermediate_size=None),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
                      num_experts_per_tok=8, num_local_experts=128, norm_topk_prob=False, router_aux_loss_coef=0.001,
                      mlp_only_layers=None),
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    num_experts_per_tok=2, num_local_experts=8, router_aux_loss_coef=0.001, router_jitter_noise=0.0),
    "gpt_oss": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, head_dim=64,
                    num_attention_heads=64, num_key_value_heads=8, sliding_window=128, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, num_experts_per_tok=4, num_local_experts=128, router_aux_loss_coef=0.001,
                    attention_bias=True),
    qwen3_5.MODEL_TYPE: qwen3_5.DEFAULTS,
    qwen3_5.MOE_TYPE: qwen3_5.MOE_DEFAULTS,
    qwen3_5.NEXT_TYPE: qwen3_5.NEXT_DEFAULTS,
}
# transformers' default_theta (10 000 for the rest; Gemma 3 below)
_DEFAULT_THETA = {"mixtral": 1_000_000.0, "gpt_oss": 150_000.0}
_ALIASES = {"qwen3_moe": {"num_experts": "num_local_experts"}, "mixtral": {"num_experts": "num_local_experts"},
            "gpt_oss": {"num_experts": "num_local_experts"}}


class HFConfig:
    """A config.json read as transformers' config class would read it (defaults, derived fields, legacy RoPE
    keys), as plain attributes, without importing transformers (which imports torch)."""

    def __init__(self, raw: dict, model_type: Optional[str] = None):
        mt = model_type or raw.get("model_type")
        d = dict(_COMMON_DEFAULTS, **_DEFAULTS.get(mt, {}))
        aliases = _ALIASES.get(mt, {})
        for k, v in raw.items():
            d[aliases.get(k, k)] = v
        d["model_type"] = mt
        if mt in _DEFAULTS:
            _post_init(d, mt)
        self.__dict__.update(d)
        for alias, name in aliases.items():
            self.__dict__[alias] = d.get(name)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _post_init(d: dict, mt: str) -> None:
    """The __post_init__ of transformers' config class of `mt` (the fields config_from_hf reads)."""
    if mt in ("llama", "mistral") and d.get("head_dim") is None:
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    L = d["num_hidden_layers"]
    if mt in qwen3_5.TYPES:
        qwen3_5.post_init(d)
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        d["sliding_window"] = d.get("sliding_window") if d.get("use_sliding_window") else None
    if mt in ("qwen2", "qwen3") and d.get("layer_types") is None:
        d["layer_types"] = ["sliding_attention" if d["sliding_window"] is not None and i >= d["max_window_layers"]
                            else "full_attention" for i in range(L)]
    if mt == "gpt_oss":
        if d.get("layer_types") is None:
            d["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
        if d.get("rope_parameters") is None:
            d["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096}
    if mt == "qwen3_moe" and d.get("mlp_only_layers") is None:
        d["mlp_only_layers"] = []
    if mt == "gemma2" and d.get("layer_types") is None:
        d["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if mt == "gemma3_text":
        if d.get("use_bidirectional_attention"):
            d["sliding_window"] = d["sliding_window"] // 2 + 1
        if d.get("layer_types") is None:
            pattern = d.get("sliding_window_pattern", 6)
            d["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
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
        _standardize_rope(d, None)
        return
    if mt == "gemma4_text":
        if d.get("use_bidirectional_attention") == "all":
            d["sliding_window"] = d["sliding_window"] // 2 + 1
        if d.get("layer_types") is None:
            d["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
        if d["layer_types"] and d["layer_types"][-1] != "full_attention":
            d["layer_types"] = list(d["layer_types"][:-1]) + ["full_attention"]
        if d.get("rope_parameters") is None:
            d["rope_parameters"] = {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
    # PreTrainedConfig.convert_rope_params_to_dict: legacy rope_scaling / rope_theta into rope_parameters
    rp = d.get("rope_scaling") or d.get("rope_parameters")
    rp = {k: dict(v) if isinstance(v, dict) else v for k, v in (rp or {}).items()}
    theta = d.get("rope_theta", _DEFAULT_THETA.get(mt, 10_000.0))
    rp.setdefault("rope_theta", theta)
    if d.get("partial_rotary_factor") is not None:
        rp.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    d["rope_parameters"] = rp
    _standardize_rope(d, theta)


def _standardize_rope(d: dict, theta) -> None:
    """transformers' standardize_rope_params: one dict, or one per layer type when keyed by layer types."""
    rp, types = d["rope_parameters"], d.get("layer_types")
    if not rp and not theta:
        return
    if types is None or rp == {} or not set(rp).issubset(types):
        rp.setdefault("rope_type", rp.get("type", "default"))
        rp.setdefault("rope_theta", theta)
        if rp["rope_type"] in ("llama3", "yarn", "longrope"):
            rp.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings",
                                                                     d["max_position_embeddings"]))
    else:
        for t in set(types):
            rp[t].setdefault("rope_type", rp[t].get("type", "default"))
            rp[t].setdefault("rope_theta", theta)
            if rp[t]["rope_type"] in ("llama3", "yarn", "longrope"):
                rp[t].setdefault("original_max_position_embeddings", d["max_position_embeddings"])
    # rope_theta inside a per-layer-type dict may be stripped by the dict() above: nothing else to do


def read_hf_config(raw: dict, where: str = "config.json"):
    """(config of the text model, tie_word_embeddings of the folder) from a parsed config.json; a multimodal
    `gemma4` folder gives its text_config (the outer config ties the embeddings)."""
    if raw.get("model_type") == gemma4.MULTIMODAL:
        text = raw.get("text_config") or {}
        return HFConfig(text, "gemma4_text"), bool(raw.get("tie_word_embeddings", True))
    hf = HFConfig(raw)
    return hf, bool(hf.tie_word_embeddings)



def _rope(d: Optional[dict], default_theta: float = 10_000.0, partial: float = 1.0) -> RopeConfig:
    d = dict(d or {})
    kind = d.get("rope_type", d.get("type", "default")) or "default"
    theta = d.get("rope_theta") or default_theta
    # a partial rotary factor only where the family applies it (Qwen3.5 / Qwen3-Next: partial=...), in every kind
    if kind == "default":
        return RopeConfig(theta=theta, partial=partial)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(d["factor"]), partial=partial)
    if kind == "llama3":
        return RopeConfig(theta=theta, kind="llama3", factor=float(d["factor"]), partial=partial,
                          low_freq_factor=float(d["low_freq_factor"]),
                          high_freq_factor=float(d["high_freq_factor"]),
                          original_max_position=int(d["original_max_position_embeddings"]))
    if kind == "yarn":
        af = d.get("attention_factor")
        if af is None and d.get("mscale") and d.get("mscale_all_dim"):
            raise PosttrainError("config.json: yarn rope with mscale / mscale_all_dim is not supported; give "
                                 "rope_parameters.attention_factor instead")
        return RopeConfig(theta=theta, kind="yarn", factor=float(d["factor"]), partial=partial,
                          original_max_position=int(d["original_max_position_embeddings"]),
                          beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                          truncate=bool(d.get("truncate", True)), attention_factor=None if af is None else float(af))
    if kind == "proportional":  # Gemma 4 global layers
        return RopeConfig(theta=theta, kind="proportional", factor=float(d.get("factor", 1.0)),
                          partial=float(d.get("partial_rotary_factor", 1.0)))
    raise PosttrainError(f"config.json: rope type {kind!r} is not supported (default, linear, llama3, proportional, "
                         "yarn are)")


def config_from_hf(hf, where: str = "config.json") -> ModelConfig:
    """Translate a transformers config object into a ModelConfig."""
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED:
        raise PosttrainError(
            f"{where}: model_type {mt!r} is not supported; posttrain loads {', '.join(SUPPORTED)}. "
            "Convert the checkpoint to one of these architectures or open an issue.")
    if getattr(hf, "mlp_bias", False) or (mt not in ("qwen2", "gpt_oss") and getattr(hf, "attention_bias", False)):
        raise PosttrainError(f"{where}: attention_bias / mlp_bias = true is not supported; set them false")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rp = getattr(hf, "rope_parameters", None) or {}
    gemma = mt.startswith("gemma")
    kw = dict(
        family=mt.replace("_text", ""), vocab_size=hf.vocab_size, embed_dim=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
        mlp_dim=getattr(hf, "intermediate_size", None) or hf.shared_expert_intermediate_size,  # Qwen3.5-MoE: none
        max_position=getattr(hf, "max_position_embeddings", 8192),
        norm_eps=hf.rms_norm_eps, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", gemma)),
    )
    if mt in ("gemma3_text", "gemma4_text"):
        kw["rope"] = _rope(rp.get("full_attention"))
        kw["rope_local"] = _rope(rp.get("sliding_attention"))
    elif mt in qwen3_5.TYPES:
        kw["rope"] = _rope(rp, partial=float(rp.get("partial_rotary_factor", 1.0)))
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
    kw["qkv_bias"] = mt == "qwen2" or (mt == "gpt_oss" and bool(hf.attention_bias))
    if mt == "gpt_oss":
        kw.update(o_bias=bool(hf.attention_bias), attn_sinks=True)
    kw["qk_norm"] = mt in ("qwen3", "gemma3_text", "gemma4_text", "qwen3_moe")
    if mt in qwen3_5.TYPES:
        kw.update(qwen3_5.config_fields(hf, where))
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
    if mt == "gpt_oss":  # experts on every layer, softmax over the top-k logits (= renormalised top-k)
        return dict(num_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                    expert_mlp_dim=hf.intermediate_size, norm_topk_prob=True, router_bias=True, expert_bias=True,
                    expert_act="gpt_oss", router_aux_loss_coef=float(hf.router_aux_loss_coef))
    if mt in (qwen3_5.MOE_TYPE, qwen3_5.NEXT_TYPE):
        return qwen3_5.moe_fields(hf, where)
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
    mt = text_type(cfg.family)
    if mt not in SUPPORTED:
        raise PosttrainError(f"cannot export family {cfg.family!r}; supported: {SUPPORTED}")
    only = [k for k in gemma4.GEMMA4_ONLY if mt != "gemma4_text" and getattr(cfg, k)]
    if only:
        raise PosttrainError(f"cannot export family {cfg.family!r} with {', '.join(only)} set: Gemma 4 fields")

    def rope(r: RopeConfig) -> dict:
        d = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "linear" or (r.kind == "proportional" and r.factor != 1.0):
            d["factor"] = r.factor
        if r.kind == "proportional" or r.partial != 1.0:
            d["partial_rotary_factor"] = r.partial
        if r.kind == "yarn":
            d.update(factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate,
                     original_max_position_embeddings=r.original_max_position)
            if r.attention_factor is not None:
                d["attention_factor"] = r.attention_factor
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
    if mt in qwen3_5.TYPES:
        qwen3_5.config_to_hf(cfg, d)
    d["dtype"] = cfg.param_dtype
    d.update(extra)
    return d


def _moe_to_hf(cfg: ModelConfig, mt: str) -> dict:
    if mt not in MOE:
        raise PosttrainError(f"cannot export a mixture-of-experts model as family {cfg.family!r}; use "
                             f"{' or '.join(MOE)}")
    if mt == "gpt_oss":
        if cfg.dense_layers or not cfg.norm_topk_prob or not cfg.num_experts or cfg.expert_act != "gpt_oss":
            raise PosttrainError("cannot export as gpt_oss: GPT-OSS has biased experts with its clamped activation "
                                 "on every layer and renormalised top-k weights")
        return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                    intermediate_size=cfg.expert_mlp_dim, router_aux_loss_coef=cfg.router_aux_loss_coef,
                    attention_bias=cfg.qkv_bias)
    if mt in (qwen3_5.MOE_TYPE, qwen3_5.NEXT_TYPE):
        return qwen3_5.moe_to_hf(cfg, mt)
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
         "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
         "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
# transformers' sequence-classification class of each family (gemma3_text: the text-only one).
CLS_ARCH = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
            "qwen3": "Qwen3ForSequenceClassification", "mistral": "MistralForSequenceClassification",
            "gemma": "GemmaForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification",
            "gemma3_text": "Gemma3TextForSequenceClassification",
            "qwen3_moe": "Qwen3MoeForSequenceClassification", "mixtral": "MixtralForSequenceClassification"}


def text_type(family: str) -> str:
    """The transformers model_type of a family (Gemma 3 and 4 export their text-only model types)."""
    return {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text",
            "qwen3_5_moe": "qwen3_5_moe_text"}.get(family, family)
