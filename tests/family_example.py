"""A model family defined outside posttrain, as a user's module would define one: Phi-3 (transformers `phi3`,
`Phi3ForCausalLM`). docs/models.md, "Adding a family", walks through this file.

Phi-3 is a Llama in everything but two things, both declared below and nothing else:
  - its q, k and v projections are one fused Linear on disk (`self_attn.qkv_proj`: q rows, then k, then v) and so
    are the MLP's gate and up projections (`mlp.gate_up_proj`: gate rows, then up rows): a weight-name hook
    replaces the common entries (q_proj / k_proj / v_proj, gate_proj / up_proj) by the fused names, composing the
    common entries' own load / save;
  - RoPE may rotate only the first `partial_rotary_factor` of each head (the rest passes through), and a
    `sliding_window` slides every layer.
Per transformers 5.12 `models/phi3/configuration_phi3.py` (the defaults) and `modeling_phi3.py`. LongRoPE
(`rope_type: longrope`, Phi-3's 128k variants) is not supported: rope_from_hf refuses it by name.
"""

from __future__ import annotations

import numpy as np

from posttrain.models.family import Family, register_family, rope_from_hf


def config_fields(hf, where: str) -> dict:
    """config.json -> the ModelConfig fields beyond the common ones: RoPE on a share of each head."""
    rp = getattr(hf, "rope_parameters", None) or {}
    return dict(rope=rope_from_hf(rp, partial=float(rp.get("partial_rotary_factor", 1.0))))


def weight_names(m: dict, cfg, prefix: str) -> None:
    """Phi-3's fused tensors in place of the common names: each entry's load splits the fused tensor into what
    the common entry reads, its save joins what the common entry writes."""
    for i in range(cfg.num_layers):
        p, L = f"{prefix}layers.{i}.", ("layers", i)
        q = cfg.num_heads * cfg.head_dim  # rows of q; k and v have num_kv_heads * head_dim each
        _, load, save = m[L + ("attn", "qkv")]
        m[L + ("attn", "qkv")] = (
            [p + "self_attn.qkv_proj.weight"],
            lambda w, load=load, q=q: load(*np.split(w, [q, q + (w.shape[0] - q) // 2])),
            lambda a, save=save: [np.concatenate(save(a))])
        _, load, save = m[L + ("mlp", "gate_up")]
        m[L + ("mlp", "gate_up")] = ([p + "mlp.gate_up_proj.weight"], lambda w, load=load: load(*np.split(w, 2)),
                                     lambda a, save=save: [np.concatenate(save(a))])


PHI3 = register_family(Family(
    name="phi3", model_type="phi3", architecture="Phi3ForCausalLM", classifier="Phi3ForSequenceClassification",
    defaults=dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5),
    config_fields=config_fields, window_everywhere=True, weight_names=weight_names), replace=True)
