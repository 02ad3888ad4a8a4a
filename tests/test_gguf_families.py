"""GGUF export for each family whose llama.cpp architecture posttrain writes (llama, mistral, qwen2, qwen3): a tiny
random HF folder of the family, exported by `posttrain export --gguf`, read back by transformers' own GGUF loader
(the independent reader) gives the folder's logits to 1e-4, and `posttrain convert` of the file gives back the
folder's weights. Families the architecture cannot express are refused by name (tests/test_gguf.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hf_models import hf_config
from test_gguf import _bpe_tokenizer, _hf_logits, _ids

from posttrain.cli import main

pytestmark = pytest.mark.slow

# what transformers' GGUF reader can read back: default RoPE (it reads no rope_freqs / scaling), no sliding window;
# its qwen3 reader takes the head size from Qwen3Config's default (128), not the file's key_length
FAMILIES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "qwen3": {"head_dim": 128}}
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # llama.cpp writes Mistral as llama


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_gguf_read_back_by_transformers(family, tmp_path):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    tok = _bpe_tokenizer(tmp_path / "hf")
    cfg = hf_config(family)
    cfg.vocab_size = len(tok)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    for k, v in FAMILIES[family].items():
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
    path = str(tmp_path / f"{family}.gguf")
    assert main(["export", "--model", str(tmp_path / "hf"), "--gguf", path]) == 0
    ids = _ids(tok)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32)
    assert back.config.model_type == ARCH[family]
    err = float(np.abs(_hf_logits(back, ids) - _hf_logits(model, ids)).max())
    print(f"{family}: transformers' GGUF reader vs the HF folder, logits max|d| = {err:.3g}")
    assert err <= 1e-4, (family, err)
    assert main(["convert", "--gguf", path, "--out", str(tmp_path / "back")]) == 0
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(b) == set(a) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert all(np.array_equal(a[k], b[k]) for k in b)
