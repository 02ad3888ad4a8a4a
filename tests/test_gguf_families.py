"""GGUF export for each family whose llama.cpp architecture posttrain writes (llama, mistral, qwen2, qwen3, qwen3_moe,
gemma, gemma2, gemma3): a tiny random HF folder of the family, exported by `posttrain export --gguf`, read back by
transformers' own GGUF loader (the independent reader) gives the folder's logits to 1e-4, and `posttrain convert` of
the file gives back the folder's weights. transformers' reader has no `gemma` (Gemma 1) architecture: that file is
read back by `posttrain convert` and the converted folder by transformers. Families the architecture cannot express
are refused by name (tests/test_gguf.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hf_models import COMMON, hf_config
from test_gguf import _bpe_tokenizer, _hf_logits, _ids

from posttrain.cli import main

pytestmark = pytest.mark.slow

# What transformers' GGUF reader can read back: default RoPE (it reads no rope_freqs / scaling), no sliding window
# on llama; its qwen3 reader takes the head size from Qwen3Config's default (128), not the file's key_length. Gemma 2 /
# 3: the reader takes query_pre_attn_scalar (256) and Gemma 2's soft-caps (50, 30) from the config classes' defaults
# and Gemma 3's layer pattern (every 6th full) and sliding-layer RoPE base (10 000) too, as llama.cpp fixes them; so
# the tiny Gemmas have 256-wide heads (llama.cpp scales queries by head_dim^-1/2) and those values.
_GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
FAMILIES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "qwen3": {"head_dim": 128},
            "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                       "final_logit_softcapping": 30.0},
            "gemma3": {"head_dim": 256, "query_pre_attn_scalar": 256, "num_hidden_layers": 6,
                       "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "rope_parameters": _GEMMA3_ROPE},
            "qwen3_moe": {}}
# llama.cpp writes Mistral as llama; transformers names Gemma 3's text model gemma3_text
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3": "gemma3_text", "qwen3_moe": "qwen3_moe"}


def _hf_config(family):
    if family != "qwen3_moe":
        return hf_config(family)
    from transformers import AutoConfig

    # llama.cpp's qwen3moe: experts on every layer, renormalised top-k; transformers' reader takes the experts' width
    # from Qwen3MoeConfig's default (768), not the file's expert_feed_forward_length
    return AutoConfig.for_model("qwen3_moe", **dict(COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=768, norm_topk_prob=True))


def _folder(family, tmp_path, overrides):
    """A tiny random HF folder of `family` with the BPE tokenizer: (transformers model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = _bpe_tokenizer(tmp_path / "hf")
    cfg = _hf_config(family)
    cfg.vocab_size = len(tok)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases; q/k scaled so RoPE and the q/k norms matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.save_pretrained(tmp_path / "hf")
    return model, tok


def _same_weights(family, a_dir, b_dir, tied):
    """convert gave back the folder's weights: exactly, but Gemma's norms (stored as 1 + w: one rounding)."""
    from safetensors.numpy import load_file

    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert set(b) == set(a) - ({"lm_head.weight"} if tied else set())
    for k in b:
        if family.startswith("gemma") and k.endswith("norm.weight"):
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1.2e-7)
        else:
            assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_gguf_read_back_by_transformers(family, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model, tok = _folder(family, tmp_path, FAMILIES[family])
    path = str(tmp_path / f"{family}.gguf")
    assert main(["export", "--model", str(tmp_path / "hf"), "--gguf", path]) == 0
    ids = _ids(tok)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32)
    assert back.config.model_type == ARCH[family]
    err = float(np.abs(_hf_logits(back, ids) - _hf_logits(model, ids)).max())
    print(f"{family}: transformers' GGUF reader vs the HF folder, logits max|d| = {err:.3g}")
    assert err <= 1e-4, (family, err)
    assert main(["convert", "--gguf", path, "--out", str(tmp_path / "back")]) == 0
    _same_weights(family, tmp_path / "hf", tmp_path / "back", model.config.tie_word_embeddings)


def test_gemma_gguf_through_convert(tmp_path):
    """Gemma 1 (llama.cpp `gemma`; transformers' GGUF reader has no such architecture): the file holds llama.cpp's
    names and 1 + w norms, and `posttrain convert` gives a folder transformers reads to the original logits."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model, tok = _folder("gemma", tmp_path, {})
    path = str(tmp_path / "gemma.gguf")
    assert main(["export", "--model", str(tmp_path / "hf"), "--gguf", path]) == 0
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "gemma"
    assert r.fields["gemma.attention.key_length"].contents() == model.config.head_dim
    norm = next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight")
    ref = model.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(np.asarray(norm.data), ref + 1, rtol=0, atol=1.2e-7)
    assert "output.weight" not in {t.name for t in r.tensors}  # tied, as Gemma is
    assert main(["convert", "--gguf", path, "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "gemma"
    _same_weights("gemma", tmp_path / "hf", tmp_path / "back", True)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    ids = _ids(tok)
    err = float(np.abs(_hf_logits(back, ids) - _hf_logits(model, ids)).max())
    assert err <= 1e-4, err
