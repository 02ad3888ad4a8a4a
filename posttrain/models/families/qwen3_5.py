"""Qwen3.5 text (transformers `qwen3_5_text`, `Qwen3_5ForCausalLM`): config fields both ways and the Hugging Face
names of its linear-attention layers. A family module, not a model: the one Transformer runs it.

What Qwen3.5 text is, per transformers 5.12 `models/qwen3_5/modeling_qwen3_5.py` (each a ModelConfig field):
  - hybrid layers (`layer_types`): "linear_attention" layers are Gated DeltaNet (`models/deltanet.py`: its own
    key / value heads and sizes, a causal depthwise convolution of `linear_conv_kernel_dim` taps), every
    `full_attention_interval`-th layer (default 4) is full attention;
  - full attention with an output gate (`attn_output_gate`): q_proj makes [q | gate] per head, the attention
    output is multiplied by sigmoid(gate) before o_proj; q and k RMSNorms;
  - RoPE on the first `partial_rotary_factor` (default 0.25) of each head's dimensions (rotate-half within them);
    text positions only (the vision model's interleaved M-RoPE reduces to this when every axis has the same
    position);
  - every RMSNorm scales by (1 + w) except the linear layers' gated output norm (w).

Qwen3.5-MoE text (`qwen3_5_moe_text`, `Qwen3_5MoeForCausalLM`) is the same with every MLP a sparse block: a
softmax router with renormalised top-k weights over fused experts, plus a shared expert (a gated MLP of
`shared_expert_intermediate_size`) scaled per token by sigmoid(shared_expert_gate(x)).

Qwen3-Next (`qwen3_next`, `Qwen3NextForCausalLM`) is the model Qwen3.5-MoE was derived from: the same layers, but
each linear layer's projections are fused and interleaved by key-head group on disk (`in_proj_qkvz`: per group
[q | k | v | z], `in_proj_ba`: per group [b | a]; `fused_names` splits and joins them), its dense layers
(`mlp_only_layers`, `decoder_sparse_step`) are plain MLPs of `intermediate_size`, and `norm_topk_prob` is a choice.
In memory it is a Qwen3.5-MoE model (the same parameters), so everything that runs one runs the other.

What it is not: the vision tower of a `qwen3_5` / `qwen3_5_moe` folder; the multi-token-prediction layer.
"""

from __future__ import annotations

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.deltanet import grouped_channels
from posttrain.models.family import Family, no_router_jitter, register_family, rope_from_hf

MODEL_TYPE = "qwen3_5_text"
MOE_TYPE = "qwen3_5_moe_text"
NEXT_TYPE = "qwen3_next"
TYPES = (MODEL_TYPE, MOE_TYPE, NEXT_TYPE)
DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=32768,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4)
MOE_DEFAULTS = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, head_dim=256, max_position_embeddings=32768, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=32, full_attention_interval=4, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
                    router_aux_loss_coef=0.001)
NEXT_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=256, max_position_embeddings=32768,
                     linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                     moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
                     num_experts=512, norm_topk_prob=True, router_aux_loss_coef=0.001, mlp_only_layers=None)


