"""Hugging Face checkpoint folders <-> posttrain models, without torch.

`from_pretrained(path)` reads config.json (through transformers' AutoConfig, which also upgrades
old rope formats), translates it into a ModelConfig, builds the model abstractly
(`nnx.eval_shape`), and fills it tensor by tensor from single or sharded safetensors (placed
with their logical sharding when a mesh is given). `save_pretrained(model, path)` writes
config.json + safetensors (split into shards with an index past `max_shard_bytes`) that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

Sequence classifiers (reward models): a model with a score head (`models/heads.py`) is saved as
`<Family>ForSequenceClassification` (backbone `model.*`, `score.weight` [num_labels, D], no
`lm_head`, `id2label` giving num_labels), which `AutoModelForSequenceClassification` loads;
`from_pretrained(path, head="score")` reads such a folder (ours or transformers') back.

Gemma 4 (`models/gemma4.py` holds its fields and extra names): `gemma4_text` folders load like any
other; a multimodal `gemma4` folder loads its text model only when asked (`text_only=True`), since
its vision and audio towers are not supported; it then exports as a `gemma4_text` folder.

What it is not: a downloader. Paths are local folders; nothing is fetched from a hub.
Fused posttrain layouts (qkv, gate/up) are split back into HF names on export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from posttrain.errors import PosttrainError
from posttrain.models import gemma4
from posttrain.models.config import ModelConfig, RopeConfig
from posttrain.models.layers import Buffer
from posttrain.models.transformer import Transformer

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
HEADS = (None, "score")


def _text_type(family: str) -> str:
    """The transformers model_type of a family (Gemma 3 and 4 export their text-only model types)."""
    return {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(family, family)

# ----------------------------------------------------------------------------- weight names
# Each entry: posttrain path -> (HF keys, hf arrays -> posttrain array, posttrain array -> hf arrays[, alternative
# (HF keys, loader) read when the first key is missing: transformers' fused in-memory expert layout)].


def _expert_map(m: dict, cfg: ModelConfig, i: int, p: str) -> None:
    """Layer i's router and experts. On disk (what transformers 5.12 `save_pretrained` writes) every expert
    is its own Linear: qwen3_moe `mlp.experts.<e>.{gate,up,down}_proj`, mixtral
    `block_sparse_moe.experts.<e>.{w1,w3,w2}` (gate, up, down); in memory transformers fuses them into
    [E, 2F, D] `experts.gate_up_proj` and [E, D, F] `experts.down_proj`, which are read too."""
    E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_mlp_dim
    mix = cfg.family == "mixtral"
    b = p + ("block_sparse_moe." if mix else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mix else ("gate_proj", "up_proj", "down_proj")
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


def _attn_map(m: dict, cfg: ModelConfig, i: int, a: str) -> None:
    """Layer i's attention: q/k/v (k/v only where the layer has them: `Attention.kv_slots`) <-> fused qkv, o."""
    D, K, H = cfg.embed_dim, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
    G = cfg.num_heads // K
    c = cfg.layer_kv_slots(i)
    L = ("layers", i, "attn")
    m[L + ("qkv",)] = (
        [a + n + "_proj.weight" for n in "qkv"[:1 + c]],
        lambda q, *kv: np.concatenate([q.T.reshape(D, K, G, H)] + [w.T.reshape(D, K, 1, H) for w in kv], axis=2),
        lambda w: [w[:, :, :G].reshape(D, K * G * H).T] + [w[:, :, G + j].reshape(D, K * H).T for j in range(c)])
    if cfg.qkv_bias:
        m[L + ("qkv_bias",)] = (
            [a + n + "_proj.bias" for n in "qkv"[:1 + c]],
            lambda q, *kv: np.concatenate([q.reshape(K, G, H)] + [b.reshape(K, 1, H) for b in kv], 1),
            lambda b: [b[:, :G].reshape(-1)] + [b[:, G + j].reshape(-1) for j in range(c)])
    m[L + ("o",)] = ([a + "o_proj.weight"], lambda w: w.T.reshape(K, G, H, D), lambda w: [w.reshape(K * G * H, D).T])


