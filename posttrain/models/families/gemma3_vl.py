"""Gemma 3 vision-language folders (config.json model_type `gemma3`, transformers' Gemma3ForConditionalGeneration)
loaded whole: the `VisionFamily` record (with `build`: a model beside the Transformer) the `gemma3_text` family
(families/gemma.py) carries. Its config translation both ways (Gemma3Config: `text_config`, `vision_config`
(SiglipVisionConfig), `mm_tokens_per_image`, `image_token_index`, `boi_token_index`, `eoi_token_index`, the outer
`tie_word_embeddings`) and its weight names.

Weight names as transformers 5.12's save_pretrained writes them (its "llava" conversion reversed):
`language_model.model.*` (the text model), `vision_tower.*` (SigLIP: embeddings, encoder.layers, post_layernorm),
`multi_modal_projector.{mm_soft_emb_norm.weight, mm_input_projection_weight}`; read also under the in-memory
prefixes (`model.language_model.`, `model.vision_tower.`, `model.multi_modal_projector.`) and the original
checkpoints' `vision_tower.vision_model.`. The model itself is `vision/gemma3.py`'s (imported when one is built).
"""

from __future__ import annotations

import dataclasses

from posttrain.models.family import VisionFamily

MULTIMODAL = "gemma3"
TEXT_PREFIX = "language_model.model."  # transformers 5.12's save_pretrained
OTHER_TEXT_PREFIXES = ("model.language_model.",)  # transformers' in-memory names
VISION_PREFIXES = ("vision_tower.", "vision_tower.vision_model.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def read(raw: dict, where: str):
    """The Gemma3VisionConfig of a `gemma3` config.json (Gemma3Config's defaults for what it leaves out)."""
    from posttrain.vision.gemma3 import Gemma3VisionConfig
    from posttrain.vision.siglip import config_from_hf

    def get(key, alias, default):
        value = raw.get(key, raw.get(alias))
        return default if value is None else int(value)

    return Gemma3VisionConfig(vision=config_from_hf(raw.get("vision_config") or {}, f"{where} vision_config"),
                              mm_tokens_per_image=get("mm_tokens_per_image", "mm_tokens_per_image", 256),
                              image_token_id=get("image_token_index", "image_token_id", 262_144),
                              boi_token_id=get("boi_token_index", "boi_token_id", 255_999),
                              eoi_token_id=get("eoi_token_index", "eoi_token_id", 256_000))


def build(cfg, vcfg, rngs):
    """The Gemma3VL of a text ModelConfig and a Gemma3VisionConfig; the tower in the text model's dtypes."""
    from posttrain.vision.gemma3 import Gemma3VL

    vision = vcfg.vision.replace(param_dtype=cfg.param_dtype, dtype=cfg.dtype)
    return Gemma3VL(cfg, dataclasses.replace(vcfg, vision=vision), rngs=rngs)


def _pick(files, prefixes: tuple, key: str) -> str:
    if files is not None:
        for p in prefixes:
            if p + key in files:
                return p
    return prefixes[0]


def weight_names(text_map: dict, vcfg, files) -> dict:
    """The whole model's map: the text model's entries under ("text", ...), the tower's under ("vision", ...),
    the projector's under ("projector", ...)."""
    from posttrain.vision.siglip import weight_names as siglip_names

    ident = (lambda a: a, lambda a: [a])
    vp = _pick(files, VISION_PREFIXES, "post_layernorm.weight")
    pp = _pick(files, PROJECTOR_PREFIXES, "mm_input_projection_weight")
    m = {("text",) + k: v for k, v in text_map.items()}
    m.update({("vision",) + k: v for k, v in siglip_names(vcfg.vision, vp).items()})
    m[("projector", "norm", "scale")] = ([pp + "mm_soft_emb_norm.weight"], *ident)
    m[("projector", "proj")] = ([pp + "mm_input_projection_weight"], *ident)  # [Dv, D] on disk as in memory
    return m


def config_to_hf(vcfg, text: dict) -> dict:
    """Gemma3Config's config.json around the text model's dict (`hf_config.config_to_hf`'s)."""
    from posttrain.vision.siglip import config_to_hf as siglip_to_hf

    text = {k: v for k, v in text.items() if k != "architectures"}
    return dict(model_type=MULTIMODAL, architectures=[GEMMA3_VISION.architecture], text_config=text,
                vision_config=siglip_to_hf(vcfg.vision), mm_tokens_per_image=vcfg.mm_tokens_per_image,
                image_token_index=vcfg.image_token_id, boi_token_index=vcfg.boi_token_id,
                eoi_token_index=vcfg.eoi_token_id, tie_word_embeddings=text["tie_word_embeddings"])


GEMMA3_VISION = VisionFamily(architecture="Gemma3ForConditionalGeneration", read=read, weight_names=weight_names,
                             config_to_hf=config_to_hf, build=build)
