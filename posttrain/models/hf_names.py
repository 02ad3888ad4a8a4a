"""Hugging Face tensor names <-> posttrain parameter paths (`weight_map`), for every family: what
`models/hf.py` reads and writes and `models/gguf/` exports. Fused posttrain layouts (qkv, gate/up, experts)
are split back into HF names on the way out. A family adds or replaces names through its Family record
(`models/family.py`: `weight_names`, `expert_names`; Qwen3-Next's fused on-disk tensors: `fused_names`); a
vision-language folder's tower names come from its `VisionFamily.weight_names` around these (`hf.py`)."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from posttrain.models.config import ModelConfig
from posttrain.models.families import family_named
from posttrain.models.family import routed_expert_names

# ----------------------------------------------------------------------------- weight names
# Each entry: posttrain path -> (HF keys, hf arrays -> posttrain array, posttrain array -> hf arrays[, alternative
# (HF keys, loader) read when the first key is missing: transformers' fused in-memory expert layout)].


def _attn_map(m: dict, cfg: ModelConfig, i: int, a: str) -> None:
    """Layer i's attention: q/k/v (k/v only where the layer has them: `Attention.kv_slots`) <-> fused qkv, o."""
    D, K, H = cfg.embed_dim, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
    G = cfg.num_heads // K
    c = cfg.layer_kv_slots(i)
    L = ("layers", i, "attn")
    if cfg.attn_output_gate:  # Qwen3.5: q_proj makes [q | gate] per query head; here G query then G gate slots
        m[L + ("qkv",)] = (
            [a + n + "_proj.weight" for n in "qkv"[:1 + c]],
            lambda q, *kv: np.concatenate([q.T.reshape(D, K, G, 2, H)[:, :, :, 0], q.T.reshape(D, K, G, 2, H)[
                :, :, :, 1]] + [w.T.reshape(D, K, 1, H) for w in kv], axis=2),
            lambda w: [np.stack([w[:, :, :G], w[:, :, G:2 * G]], axis=3).reshape(D, K * G * 2 * H).T]
            + [w[:, :, 2 * G + j].reshape(D, K * H).T for j in range(c)])
        m[L + ("o",)] = ([a + "o_proj.weight"], lambda w: w.T.reshape(K, G, H, D),
                         lambda w: [w.reshape(K * G * H, D).T])
        return
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
    if cfg.o_bias:
        m[L + ("o_bias",)] = ([a + "o_proj.bias"], lambda w: w, lambda w: [w])
    if cfg.attn_sinks:  # HF [N] per query head; here [K, G]
        m[L + ("sinks",)] = ([a + "sinks"], lambda w: w.reshape(K, G), lambda w: [w.reshape(-1)])


def weight_map(cfg: ModelConfig, head: Optional[str] = None,
               prefix: str = "model.") -> dict[tuple, tuple[list[str], Callable, Callable]]:
    """head=None: the causal LM (lm_head unless tied); "score": a sequence classifier (score, no lm_head).
    prefix: where the backbone's weights live (a multimodal folder: its family's `text_prefix`). The text model's
    names only: a vision-language model's whole map is its family's `VisionFamily.weight_names` around this one."""
    fam = family_named(cfg.family)
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
        if cfg.layer_type(i) != "linear":  # a Gated DeltaNet layer: qwen3_5.weight_names below
            _attn_map(m, cfg, i, a)
        if cfg.qk_norm and cfg.layer_type(i) != "linear":
            m[("layers", i, "attn", "q_norm", "scale")] = ([a + "q_norm.weight"], *ident)
            if cfg.kv_source(i) is None:  # a KV-shared layer has no k
                m[("layers", i, "attn", "k_norm", "scale")] = ([a + "k_norm.weight"], *ident)
        if cfg.is_moe_layer(i) and not cfg.moe_beside_mlp:
            (fam.expert_names if fam and fam.expert_names else routed_expert_names)(m, cfg, i, p)
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
    if fam is not None:
        fam.weight_names(m, cfg, prefix)
    return m


def fused_names(cfg: ModelConfig, prefix: str = "model.") -> dict:
    """HF key on disk -> ([the HF keys of weight_map it holds], split, join): a family's fused tensors."""
    fam = family_named(cfg.family)
    return fam.fused_names(cfg, prefix) if fam is not None else {}
