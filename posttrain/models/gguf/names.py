"""GGUF <-> transformers: the tables both directions share (architectures, tensor names, the fields each
architecture expresses) and the q/k permutation and rope-factor helpers. `models.gguf` says what is read and written."""

from __future__ import annotations

import math

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.models.config import RopeConfig

# GGUF general.architecture values convert reads
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3")
# family -> GGUF arch (llama.cpp writes Mistral as llama)
EXPORT_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                   "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3"}
FAMILY_OF_ARCH = {"qwen3moe": "qwen3_moe"}  # GGUF arch -> posttrain family, where the names differ
# llama.cpp's stacked experts [E, ...] <-> transformers' (on disk) one Linear per expert
EXPERTS = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
            "ffn_down_exps.weight": "down_proj.weight"}
GEMMA = ("gemma", "gemma2", "gemma3")  # llama.cpp stores their norms as 1 + w and scales the embeddings itself
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")

# llama.cpp tensor names <-> transformers' (per layer: "blk.{i}." <-> "model.layers.{i}.").
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
          "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma 2 / 3's sandwich norms (gguf-py: ATTN_POST_NORM, FFN_PRE_NORM = ffn_norm, FFN_POST_NORM)
_SANDWICH = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
GLOBAL_BACK = {v: k for k, v in GLOBAL.items()}

# ModelConfig fields, beyond a plain Llama's, that each GGUF architecture expresses; and those it must have
FIELDS = ("sliding_window", "num_experts", "layer_types", "sandwich_norm", "attn_softcap", "final_softcap",
           "query_scale", "embed_scale", "norm_unit_offset", "qkv_bias", "qk_norm", "rope_local")
_GEMMA_FIELDS = ("norm_unit_offset", "embed_scale")
ALLOWED = {"llama": (), "qwen2": ("qkv_bias",), "qwen3": ("qk_norm",), "qwen3moe": ("qk_norm", "num_experts"),
            "gemma": _GEMMA_FIELDS,
            "gemma2": _GEMMA_FIELDS + ("sandwich_norm", "attn_softcap", "final_softcap", "query_scale",
                                       "sliding_window", "layer_types"),
            "gemma3": _GEMMA_FIELDS + ("sandwich_norm", "qk_norm", "query_scale", "sliding_window", "layer_types",
                                       "rope_local")}
REQUIRED = {"qwen3": ("qk_norm",), "qwen3moe": ("qk_norm", "num_experts", "norm_topk_prob"), "gemma": _GEMMA_FIELDS,
             "gemma2": _GEMMA_FIELDS + ("sandwich_norm", "attn_softcap", "final_softcap"),
             "gemma3": _GEMMA_FIELDS + ("sandwich_norm", "qk_norm")}
# llama.cpp's fixed sliding patterns (llama-model.cpp set_swa_pattern): Gemma 2 every 2nd layer full, Gemma 3 every
# 6th; Gemma 3's sliding layers rotate with base 10 000 (rope_freq_base_train_swa)
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_THETA = 10_000.0


def layer_tensor_names(arch: str) -> dict:
    """llama.cpp's per-layer tensor names -> transformers' (after "blk.{i}." / "model.layers.{i}."); a qwen3moe
    layer's experts are EXPERTS'."""
    if arch == "qwen3moe":
        return {**_LAYER, "ffn_gate_inp.weight": "mlp.gate.weight"}
    return {**_LAYER, **_SANDWICH} if arch in ("gemma2", "gemma3") else _LAYER


def permute(w: np.ndarray, n_head: int, reverse: bool) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, rows [0, 2, 4, ..., 1, 3, ...] of HF's rotate-half layout
    become interleaved pairs. Forward (HF -> GGUF) is llama.cpp's `permute`; reverse is transformers'
    `_reverse_permute_weights`. Works for weights [rows, D] and biases [rows]."""
    half = w.shape[0] // n_head // 2
    if reverse:
        return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(r: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores as rope_freqs.weight for llama3 rope scaling
    (convert_hf_to_gguf.py LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (r.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl, high_wl = r.original_max_position / r.low_freq_factor, r.original_max_position / r.high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(r.factor)
        else:
            s = (r.original_max_position / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
            out.append(1 / ((1 - s) / r.factor + s))
    return np.asarray(out, dtype=np.float32)


def rope_from_factors(factors: np.ndarray, theta: float, head_dim: int, where: str) -> RopeConfig:
    """The llama3 RopeConfig whose factors are `factors` (Llama 3.1/3.2 use low 1, high 4; the pre-training
    length is searched over powers of two), or an error naming the tensor."""
    factor = float(factors.max())
    for low, high in ((1.0, 4.0),):
        for k in range(4, 21):
            r = RopeConfig(theta=theta, kind="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                           original_max_position=2 ** k)
            if np.allclose(llama3_factors(r, head_dim), factors, rtol=1e-5, atol=1e-6):
                return r
    raise PosttrainError(f"{where}: tensor rope_freqs.weight holds rope factors that are not Llama 3's rope scaling "
                         "(low_freq_factor 1, high_freq_factor 4); posttrain cannot express them")
