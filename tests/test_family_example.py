"""Adding a family (#53): tests/family_example.py, a module of the test folder, registers Phi-3 and posttrain
then loads a Phi-3 folder (logits equal transformers'), exports it (transformers reads the export back to the
same logits) and loads its own export, with no change to posttrain's hf_config.py. Without the module the
folder is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.models import from_pretrained, hf_config, save_pretrained
from posttrain.models.family import register_family, unregister_family

B, T = 2, 9
LENS = np.array([9, 5])


def _phi3_folder(path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("phi3", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms; q/k (the first 2/3 of qkv_proj's rows) scaled so RoPE matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("qkv_proj.weight"):
                p[: 2 * p.shape[0] // 3].mul_(8.0)
    model.save_pretrained(path)
    return str(path)


def _batch():
    toks = np.random.default_rng(0).integers(3, 97, (B, T))
    mask = (np.arange(T)[None] < LENS[:, None]).astype(np.int64)
    return toks, mask, np.broadcast_to(np.arange(T), (B, T)).copy()


def _hf_logits(path, toks, mask, pos):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(pos)).logits.numpy()


def _ours(model, toks, mask, pos):
    import jax.numpy as jnp

    return np.asarray(model(jnp.asarray(toks), jnp.asarray(pos), segment_ids=jnp.asarray(mask)).logits)


def _diff(a, b):
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(LENS))


@pytest.fixture
def phi3():
    """tests/family_example.py's family, registered for one test (its import registers it; the table is global)."""
    import family_example

    register_family(family_example.PHI3, replace=True)
    yield family_example.PHI3
    unregister_family("phi3")


def test_unregistered_family_is_refused_by_name(tmp_path):
    unregister_family("phi3")
    folder = _phi3_folder(tmp_path / "phi3")
    with pytest.raises(PosttrainError, match="model_type 'phi3'.*not supported; posttrain loads llama"):
        from_pretrained(folder)


@pytest.mark.parity
def test_family_from_the_test_folder_loads_and_exports(phi3, tmp_path):
    folder = _phi3_folder(tmp_path / "phi3")
    toks, mask, pos = _batch()
    model = from_pretrained(folder)
    assert (model.cfg.family, model.cfg.sliding_window, model.cfg.rope.partial) == ("phi3", 5, 0.5)
    ref = _hf_logits(folder, toks, mask, pos)
    ours = _ours(model, toks, mask, pos)
    assert _diff(ours, ref) <= 1e-4  # the fused names split right, the partial RoPE and the window as transformers

    # the special ids a tokenizer would give (Phi3Config's default pad id, 32000, is outside this tiny vocabulary)
    out = save_pretrained(model, str(tmp_path / "export"), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys and "model.layers.0.mlp.gate_up_proj.weight" in keys
    assert not any("q_proj" in k or "gate_proj" in k for k in keys)
    assert _diff(_hf_logits(out, toks, mask, pos), ref) <= 1e-5  # transformers reads the export: the same model
    again = from_pretrained(out)
    assert again.cfg == model.cfg
    assert _diff(_ours(again, toks, mask, pos), ours) == 0.0
    assert "phi3" not in open(hf_config.__file__).read()  # nothing in hf_config.py names the family
