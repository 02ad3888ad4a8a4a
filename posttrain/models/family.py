"""The family table: what each supported model family declares, and the registry `hf_config.py` and `hf.py` look
families up in.

A family is one Hugging Face `model_type` (config.json) run by the one Transformer: a `Family` record holds its
name (`ModelConfig.family`), its HF class names, its config-class defaults, the ModelConfig fields it always has,
its config translation both ways (hooks beside the common part `hf_config.py` does for every family) and its
weight-name hooks (beside the common names of `hf_names.py`). Family modules (`models/families/`) build their
records and `register_family` them (`models/families/__init__.py` imports them all: import the lookups from there,
so the table is full); a family defined elsewhere (a test, a user's module) registers the same way and is then
loaded and exported like the built-in ones, with no change to `hf_config.py`. docs/models.md, "Adding a family",
walks through one.

Also here: the RoPE translation helpers family modules share (config.json `rope_parameters` <-> RopeConfig, and
transformers' legacy-key upgrade), so a family module imports this module only.

A multimodal folder's vision part is one `VisionFamily` record (`Family.vision`): a tower inside the Transformer
(`ModelConfig.vision`, Qwen3-VL) or, with `build`, a model around it (Gemma 3's Gemma3VL); `vision_of(model)` finds it.

What it is not: a second model class for text (families differ only in ModelConfig fields) or the GGUF names
(`models/gguf/`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig, RopeConfig


def _nothing(*_args) -> dict:
    return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family. Hooks default to doing nothing; `hf_config.config_from_hf` / `config_to_hf` and
    `hf_names.weight_map` do the part every family shares and call them."""

    name: str  # ModelConfig.family ("gemma3")
    model_type: str  # config.json model_type ("gemma3_text")
    architecture: str  # transformers' causal-LM class, written as config.json architectures ("Gemma3ForCausalLM")
    classifier: Optional[str] = None  # its sequence-classification class (reward models); None: none exists
    # config.json fields transformers' config class fills in when the file leaves them out (the ones the
    # translation reads); hf_config.COMMON_DEFAULTS beneath them
    defaults: dict = dataclasses.field(default_factory=dict)
    aliases: dict = dataclasses.field(default_factory=dict)  # config.json key -> the config class's attribute
    default_theta: float = 10_000.0  # RoPE base when config.json gives none
    # the config class's __post_init__ on the field dict (derived fields: layer types, windows, rope defaults)
    post_init: Callable[[dict], None] = _nothing
    # legacy rope_scaling / rope_theta keys -> rope_parameters (after post_init); `convert_rope_params` or the family's
    rope_init: Optional[Callable[[dict, float], None]] = None
    fields: dict = dataclasses.field(default_factory=dict)  # ModelConfig fields every model of the family has
    # hf config -> the family's further ModelConfig fields (after `fields`; may raise PosttrainError naming `where`)
    config_fields: Callable[[Any, str], dict] = _nothing
    # (cfg, d): the family's config.json fields, written into d after the common ones (may raise PosttrainError)
    config_to_hf: Callable[[ModelConfig, dict], Any] = _nothing
    attention_bias: bool = False  # config.json may set attention_bias (q/k/v biases); else it is an error
    rope_by_layer_type: bool = False  # rope_parameters holds one dict per layer type (full / sliding)
    window_everywhere: bool = False  # a sliding_window without sliding layer_types slides every layer
    use_sliding_window: bool = False  # config.json switches windows on with use_sliding_window (Qwen)
    layer_types_always: bool = False  # config.json always lists layer_types (also when every layer is full)
    moe: bool = False  # the family's config can hold routed experts (its config_to_hf writes them)
    owns: tuple = ()  # ModelConfig fields only this family exports (set on another family's model: an error)
    # (m, cfg, prefix): add or replace entries of hf_names' weight map (posttrain path -> (HF keys, load, save))
    weight_names: Callable[[dict, ModelConfig, str], Any] = _nothing
    # (m, cfg, i, layer prefix): layer i's router and expert names; None: hf_names' Qwen3-MoE names
    expert_names: Optional[Callable[[dict, ModelConfig, int, str], Any]] = None
    # (cfg, prefix) -> {HF key on disk: ([the HF keys it holds], split, join)} (Qwen3-Next's fused tensors)
    fused_names: Callable[[ModelConfig, str], dict] = _nothing
    multimodal: Optional[str] = None  # model_type of a multimodal folder whose text_config is this family
    text_prefix: str = "model."  # where that folder keeps the text model's weights
    multimodal_error: Optional[Callable[[str, dict], PosttrainError]] = None  # loading that folder without text_only
    other_text_prefixes: tuple = ()  # other places such a folder may keep the text model (read when text_prefix is not)
    vision: Optional["VisionFamily"] = None  # that folder's vision part, loaded unless text_only (Qwen3-VL, Gemma 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionFamily:
    """The vision part of a family's multimodal folder: `hf.from_pretrained` reads its config with `read` and its
    weights through `weight_names`; `hf.save_pretrained` writes them back through the same names and `config_to_hf`.

    Where the tower lives: with `build` None, inside the Transformer (`ModelConfig.vision` is `read`'s result:
    Qwen3-VL, `vision/qwen_vl.py`); else the folder loads as `build`'s model, the Transformer at `.text` beside the
    tower, its vision config at `.vcfg` (Gemma 3: `vision/gemma3.py`'s Gemma3VL)."""

    architecture: str  # transformers' class ("Gemma3ForConditionalGeneration")
    read: Callable[[dict, str], Any]  # (config.json, where) -> the folder's vision config (may raise PosttrainError)
    # (the text model's weight map, vision config, HF key -> file or None when saving) -> the whole model's map
    weight_names: Callable[[dict, Any, Optional[dict]], dict]
    config_to_hf: Callable[[Any, dict], dict]  # (vision config, the text model's config.json dict) -> config.json
    build: Optional[Callable[[ModelConfig, Any, Any], Any]] = None  # (text cfg, vision config, nnx.Rngs) -> model