def _weight_map(cfg: ModelConfig, head: Optional[str] = None,
                prefix: str = "model.") -> dict[tuple, tuple[list[str], Callable, Callable]]:
    """head=None: the causal LM (lm_head unless tied); "score": a sequence classifier (score, no lm_head).
    prefix: where the backbone's weights live (a multimodal Gemma 4 folder: `model.language_model.`)."""
    gemma_sandwich = cfg.sandwich_norm
    ident = (lambda a: a, lambda a: [a])
    m: dict = {("embed",): ([prefix + "embed_tokens.weight"], *ident),
               ("final_norm", "scale"): ([prefix + "norm.weight"], *ident)}
    if head == "score":  # HF Linear(D, num_labels, bias=False): weight [num_labels, D]
        m[("score",)] = (["score.weight"], lambda w: w.T, lambda a: [a.T])
    elif not cfg.tie_embeddings:
        m[("lm_head",)] = (["lm_head.weight"], lambda w: w.T, lambda a: [a.T])
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        a = p + "self_attn."
        _attn_map(m, cfg, i, a)
        if cfg.qk_norm:
            m[("layers", i, "attn", "q_norm", "scale")] = ([a + "q_norm.weight"], *ident)
            if cfg.kv_source(i) is None:  # a KV-shared layer has no k
                m[("layers", i, "attn", "k_norm", "scale")] = ([a + "k_norm.weight"], *ident)
        if cfg.is_moe_layer(i) and not cfg.moe_beside_mlp:
            _expert_map(m, cfg, i, p)
        else:
            m[("layers", i, "mlp", "gate_up")] = (
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                lambda g, u: np.stack([g.T, u.T], axis=1), lambda w: [w[:, 0].T, w[:, 1].T])
            m[("layers", i, "mlp", "down")] = ([p + "mlp.down_proj.weight"], lambda w: w.T, lambda w: [w.T])
        m[("layers", i, "attn_norm", "scale")] = ([p + "input_layernorm.weight"], *ident)
        if gemma_sandwich:
            m[("layers", i, "post_attn_norm", "scale")] = ([p + "post_attention_layernorm.weight"], *ident)
            m[("layers", i, "mlp_norm", "scale")] = ([p + "pre_feedforward_layernorm.weight"], *ident)
            m[("layers", i, "post_mlp_norm", "scale")] = ([p + "post_feedforward_layernorm.weight"], *ident)
        else:
            m[("layers", i, "mlp_norm", "scale")] = ([p + "post_attention_layernorm.weight"], *ident)
    gemma4.weight_names(m, cfg, prefix)
    return m


# ----------------------------------------------------------------------------- safetensors


def _check_safetensors(path: str) -> None:
    """Fail clearly on a missing or truncated file (header says more bytes than are there)."""
    if not os.path.isfile(path):
        raise PosttrainError(f"{path}: safetensors file is missing; copy the complete checkpoint folder again")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length beyond end of file")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError) as e:
        raise PosttrainError(f"{path}: not a readable safetensors file ({e}); the file is corrupt or "
                             "truncated, copy it again") from None
    if 8 + n + end > size:
        raise PosttrainError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + n + end}); "
                             "copy the file again")


