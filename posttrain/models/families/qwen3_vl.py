"""Qwen3-VL dense (transformers `qwen3_vl`, `Qwen3VLForConditionalGeneration`): the text model (`qwen3_vl_text`: a
Qwen3 with interleaved M-RoPE, `RopeConfig.mrope_section`) and the hooks that read and write its vision tower
(`posttrain/vision/qwen_vl.py`): a `VisionFamily` without `build`. A family module, not a model: the one Transformer
runs the text, with the tower as `ModelConfig.vision`.

A `qwen3_vl` folder keeps the text model under `model.language_model.`, the tower under `model.visual.` and
`lm_head.weight` at the top (tied or not by the outer config's tie_word_embeddings); config.json nests
`text_config` and `vision_config` and holds the image / video / vision start / end token ids. With
`text_only=True` the text model loads alone (no tower: 2-D positions, plain RoPE, which M-RoPE reduces to) and
exports as a `qwen3` folder.
Per transformers 5.12 `models/qwen3_vl/configuration_qwen3_vl.py` and `modeling_qwen3_vl.py`.
What it is not: Qwen3-VL-MoE (`qwen3_vl_moe`), video inputs.
"""

from __future__ import annotations

import dataclasses

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.family import Family, VisionFamily, register_family, rope_from_hf

MULTIMODAL = "qwen3_vl"
MROPE_SECTION = (24, 20, 20)  # Qwen3VLTextRotaryEmbedding's default


def config_fields(hf, where: str) -> dict:
    """Default RoPE with the interleaved M-RoPE sections (transformers interleaves whatever mrope_interleaved says)."""
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    kind = rp.get("rope_type", "default")
    if kind != "default":
        raise PosttrainError(f"{where}: Qwen3-VL rope type {kind!r} is not supported (default is)")
    if getattr(hf, "attention_dropout", 0.0):
        raise PosttrainError(f"{where}: attention_dropout = {hf.attention_dropout} is not supported; set it to 0")
    section = tuple(int(x) for x in rp.get("mrope_section") or MROPE_SECTION)
    if len(section) != 3:
        raise PosttrainError(f"{where}: rope_parameters.mrope_section {list(section)} needs 3 entries (t, h, w)")
    rope = rope_from_hf({k: v for k, v in rp.items() if k not in ("mrope_section", "mrope_interleaved")}, 500_000.0)
    return dict(rope=dataclasses.replace(rope, mrope_section=section))


def config_to_hf(cfg: ModelConfig, d: dict) -> None:
    """The text_config of a qwen3_vl folder; without the tower (text_only), a `qwen3` folder: M-RoPE with every axis
    at the text position is plain RoPE, so Qwen3ForCausalLM gives the same logits on text."""
    if cfg.vision is None:
        d.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], layer_types=["full_attention"] *
                 cfg.num_layers, use_sliding_window=False)
        return
    d["rope_parameters"] = dict(d["rope_parameters"], mrope_section=list(cfg.rope.mrope_section or MROPE_SECTION),
                                mrope_interleaved=True)
    d.pop("architectures", None)  # the text config of a conditional-generation folder


def vision_config(raw: dict, where: str):
    from posttrain.vision.qwen_vl import VisionConfig, vision_config

    known = {f.name for f in dataclasses.fields(VisionConfig)} | {"model_type", "initializer_range", "dtype",
                                                                  "torch_dtype", "transformers_version"}
    extra = sorted(set(raw.get("vision_config") or {}) - known)
    if extra:
        raise PosttrainError(f"{where}: vision_config keys {extra} are not supported")
    v = vision_config(raw.get("vision_config") or {}, raw)
    text = raw.get("text_config") or {}
    if v.out_hidden_size != text.get("hidden_size", 4096):
        raise PosttrainError(f"{where}: vision_config.out_hidden_size {v.out_hidden_size} is not the text model's "
                             f"hidden_size {text.get('hidden_size')}")
    return v


def vision_names(text_map: dict, v, files=None) -> dict:
    """The whole model's map: the text model's entries and the tower's (("vision", ...), under `model.visual.`)."""
    from posttrain.vision.qwen_vl import vision_names

    return {**text_map, **vision_names(v)}


def vision_to_hf(v, text: dict) -> dict:
    """The qwen3_vl folder's config.json around the text model's dict."""
    vision = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if not f.name.endswith("_token_id")}
    vision["deepstack_visual_indexes"] = list(v.deepstack_visual_indexes)
    vision["model_type"] = "qwen3_vl_vision"
    ids = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.name.endswith("_token_id")}
    return dict(model_type=MULTIMODAL, architectures=[QWEN3_VL.vision.architecture], text_config=text,
                vision_config=vision, tie_word_embeddings=text.pop("tie_word_embeddings"), dtype=text.get("dtype"),
                **ids)


QWEN3_VL = register_family(Family(
    name="qwen3_vl", model_type="qwen3_vl_text", architecture="Qwen3VLForConditionalGeneration",
    defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=128, max_position_embeddings=128000,
                  rms_norm_eps=1e-6),
    default_theta=500_000.0, fields=dict(qk_norm=True), config_fields=config_fields, config_to_hf=config_to_hf,
    multimodal=MULTIMODAL, text_prefix="model.language_model.",
    vision=VisionFamily(architecture="Qwen3VLForConditionalGeneration", read=vision_config, weight_names=vision_names,
                        config_to_hf=vision_to_hf)))