def vision_of(model) -> tuple:
    """(the family's VisionFamily, the model's vision config) of a vision-language model, else (None, None)."""
    cfg = model.cfg
    vcfg = getattr(model, "vcfg", None) or cfg.vision
    fam = family_named(cfg.family) if vcfg is not None else None
    return (fam.vision, vcfg) if fam is not None and fam.vision is not None else (None, None)


_BY_TYPE: dict[str, Family] = {}
_BY_NAME: dict[str, Family] = {}


def register_family(family: Family, replace: bool = False) -> Family:
    """Add `family` to the table (by model_type and by name); a second family of the same model_type or name is an
    error unless `replace`."""
    if not replace:
        for table, key in ((_BY_TYPE, family.model_type), (_BY_NAME, family.name)):
            if key in table and table[key] is not family:
                raise PosttrainError(f"register_family: {key!r} is already registered; pass replace=True to "
                                     "replace it")
    for table, key in ((_BY_TYPE, family.model_type), (_BY_NAME, family.name)):
        old = table.get(key)
        if old is not None:  # replaced: drop the old record's other key too
            _BY_TYPE.pop(old.model_type, None)
            _BY_NAME.pop(old.name, None)
    _BY_TYPE[family.model_type] = family
    _BY_NAME[family.name] = family
    return family


def unregister_family(model_type: str) -> None:
    """Remove a family (tests that register one of their own)."""
    fam = _BY_TYPE.pop(model_type, None)
    if fam is not None:
        _BY_NAME.pop(fam.name, None)


def family_of_type(model_type: Optional[str]) -> Optional[Family]:
    """The family of a config.json model_type, or None."""
    return _BY_TYPE.get(model_type)


def family_named(name: str) -> Optional[Family]:
    """The family of a ModelConfig.family name, or None."""
    return _BY_NAME.get(name)


