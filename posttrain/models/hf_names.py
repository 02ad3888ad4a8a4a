"""Hugging Face tensor names <-> posttrain parameter paths (`weight_map`), for every family: what
`models/hf.py` reads and writes and `models/gguf.py` exports. Fused posttrain layouts (qkv, gate/up, experts)
are split back into HF names on the way out. A family module adds its own names (`gemma4.weight_names`,
`qwen3_5.weight_names`; Qwen3-Next's fused on-disk tensors: `qwen3_5.fused_names`)."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from posttrain.models import gemma4, qwen3_5
from posttrain.models.config import ModelConfig

# ----------------------------------------------------------------------------- weight names
# Each entry: posttrain path -> (HF keys, hf arrays -> posttrain array, posttrain array -> hf arrays[, alternative
# (HF keys, loader) read when the first key is missing: transformers' fused in-memory expert layout)].


def _expert_map(m: dict, cfg: ModelConfig, i: int, p: str) -> None:
    """Layer i's router and experts. On disk (what transformers 5.12 `save_pretrained` writes) every expert
    is its own Linear: qwen3_moe `mlp.experts.<e>.{gate,up,down}_proj`, mixtral
    `block_sparse_moe.experts.<e>.{w1,w3,w2}` (gate, up, down); in memory transformers fuses them into
    [E, 2F, D] `experts.gate_up_proj` and [E, D, F] `experts.down_proj`, which are read too."""
    E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_mlp_dim
    if cfg.family == "gpt_oss":
        return _gpt_oss_expert_map(m, cfg, i, p)
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


def _gpt_oss_expert_map(m: dict, cfg: ModelConfig, i: int, p: str) -> None:
    """GPT-OSS on disk: `mlp.router.{weight [E, D], bias [E]}`, `mlp.experts.gate_up_proj` [E, D, 2F] with gate
    and up interleaved (gate the even columns), `gate_up_proj_bias` [E, 2F], `down_proj` [E, F, D],
    `down_proj_bias` [E, D]."""
    E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_mlp_dim
    b, L = p + "mlp.", ("layers", i, "mlp")
    m[L + ("router",)] = ([b + "router.weight"], lambda w: w.T, lambda w: [w.T])
    m[L + ("router_bias",)] = ([b + "router.bias"], lambda w: w, lambda w: [w])
    m[L + ("expert_gate_up",)] = ([b + "experts.gate_up_proj"], lambda w: w.reshape(E, D, F, 2).transpose(0, 1, 3, 2),
                                  lambda w: [w.transpose(0, 1, 3, 2).reshape(E, D, 2 * F)])
    m[L + ("expert_gate_up_bias",)] = ([b + "experts.gate_up_proj_bias"],
                                       lambda w: w.reshape(E, F, 2).transpose(0, 2, 1),
                                       lambda w: [w.transpose(0, 2, 1).reshape(E, 2 * F)])
    m[L + ("expert_down",)] = ([b + "experts.down_proj"], lambda w: w, lambda w: [w])
    m[L + ("expert_down_bias",)] = ([b + "experts.down_proj_bias"], lambda w: w, lambda w: [w])


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
        if cfg.layer_type(i) != "linear":  # a Gated DeltaNet layer: qwen3_5.weight_names below
            _attn_map(m, cfg, i, a)
        if cfg.qk_norm and cfg.layer_type(i) != "linear":
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
    qwen3_5.weight_names(m, cfg, prefix)
    return m
