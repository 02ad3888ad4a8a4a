"""Tiny random Hugging Face checkpoints of every supported family, built locally with transformers.

Shapes are small enough that a float32 forward takes milliseconds, yet exercise each family's
features: GQA (4 query heads over 2 kv heads), qkv bias, q/k norm, sliding windows shorter than
the test sequences, soft-capping, llama3 / linear RoPE scaling and tied embeddings, with q/k projections scaled
so attention scores are of order 1 (QK_SCALE) and each of those features moves the logits well above 1e-4.
"""

from __future__ import annotations

import os

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": dict(model_type="llama", head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=32)),
    "qwen2": dict(model_type="qwen2", rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    "qwen3": dict(model_type="qwen3", head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    "mistral": dict(model_type="mistral", head_dim=16, sliding_window=5, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    "gemma": dict(model_type="gemma", head_dim=16, hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6),
    "gemma2": dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                   num_hidden_layers=4, layer_types=["sliding_attention", "full_attention",
                                                     "sliding_attention", "sliding_attention"],
                   rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0),
                                    "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
}


# q and k projections x 8 (attention scores x 64, of order 1 to 10 instead of HF's 0.02-init ~0.03), as test_gemma4 and
# test_qwen3_5 scale their weights: at HF's init the attention is nearly uniform, so Gemma 2's attention soft-cap
# (5.0) moved the logits 3e-6 and a doubled RoPE base 3e-5 (llama), under the 1e-4 parity bound; x 8: 7e-2 and
# 2e-3. Families with q/k norms (qwen3, gemma3) normalise this away; their RoPE errors show without it (1e-3, 2e-2).
# scripts/mutation_check.py measures what each parity test sees (docs/testing.md).
QK_SCALE = 8.0


def hf_config(family: str):
    from transformers import AutoConfig

    kw = dict(COMMON)
    kw.update(FAMILIES[family])
    mt = kw.pop("model_type")
    return AutoConfig.for_model(mt, **kw)


def make_checkpoint(family: str, path: str, seed: int = 0, tokenizer=None) -> str:
    """Random-weight HF checkpoint of `family` saved at `path` (float32 safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm weights, so a (1 + w) vs w mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return os.fspath(path)


def qwen3_vl_model(text: dict, vision: dict, *, image: int, video: int, start: int, end: int):
    """A tiny random transformers Qwen3VLForConditionalGeneration (float32, untied head) whose features show: norms
    and biases moved off their initial values, embeddings, head and the tower's position table at scale 0.5, and
    the text q/k projections and the tower's q and k rows scaled by QK_SCALE (attention not uniform). Draws from
    torch's global generator: seed it first."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(config).float()
    D = vision["hidden_size"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name or "pos_embed" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
            elif name.endswith("attn.qkv.weight"):  # the tower's q and k rows
                p[:2 * D].mul_(QK_SCALE)
            elif name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def gemma3_vl_model(text: dict, vision: dict, *, mm_tokens: int, image: int, boi: int, eoi: int):
    """A tiny random transformers Gemma3ForConditionalGeneration (float32) whose features show: norms and biases
    moved off their initial values, the text q/k projections scaled by QK_SCALE (attention not uniform), the
    projector at scale 0.2 (transformers starts it at zero). Draws from torch's global generator: seed it first."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens,
                       image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    model = Gemma3ForConditionalGeneration(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
            elif name.endswith("mm_input_projection_weight"):
                p.copy_(0.2 * torch.randn_like(p))
    return model