def post_init(d: dict) -> None:
    """Qwen3_5TextConfig / Qwen3NextConfig.__post_init__: layer types from full_attention_interval; partial rotary
    0.25; no dense-only layers."""
    if d.get("mlp_only_layers") is None:
        d["mlp_only_layers"] = []
    if d.get("layer_types") is None:
        every = d.get("full_attention_interval") or 4
        d["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    if d.get("partial_rotary_factor") is None:  # also under a legacy rope_scaling, which replaces rope_parameters
        d["partial_rotary_factor"] = 0.25
    rp = dict(d.get("rope_parameters") or {})
    rp.setdefault("rope_type", "default")
    rp.setdefault("rope_theta", d.get("rope_theta") or 10_000.0)
    rp.setdefault("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    d["rope_parameters"] = rp


def config_fields(hf, where: str) -> dict:
    """The Qwen3.5 ModelConfig fields of a transformers Qwen3_5TextConfig (the rest are hf_config's common ones):
    RoPE on the partial_rotary_factor share of each head, the hybrid layers; the experts of the MoE types."""
    rp = getattr(hf, "rope_parameters", None) or {}
    kw = dict(rope=rope_from_hf(rp, partial=float(rp.get("partial_rotary_factor", 1.0))))
    kw.update(_layer_fields(hf, where))
    if hf.model_type in (MOE_TYPE, NEXT_TYPE):
        no_router_jitter(hf, where)
        kw.update(moe_fields(hf, where))
    return kw


def _layer_fields(hf, where: str) -> dict:
    if getattr(hf, "attention_dropout", 0.0):
        raise PosttrainError(f"{where}: attention_dropout = {hf.attention_dropout} is not supported; set it to 0")
    bad = sorted(set(hf.layer_types) - {"linear_attention", "full_attention"})
    if bad:
        raise PosttrainError(f"{where}: layer_types {bad} are not supported (linear_attention, full_attention are)")
    return dict(norm_unit_offset=True, qk_norm=True, attn_output_gate=True,
                layer_types=tuple("linear" if t == "linear_attention" else "full" for t in hf.layer_types),
                linear_key_heads=hf.linear_num_key_heads, linear_value_heads=hf.linear_num_value_heads,
                linear_key_dim=hf.linear_key_head_dim, linear_value_dim=hf.linear_value_head_dim,
                linear_conv_kernel=hf.linear_conv_kernel_dim)


def moe_fields(hf, where: str = "config.json") -> dict:
    """The mixture-of-experts ModelConfig fields of a Qwen3_5MoeTextConfig (every layer sparse, renormalised
    top-k) or a Qwen3NextConfig (dense layers where `mlp_only_layers` or `decoder_sparse_step` say; no experts at
    all when num_experts is 0)."""
    if hf.model_type == NEXT_TYPE and hf.num_experts <= 0:
        return {}
    if not hf.shared_expert_intermediate_size:
        raise PosttrainError(f"{where}: shared_expert_intermediate_size = 0 is not supported (its sparse layers have "
                             "a shared expert); give the shared expert's width")
    dense = ()
    if hf.model_type == NEXT_TYPE:
        only, step = set(hf.mlp_only_layers or ()), hf.decoder_sparse_step or 1
        dense = tuple(i for i in range(hf.num_hidden_layers) if i in only or (i + 1) % step)
    return dict(num_experts=hf.num_experts, experts_per_token=hf.num_experts_per_tok,
                expert_mlp_dim=hf.moe_intermediate_size, dense_layers=dense,
                norm_topk_prob=hf.model_type == MOE_TYPE or bool(hf.norm_topk_prob),
                shared_expert_dim=hf.shared_expert_intermediate_size,
                router_aux_loss_coef=float(hf.router_aux_loss_coef))


def moe_to_hf(cfg: ModelConfig, model_type: str = MOE_TYPE) -> dict:
    """The mixture-of-experts fields of an exported Qwen3.5-MoE or Qwen3-Next config.json."""
    if model_type == NEXT_TYPE:
        if cfg.num_experts and not cfg.shared_expert_dim:
            raise PosttrainError("cannot export as qwen3_next: its sparse layers have a shared expert")
        return dict(num_experts=cfg.num_experts, num_experts_per_tok=max(cfg.experts_per_token, 1),
                    moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
                    shared_expert_intermediate_size=cfg.shared_expert_dim or cfg.mlp_dim, decoder_sparse_step=1,
                    mlp_only_layers=sorted(cfg.dense_layers), router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.dense_layers or not cfg.norm_topk_prob or not cfg.num_experts or not cfg.shared_expert_dim:
        raise PosttrainError("cannot export as qwen3_5_moe_text: Qwen3.5-MoE has experts on every layer, "
                             "renormalised top-k weights and a shared expert")
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.expert_mlp_dim, shared_expert_intermediate_size=cfg.shared_expert_dim,
                router_aux_loss_coef=cfg.router_aux_loss_coef)


def config_to_hf(cfg: ModelConfig, d: dict) -> None:
    """The Qwen3.5 fields of an exported config.json (into d); the experts of the MoE types."""
    mt = d["model_type"]
    if mt in (MOE_TYPE, NEXT_TYPE):
        d.update(moe_to_hf(cfg, mt))
    if cfg.shared_expert_dim and cfg.family == "qwen3_5_moe":  # Qwen3.5-MoE has no dense MLP
        d.pop("intermediate_size", None)
    d.update(linear_num_key_heads=cfg.linear_key_heads, linear_num_value_heads=cfg.linear_value_heads,
             linear_key_head_dim=cfg.linear_key_dim, linear_value_head_dim=cfg.linear_value_dim,
             linear_conv_kernel_dim=cfg.linear_conv_kernel, attention_bias=False,
             layer_types=["linear_attention" if cfg.layer_type(i) == "linear" else "full_attention"
                          for i in range(cfg.num_layers)])


def fused_names(cfg: ModelConfig, prefix: str = "model.") -> dict:
    """Qwen3-Next's fused on-disk tensors: HF key -> (the Qwen3.5 keys it holds, split(fused) -> their arrays,
    join(*arrays) -> fused). Every linear layer's `in_proj_qkvz` [Kh * (2 dk + 2 r dv), D] holds, per key head g,
    [q_g | k_g | v and z of its r = value heads / key heads value heads], and `in_proj_ba` [Kh * 2r, D] per key
    head [b_g | a_g]; Qwen3.5's in_proj_qkv is [all q | all k | all v], in_proj_z, _b, _a one row per value head,
    value heads in order (head h reads key head h // r in both)."""
    if cfg.family != "qwen3_next":
        return {}
    Kh, dk, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
    r = cfg.linear_value_heads // Kh
    sizes = (dk, dk, r * dv, r * dv)

    def split_qkvz(w):
        q, k, v, z = np.split(w.reshape(Kh, sum(sizes), -1), np.cumsum(sizes)[:-1], axis=1)
        return [np.concatenate([x.reshape(-1, w.shape[-1]) for x in (q, k, v)]), z.reshape(-1, w.shape[-1])]

    def join_qkvz(qkv, z):
        D = qkv.shape[-1]
        q, k, v = np.split(qkv, [Kh * dk, 2 * Kh * dk])
        parts = (q.reshape(Kh, dk, D), k.reshape(Kh, dk, D), v.reshape(Kh, r * dv, D), z.reshape(Kh, r * dv, D))
        return np.concatenate(parts, axis=1).reshape(-1, D)

    def split_ba(w):
        b, a = np.split(w.reshape(Kh, 2 * r, -1), 2, axis=1)
        return [b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])]

    def join_ba(b, a):
        D = b.shape[-1]
        return np.concatenate([b.reshape(Kh, r, D), a.reshape(Kh, r, D)], axis=1).reshape(-1, D)

    out = {}
    for i in range(cfg.num_layers):
        if cfg.layer_type(i) == "linear":
            p = f"{prefix}layers.{i}.linear_attn."
            out[p + "in_proj_qkvz.weight"] = ([p + "in_proj_qkv.weight", p + "in_proj_z.weight"], split_qkvz,
                                              join_qkvz)
            out[p + "in_proj_ba.weight"] = ([p + "in_proj_b.weight", p + "in_proj_a.weight"], split_ba, join_ba)
    return out


