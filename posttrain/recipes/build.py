"""The pieces every recipe builds the same way: tokenizer, device mesh, model, memory plan.

What it is: `build_tokenizer(model_section)`, `build_mesh(sharding_section) -> (mesh, rules)`,
`preset_config(model_section, tok)`, `build_model(model_section, tok, lora, mesh, rules)` (a HF
folder or a preset, LoRA attached when enabled, created directly sharded on a mesh) and
`memory_plan(config, model_cfg, mesh_shape, seq_len=..., kv_cache_tokens=...)` (`posttrain.plan`
for one micro-batch of a training config).

What it is not: a recipe (`posttrain.trainers`) or the driver (`recipes.recipe`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from flax import nnx

from posttrain import sharding as sh
from posttrain.errors import PosttrainError
from posttrain.models import Transformer, from_pretrained, load_config, preset
from posttrain.models.family import vision_of
from posttrain.models.hf import load_vision_config
from posttrain.models.lora import LoraParam, apply_lora
from posttrain.plan import plan
from posttrain.tokenizer import Tokenizer, byte_tokenizer


def build_tokenizer(mc) -> Tokenizer:
    """The tokenizer of a model section: model.tokenizer, else the model folder's, else bytes (a preset)."""
    if mc.path:  # the model folder first: a missing folder or a broken config.json is named as such
        load_config(mc.path, mc.text_only)
    if mc.tokenizer:
        return Tokenizer.from_pretrained(mc.tokenizer)
    if mc.path:
        return Tokenizer.from_pretrained(mc.path)
    return byte_tokenizer()


def build_mesh(sc, devices=None):
    """(mesh, rules) of a ShardingSection over `devices` (default: all), or (None, None) for one device."""
    if sc.preset is None:
        return None, None
    return sh.make_mesh(sc.preset, devices, shape=sc.mesh_shape), sh.preset_rules(sc.preset)


def split_devices(sc, sampler_devices: int):
    """(the training mesh's devices, the sampler's) when an RL sampler gets its own `sampler_devices` devices:
    the sampler the last ones, training the first ones (as many as sharding.mesh_shape names, else the rest)."""
    import math

    import jax

    every = jax.devices()
    fixed = dict(sc.mesh_shape or {})
    want = math.prod(fixed.values()) if fixed and -1 not in fixed.values() else len(every) - sampler_devices
    if sc.preset is None or want < 1 or want + sampler_devices > len(every):
        raise PosttrainError(f"rollout.devices={sampler_devices}: the sampler's devices and the training mesh's "
                             f"({want}) must fit the {len(every)} devices, with sharding.preset set; lower "
                             "rollout.devices or sharding.mesh_shape")
    return every[:want], every[len(every) - sampler_devices:]


def numerics(mc) -> dict:
    """The ModelConfig fields a model section sets beside the weights: remat, its policy, matmul precision, scanned
    layers."""
    return dict(remat=mc.remat, remat_policy=mc.remat_policy, matmul_precision=mc.matmul_precision,
                scan_layers=mc.scan_layers)


def preset_config(mc, tok: Tokenizer):
    """The ModelConfig of a preset model section: vocabulary sized to the tokenizer, dtypes, remat."""
    return preset(mc.preset, vocab_size=tok.vocab_size, param_dtype=mc.dtype,
                  dtype=mc.compute_dtype or mc.dtype, **numerics(mc))


def model_config(mc, tok: Tokenizer):
    """The ModelConfig `build_model` will build for a model section, without building it."""
    if mc.path:
        return load_config(mc.path, mc.text_only).replace(param_dtype=mc.dtype, dtype=mc.compute_dtype or mc.dtype,
                                                          **numerics(mc))
    return preset_config(mc, tok)