def _tensor_files(path: str) -> dict[str, str]:
    """HF key -> safetensors file, from the index json or the single model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (ValueError, KeyError) as e:
            raise PosttrainError(f"{index}: unreadable index ({e}); it needs a 'weight_map' object") from None
        return {k: os.path.join(path, f) for k, f in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise PosttrainError(f"{path}: no model.safetensors or model.safetensors.index.json; posttrain reads "
                             "safetensors checkpoints only (convert .bin files with transformers first)")
    _check_safetensors(single)
    with safe_open(single, "numpy") as f:
        return {k: single for k in f.keys()}


# ----------------------------------------------------------------------------- public API


def load_config(path: str, text_only: bool = False) -> ModelConfig:
    """ModelConfig of a HF folder (config.json only); text_only: the text model of a multimodal `gemma4` folder."""
    return _read_config(path, text_only)[0]


def _read_config(path: str, text_only: bool) -> tuple[ModelConfig, str]:
    """(ModelConfig, prefix of the backbone's weight names)."""
    if not os.path.isdir(path):
        raise PosttrainError(f"{path}: model folder does not exist; pass a local Hugging Face checkpoint folder")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise PosttrainError(f"{cfg_file}: missing; a Hugging Face model folder needs config.json "
                             "(save the model with save_pretrained)")
    try:
        with open(cfg_file) as fh:
            raw = json.load(fh)
    except ValueError as e:
        raise PosttrainError(f"{cfg_file}: invalid JSON ({e})") from None
    mt = raw.get("model_type")
    multimodal = mt == gemma4.MULTIMODAL
    if multimodal and not text_only:
        raise gemma4.multimodal_error(cfg_file, raw)
    if mt not in SUPPORTED and not multimodal:
        raise PosttrainError(
            f"{cfg_file}: model_type {mt!r} (architectures {raw.get('architectures')}) is not "
            f"supported; posttrain loads {', '.join(SUPPORTED)}")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path, local_files_only=True)
    if not multimodal:
        return config_from_hf(hf, cfg_file), "model."
    # The text model's lm_head is tied (or not) by the outer config, as in Gemma4ForConditionalGeneration.
    cfg = config_from_hf(hf.text_config, f"{cfg_file} text_config")
    return cfg.replace(tie_embeddings=bool(hf.tie_word_embeddings)), gemma4.TEXT_PREFIX