def weight_names(m: dict, cfg: ModelConfig, prefix: str) -> None:
    """posttrain path -> (HF keys, load, save) for each linear-attention layer's Gated DeltaNet (HF Linear weights
    are [out, in], ours [in, out]; conv1d.weight [C, 1, K] is kept as [C, K]). Qwen3-Next's layers are named
    as Qwen3.5's here; `fused_names` maps them to its fused tensors."""
    linear = any(cfg.layer_type(i) == "linear" for i in range(cfg.num_layers))
    perm = linear and grouped_channels(cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                                       cfg.linear_value_dim)
    inv = linear and np.argsort(perm)
    for i in range(cfg.num_layers):
        if cfg.layer_type(i) != "linear":
            continue
        p, L = f"{prefix}layers.{i}.linear_attn.", ("layers", i, "linear")
        for name in ("in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            m[L + (name,)] = ([p + name + ".weight"], lambda w: w.T, lambda w: [w.T])
        # in_proj_qkv's and conv's channels grouped by key head here (models/deltanet.py), HF's [q | k | v] there
        m[L + ("in_proj_qkv",)] = ([p + "in_proj_qkv.weight"], lambda w: w[perm].T, lambda w: [w.T[inv]])
        m[L + ("conv",)] = ([p + "conv1d.weight"], lambda w: w[perm, 0], lambda w: [np.asarray(w)[inv, None]])
        for name in ("dt_bias", "A_log"):
            m[L + (name,)] = ([p + name], lambda w: w, lambda w: [w])
        m[L + ("norm",)] = ([p + "norm.weight"], lambda w: w, lambda w: [w])
    if not cfg.shared_expert_dim:
        return
    for i in range(cfg.num_layers):  # each sparse layer's shared expert and its gate (Linear(D, 1): [1, D])
        if not cfg.is_moe_layer(i):
            continue
        p, L = f"{prefix}layers.{i}.mlp.", ("layers", i)
        m[L + ("shared", "gate_up")] = ([p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight"],
                                         lambda g, u: np.stack([g.T, u.T], axis=1), lambda w: [w[:, 0].T, w[:, 1].T])
        m[L + ("shared", "down")] = ([p + "shared_expert.down_proj.weight"], lambda w: w.T, lambda w: [w.T])
        m[L + ("shared_gate",)] = ([p + "shared_expert_gate.weight"], lambda w: w.T, lambda w: [w.T])


_COMMON = dict(post_init=post_init, config_fields=config_fields, config_to_hf=config_to_hf,
               weight_names=weight_names)
QWEN3_5 = register_family(Family(name="qwen3_5", model_type=MODEL_TYPE, architecture="Qwen3_5ForCausalLM",
                                 defaults=DEFAULTS, **_COMMON))
QWEN3_5_MOE = register_family(Family(name="qwen3_5_moe", model_type=MOE_TYPE, architecture="Qwen3_5MoeForCausalLM",
                                     defaults=MOE_DEFAULTS, moe=True, **_COMMON))
QWEN3_NEXT = register_family(Family(name="qwen3_next", model_type=NEXT_TYPE, architecture="Qwen3NextForCausalLM",
                                    defaults=NEXT_DEFAULTS, moe=True, fused_names=fused_names, **_COMMON))