def build_model(mc, tok: Tokenizer, lora=None, mesh=None, rules=None, *, images: bool = False) -> nnx.Module:
    """The policy: a HF folder or a randomly initialised preset, with LoRA adapters if enabled.

    With a mesh the weights are created / loaded directly sharded. `images`: the recipe reads image rows (SFT, DPO,
    GRPO), so a vision-language model that wraps its Transformer (Gemma 3's Gemma3VL) is built whole; the other
    recipes refuse it (model.text_only: true trains its text model)."""
    if mc.path:
        model = from_pretrained(mc.path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules,
                                text_only=mc.text_only)
        if not images and not isinstance(model, Transformer):
            raise PosttrainError(f"model.path {mc.path} is a vision-language model ({type(model).__name__}); this "
                                 "recipe trains text only (sft, dpo and grpo take image rows): set "
                                 "model.text_only: true to train its text model")
        model.cfg = model.cfg.replace(**numerics(mc))  # Gemma3VL's `cfg` sets its text model's
    else:
        cfg = preset_config(mc, tok)
        if mesh is None:
            model = Transformer(cfg, rngs=nnx.Rngs(mc.seed))
        else:
            model = sh.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(mc.seed)), mesh, rules)
    if tok.vocab_size > model.cfg.vocab_size:
        raise PosttrainError(f"model.tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                             f"{model.cfg.vocab_size}; use the model's own tokenizer")
    if lora is not None and lora.enabled:
        apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets,
                   seed=mc.seed)
    return model


def model_vision(model):
    """A vision-language model's vision config (Qwen3-VL's `cfg.vision`, Gemma 3's `vcfg`), else None: what the
    image rows and batches of a recipe are laid out for."""
    return vision_of(model)[1]


def trainable_filter(mc, lora, model):
    """What trains in `model`: the LoRA adapters or every weight, with a vision-language model's tower (and Gemma
    3's projector, as Qwen3-VL's merger is in its tower) frozen unless model.train_vision (then its weights train
    too, beside the adapters with LoRA)."""
    base = LoraParam if lora is not None and lora.enabled else nnx.Param
    if model_vision(model) is None:
        return base
    parts = getattr(model, "TOWER", ("vision",))  # the submodules that make the image features
    tower = nnx.All(nnx.Param, nnx.Any(*(nnx.PathContains(p) for p in parts)))
    return nnx.Any(base, tower) if mc.train_vision else nnx.All(base, nnx.Not(tower))


def image_spec(mc, tok: Tokenizer):
    """The `data.images.ImageSpec` of a vision-language model folder (None for a text model): image rows need it."""
    if not mc.path:
        return None
    vision = load_vision_config(mc.path, mc.text_only)
    if vision is None:
        return None
    from posttrain.data.images import image_spec as spec
    from posttrain.vision.preprocess import processor_settings

    return spec(processor_settings(mc.path), vision)


def memory_plan(c, model_cfg, mesh_shape: dict, *, seq_len: Optional[int] = None, kv_cache_tokens: int = 0) -> dict:
    """`plan.plan` for a training config: one micro-batch of rows of `seq_len` tokens (default
    data.max_length), the sampler's KV cache (RL), the config's preset, LoRA and remat. A recipe's
    `plan_rows(config)` gives the two numbers."""
    return plan(model_cfg, batch=c.train.micro_batch_size or c.train.batch_size,
                seq_len=seq_len or c.data.max_length, kv_cache_tokens=kv_cache_tokens, mesh_shape=mesh_shape,
                preset=c.sharding.preset or "dp", trainable="lora" if c.lora.enabled else "full",
                remat=c.model.remat, lora_rank=c.lora.rank, lora_targets=c.lora.targets,
                micro_batches=c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size))


def weights_stamp(path: Optional[str]) -> list:
    """(name, size, mtime) of a model folder's weight files: a key part for data cached from a model (a
    re-export of the folder invalidates it)."""
    if not path or not os.path.isdir(path):
        return []
    return sorted((f, os.path.getsize(os.path.join(path, f)), os.path.getmtime(os.path.join(path, f)))
                  for f in os.listdir(path) if f.endswith(".safetensors"))


def is_classifier(path: str) -> bool:
    """Whether a HF folder's config.json names a `*ForSequenceClassification` architecture (a reward model)."""
    f = os.path.join(path, "config.json")
    try:
        with open(f) as fh:
            archs = json.load(fh).get("architectures") or ()
    except OSError as err:
        raise PosttrainError(f"{f}: cannot read it ({err.strerror}); the folder must be a HF model") from None
    except json.JSONDecodeError as err:
        raise PosttrainError(f"{f}:{err.lineno}: not valid JSON ({err.msg}); fix or re-export the folder") from None
    return any(a.endswith("ForSequenceClassification") for a in archs)