def from_pretrained(path: str, dtype: str = "float32", mesh=None, compute_dtype: Optional[str] = None,
                    rules: Optional[dict] = None, head: Optional[str] = None, text_only: bool = False):
    """Load a HF checkpoint folder into a Transformer (parameters in `dtype`).

    text_only: load the text model of a multimodal `gemma4` folder (its vision and audio towers are
    not supported; without this flag such a folder is an error saying so).

    With a `mesh`, each tensor is placed directly with its logical sharding under `rules`
    (default: the fsdp_tp rules), so the model never lands whole on one device.
    `head="score"` loads a `*ForSequenceClassification` folder: the backbone plus its `score`
    head (`models/heads.py`), no LM head."""
    if head not in HEADS:
        raise PosttrainError(f"from_pretrained: head={head!r}; use one of {HEADS}")
    cfg, prefix = _read_config(path, text_only)
    cfg = cfg.replace(param_dtype=dtype, dtype=compute_dtype or dtype)

    def build():
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        if head == "score":
            from posttrain.models.heads import attach_score_head

            attach_score_head(model, num_labels=_num_labels(path))
        return model

    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    shardings = None
    if mesh is not None:
        from posttrain.sharding import put, state_shardings
        shardings = dict(nnx.to_flat_state(state_shardings(state, mesh, rules)))
    files = _tensor_files(path)
    checked: set = set()
    handles: dict = {}
    wmap = _weight_map(cfg, head, prefix)
    flat = dict(nnx.to_flat_state(state))
    try:
        for key, var in flat.items():
            if key not in wmap:
                raise AssertionError(f"no HF name for posttrain parameter {key}")
            names, load = wmap[key][:2]
            if names[0] not in files and len(wmap[key]) > 3 and wmap[key][3][0][0] in files:
                names, load = wmap[key][3]
            arrays = []
            for name in names:
                if name not in files:
                    hint = "the folder does not match its config.json (wrong or partial checkpoint)"
                    if name == "score.weight":
                        hint = ("it is not a sequence classifier (reward model); attach a new head with "
                                "models.heads.attach_score_head instead")
                    elif "score.weight" in files:
                        hint = ("it is a sequence classifier (reward model): load it with head='score', or "
                                "with posttrain.rewards.RewardModel")
                    raise PosttrainError(f"{path}: tensor {name!r} is missing from the checkpoint; {hint}")
                fname = files[name]
                if fname not in checked:
                    _check_safetensors(fname)
                    checked.add(fname)
                    handles[fname] = safe_open(fname, "numpy")
                arrays.append(handles[fname].get_tensor(name))
            try:
                value = load(*arrays)
            except ValueError:
                value = None
            if value is None or value.shape != var.shape:
                shapes = ", ".join(f"{n} {a.shape}" for n, a in zip(names, arrays))
                raise PosttrainError(
                    f"{path}: tensor shape mismatch for {shapes}; config.json implies {var.shape} for posttrain "
                    f"parameter {'.'.join(map(str, key))}. The weights do not belong to this config.json: "
                    "restore the checkpoint's own config.json or load matching weights")
            value = value.astype(np.dtype(jnp.dtype(dtype)))  # host array: placed once, sharded if a mesh
            value = jnp.asarray(value) if shardings is None else put(value, shardings[key])
            var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
    finally:
        for h in handles.values():
            if hasattr(h, "__exit__"):
                h.__exit__(None, None, None)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(model: Transformer, path: str, tokenizer=None, max_shard_bytes: int = 5 * 2**30,
                    dtype: Optional[str] = None, **config_extra) -> str:
    """Write config.json + safetensors (+ tokenizer) that transformers loads; atomic per folder.

    A model with a score head (`models/heads.py`) is written as `<Family>ForSequenceClassification`
    (pass a tokenizer, or pad_token_id=..., so transformers can find each row's last token)."""
    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, Buffer))))
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    head = "score" if ("score",) in flat else None
    if head == "score":
        labels = range(flat[("score",)].shape[-1])
        mt = _text_type(cfg.family)
        if mt not in _CLS_ARCH:
            raise PosttrainError(f"cannot export a {cfg.family} model with a score head: transformers has no "
                                 f"{cfg.family} sequence classifier")
        config_extra = {"architectures": [_CLS_ARCH[mt]], "id2label": {str(i): f"LABEL_{i}" for i in labels},
                        "label2id": {f"LABEL_{i}": i for i in labels}, **config_extra}
    tensors: dict[str, np.ndarray] = {}
    for key, (names, _, save, *_alt) in _weight_map(cfg, head).items():
        arr = np.asarray(jax.device_get(flat[key][...])).astype(out_dtype)
        for n, a in zip(names, save(arr)):
            tensors[n] = np.ascontiguousarray(a)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".posttrain-export-", dir=parent)
    try:
        shards, cur, size = [], {}, 0
        for n, a in tensors.items():
            if cur and size + a.nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[n] = a
            size += a.nbytes
        shards.append(cur)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, s in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(s, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in s})
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                           "weight_map": weight_map}, fh, indent=2)
        extra = dict(config_extra)
        if tokenizer is not None:
            extra.setdefault("bos_token_id", tokenizer.bos_id)
            extra.setdefault("eos_token_id", tokenizer.eos_id)
            extra.setdefault("pad_token_id", tokenizer.pad_id)
            tokenizer.save_pretrained(tmp)
        hf_cfg = config_to_hf(cfg, **extra)
        hf_cfg["dtype"] = str(out_dtype)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_cfg, fh, indent=2)
        _install(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _num_labels(path: str) -> int:
    """num_labels of a classifier folder: the rows of its score.weight (the config may omit id2label)."""
    fname = _tensor_files(path).get("score.weight")
    if fname is None:
        return 1  # from_pretrained reports the missing tensor
    with safe_open(fname, "numpy") as f:
        return int(f.get_slice("score.weight").get_shape()[0])


def _install(tmp: str, path: str) -> None:
    """Move a finished export into place; an existing folder's old weights are replaced."""
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(path, f))
    os.rmdir(tmp)
