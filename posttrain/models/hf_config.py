"""Hugging Face config.json <-> ModelConfig: `config_from_hf` and `config_to_hf` do what every family shares and
look the rest up in the family table (`models/family.py`; the built-in families are `models/families/`): defaults,
derived fields, the family's fixed and translated fields, its class names. Weights are in hf.py / hf_names.py."""

from __future__ import annotations

from typing import Optional

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.families import families, family_named, family_of_multimodal, family_of_type, model_types
from posttrain.models.family import convert_rope_params, rope_from_hf, rope_to_hf

# What transformers (5.12) gives a config field that config.json leaves out, for every family (each family's own
# defaults are its Family.defaults; tests/test_hf_config_json.py checks this reader against AutoConfig).
COMMON_DEFAULTS = dict(mlp_bias=False, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
                       rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, layer_types=None,
                       head_dim=None, num_key_value_heads=None, sliding_window=None)


def supported() -> tuple[str, ...]:
    """The config.json model types posttrain loads (every registered family)."""
    return model_types()


class HFConfig:
    """A config.json read as transformers' config class would read it (defaults, derived fields, legacy RoPE
    keys), as plain attributes, without importing transformers (which imports torch)."""

    def __init__(self, raw: dict, model_type: Optional[str] = None):
        mt = model_type or raw.get("model_type")
        fam = family_of_type(mt)
        d = dict(COMMON_DEFAULTS, **(fam.defaults if fam else {}))
        aliases = fam.aliases if fam else {}
        for k, v in raw.items():
            d[aliases.get(k, k)] = v
        d["model_type"] = mt
        if fam is not None:  # the config class's __post_init__ (the fields config_from_hf reads)
            if d.get("num_key_value_heads") is None:
                d["num_key_value_heads"] = d["num_attention_heads"]
            fam.post_init(d)
            (fam.rope_init or convert_rope_params)(d, fam.default_theta)
        self.__dict__.update(d)
        for alias, name in aliases.items():
            self.__dict__[alias] = d.get(name)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def read_hf_config(raw: dict, where: str = "config.json"):
    """(config of the text model, tie_word_embeddings of the folder) from a parsed config.json; a multimodal folder
    (`gemma4`) gives its text_config (the outer config ties the embeddings)."""
    fam = family_of_multimodal(raw.get("model_type"))
    if fam is not None:
        text = raw.get("text_config") or {}
        return HFConfig(text, fam.model_type), bool(raw.get("tie_word_embeddings", True))
    hf = HFConfig(raw)
    return hf, bool(hf.tie_word_embeddings)


def config_from_hf(hf, where: str = "config.json") -> ModelConfig:
    """Translate a transformers config object (or an HFConfig) into a ModelConfig."""
    if getattr(hf, "is_heterogeneous", False):  # transformers >= 5.15: attributes that vary per layer (Gemma 4's
        hf = HFConfig(hf.to_dict())  # per_layer_config) raise on a bare read; read its dict as a config.json
    mt = getattr(hf, "model_type", None)
    fam = family_of_type(mt)
    if fam is None:
        raise PosttrainError(
            f"{where}: model_type {mt!r} is not supported; posttrain loads {', '.join(supported())}. "
            "Convert the checkpoint to one of these architectures or open an issue.")
    if getattr(hf, "mlp_bias", False) or (not fam.attention_bias and getattr(hf, "attention_bias", False)):
        raise PosttrainError(f"{where}: attention_bias / mlp_bias = true is not supported; set them false")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rp = getattr(hf, "rope_parameters", None) or {}
    kw = dict(
        family=fam.name, vocab_size=hf.vocab_size, embed_dim=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
        mlp_dim=getattr(hf, "intermediate_size", None) or hf.shared_expert_intermediate_size,  # Qwen3.5-MoE: none
        max_position=getattr(hf, "max_position_embeddings", 8192), norm_eps=hf.rms_norm_eps,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", fam.defaults.get("tie_word_embeddings", False))),
    )
    if fam.rope_by_layer_type:
        kw["rope"] = rope_from_hf(rp.get("full_attention"))
        kw["rope_local"] = rope_from_hf(rp.get("sliding_attention"))
    else:
        kw["rope"] = rope_from_hf(rp)
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise PosttrainError(f"{where}: activation {act!r} is not supported (silu, gelu_pytorch_tanh are)")
    kw["activation"] = "silu" if act == "silu" else "gelu_tanh"
    kw.update(fam.fields)
    kw.update(fam.config_fields(hf, where))
    types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if types and "sliding_attention" in types:
        kw["layer_types"] = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        kw["sliding_window"] = window
    elif fam.window_everywhere and window:
        kw["sliding_window"] = window  # every layer slides (Qwen3-MoE: only with use_sliding_window)
    return ModelConfig(**kw)


def config_to_hf(cfg: ModelConfig, vision=None, **extra) -> dict:
    """A transformers config dict (model_type + fields) for a ModelConfig. vision: the vision config of a
    vision-language model (default `cfg.vision`): the dict is then the family's multimodal folder's
    (`Family.vision.config_to_hf` around the text config), `extra` at its top level."""
    fam = family_named(cfg.family)
    if fam is None:
        raise PosttrainError(f"cannot export family {cfg.family!r}; supported: {supported()}")
    for other in families():
        only = [k for k in other.owns if other is not fam and getattr(cfg, k)]
        if only:
            raise PosttrainError(f"cannot export family {cfg.family!r} with {', '.join(only)} set: fields of "
                                 f"{other.name} ({other.model_type})")
    if cfg.num_experts and not fam.moe:
        moe = [f.model_type for f in families() if f.moe]
        raise PosttrainError(f"cannot export a mixture-of-experts model as family {cfg.family!r}; use "
                             f"{' or '.join(moe)}")
    d = dict(model_type=fam.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim,
             num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim,
             max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_embeddings, architectures=[fam.architecture],
             hidden_act="silu" if cfg.activation == "silu" else "gelu_pytorch_tanh")
    if fam.rope_by_layer_type:
        d["rope_parameters"] = {"full_attention": rope_to_hf(cfg.rope),
                                "sliding_attention": rope_to_hf(cfg.rope_local or cfg.rope)}
    else:
        d["rope_parameters"] = rope_to_hf(cfg.rope)
    if cfg.sliding_window:
        d["sliding_window"] = cfg.sliding_window
        if fam.use_sliding_window:
            d["use_sliding_window"] = True
    if cfg.layer_types or fam.layer_types_always:
        d["layer_types"] = [("sliding_attention" if cfg.layer_type(i) == "sliding" else "full_attention")
                            for i in range(cfg.num_layers)]
    fam.config_to_hf(cfg, d)
    d["dtype"] = cfg.param_dtype
    vision = cfg.vision if vision is None else vision
    if vision is not None:  # a vision-language folder: the text config nested in the family's own
        d = fam.vision.config_to_hf(vision, d)
    d.update(extra)
    return d


def classifier_class(family: str) -> Optional[str]:
    """transformers' sequence-classification class of a family (gemma3: the text-only one), or None."""
    fam = family_named(family)
    return fam.classifier if fam else None