def family_of_multimodal(model_type: Optional[str]) -> Optional[Family]:
    """The family whose multimodal folder has this model_type (Gemma 4's `gemma4`), or None."""
    return next((f for f in _BY_TYPE.values() if model_type is not None and f.multimodal == model_type), None)


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_BY_TYPE.values())


def model_types() -> tuple[str, ...]:
    """Every model_type posttrain loads."""
    return tuple(f.model_type for f in families())


# ----------------------------------------------------------------------------- RoPE helpers


def standardize_rope(d: dict, theta) -> None:
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


def convert_rope_params(d: dict, default_theta: float) -> None:
    """PreTrainedConfig.convert_rope_params_to_dict: legacy rope_scaling / rope_theta into rope_parameters."""
    rp = d.get("rope_scaling") or d.get("rope_parameters")
    rp = {k: dict(v) if isinstance(v, dict) else v for k, v in (rp or {}).items()}
    theta = d.get("rope_theta", default_theta)
    rp.setdefault("rope_theta", theta)
    if d.get("partial_rotary_factor") is not None:
        rp.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    d["rope_parameters"] = rp
    standardize_rope(d, theta)


def rope_from_hf(d: Optional[dict], default_theta: float = 10_000.0, partial: float = 1.0) -> RopeConfig:
    """A RopeConfig from one config.json rope_parameters dict (default, linear, llama3, yarn, proportional)."""
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


def rope_to_hf(r: RopeConfig) -> dict:
    """The config.json rope_parameters dict of a RopeConfig."""
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


def sliding_layer_types(n: int, every: int) -> list[str]:
    """transformers' usual pattern: every `every`-th layer full attention, the rest sliding."""
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


# ----------------------------------------------------------------------------- weight-name helpers


def routed_expert_names(m: dict, cfg: ModelConfig, i: int, p: str, block: str = "mlp.",
                        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """Layer i's router and experts, each expert its own Linear on disk (what transformers 5.12 `save_pretrained`
    writes): `{block}gate.weight` and `{block}experts.<e>.{gate,up,down}` under the family's names (Qwen3-MoE
    `mlp.` and gate_proj / up_proj / down_proj, Mixtral `block_sparse_moe.` and w1 / w3 / w2); in memory
    transformers fuses them into [E, 2F, D] `mlp.experts.gate_up_proj` and [E, D, F] `mlp.experts.down_proj`, which
    are read too (the alternative of each entry)."""
    import numpy as np

    E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_mlp_dim
    b = p + block
    gate, up, down = names
    ex = [b + f"experts.{e}." for e in range(E)]
    fused = p + "mlp.experts."
    m[("layers", i, "mlp", "router")] = ([b + "gate.weight"], lambda w: w.T, lambda w: [w.T],
                                         ([p + "mlp.gate.weight"], lambda w: w.T))
    m[("layers", i, "mlp", "expert_gate_up")] = (
        [e + f"{gate}.weight" for e in ex] + [e + f"{up}.weight" for e in ex],
        lambda *a: np.stack([np.stack([g.T, u.T], axis=1) for g, u in zip(a[:E], a[E:])]),
        lambda w: [w[e, :, 0].T for e in range(E)] + [w[e, :, 1].T for e in range(E)],
        ([fused + "gate_up_proj"], lambda w: w.reshape(E, 2, F, D).transpose(0, 3, 1, 2)))
    m[("layers", i, "mlp", "expert_down")] = (
        [e + f"{down}.weight" for e in ex], lambda *a: np.stack([w.T for w in a]),
        lambda w: [w[e].T for e in range(E)],
        ([fused + "down_proj"], lambda w: w.transpose(0, 2, 1)))


def no_router_jitter(hf, where: str) -> None:
    """Multiplicative noise on the router input while training (router_jitter_noise) is not supported."""
    if getattr(hf, "router_jitter_noise", 0.0):
        raise PosttrainError(f"{where}: router_jitter_noise = {hf.router_jitter_noise} is not supported; set it to 0")
