"""config.json is read without transformers (posttrain.models.hf_config.HFConfig) exactly as transformers'
AutoConfig reads it: the same ModelConfig for every supported family, from configs transformers writes and
from older hand-written ones (legacy rope_scaling / rope_theta keys, fields left to their defaults)."""

import json
import subprocess
import sys

import pytest
from hf_models import COMMON, FAMILIES

from posttrain.models.hf_config import config_from_hf, read_hf_config


def _both(folder, raw=None):
    from transformers import AutoConfig

    if raw is not None:
        (folder / "config.json").write_text(json.dumps(raw))
    raw = json.loads((folder / "config.json").read_text())
    # transformers >= 5.15 keeps Gemma 4's full-attention head_dim / kv heads in per_layer_config (an object whose
    # head_dim raises on a bare read; save_pretrained writes per_layer_config): config_from_hf reads both forms
    hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    ours, tied = read_hf_config(raw)
    if raw.get("model_type") == "gemma4":
        theirs = config_from_hf(hf.text_config).replace(tie_embeddings=bool(hf.tie_word_embeddings))
        return theirs, config_from_hf(ours).replace(tie_embeddings=tied)
    return config_from_hf(hf), config_from_hf(ours)


TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "gemma4_text", "qwen3_moe", "mixtral",
         "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_test_families_read_the_same(family, tmp_path):
    from transformers import AutoConfig

    kw = dict(COMMON, **FAMILIES[family])
    AutoConfig.for_model(kw.pop("model_type"), **kw).save_pretrained(str(tmp_path))
    theirs, ours = _both(tmp_path)
    assert ours == theirs


@pytest.mark.parametrize("mt", TYPES)
def test_class_defaults_read_the_same(mt, tmp_path):
    """A config.json that leaves every field to its family's default (what to_diff_dict drops)."""
    theirs, ours = _both(tmp_path, {"model_type": mt})
    assert ours == theirs


LEGACY = {
    "llama3_rope_scaling": dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                intermediate_size=96, vocab_size=97, rope_theta=500000.0, max_position_embeddings=128,
                                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=32)),
    "linear_type_key": dict(model_type="llama", rope_theta=20000.0, rope_scaling=dict(type="linear", factor=2.0)),
    "mistral_no_head_dim": dict(model_type="mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               sliding_window=7),
    "qwen2_sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1,
                          num_hidden_layers=3, rope_theta=1e6, tie_word_embeddings=True),
    "qwen3_no_sliding": dict(model_type="qwen3", use_sliding_window=False, sliding_window=16, rope_theta=1e6),
    "gemma3_local_base_freq": dict(model_type="gemma3_text", num_hidden_layers=7, rope_theta=1e6,
                                   rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=8.0),
                                   sliding_window=64, sliding_window_pattern=6),
    "gemma2_defaults": dict(model_type="gemma2", num_hidden_layers=4, rope_theta=1e4),
    "qwen3_moe_num_experts": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                                  decoder_sparse_step=2, mlp_only_layers=[0], head_dim=16, norm_topk_prob=True),
    "mixtral_minimal": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_next_sparse_step": dict(model_type="qwen3_next", num_hidden_layers=6, decoder_sparse_step=2,
                                   mlp_only_layers=[3], norm_topk_prob=False, full_attention_interval=3),
    "qwen3_next_dense": dict(model_type="qwen3_next", num_hidden_layers=4, num_experts=0),
    "qwen3_next_yarn_rope_scaling": dict(model_type="qwen3_next", num_hidden_layers=4, rope_theta=1e7,
                                         rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                           original_max_position_embeddings=32768)),
    "qwen3_5_partial_half": dict(model_type="qwen3_5_text", num_hidden_layers=4, partial_rotary_factor=0.5),
    "gemma4_text_defaults": dict(model_type="gemma4_text", num_hidden_layers=5),
    "gemma4_multimodal": dict(model_type="gemma4", tie_word_embeddings=False,
                              text_config=dict(model_type="gemma4_text", num_hidden_layers=4, hidden_size=32,
                                               num_attention_heads=4, head_dim=8, global_head_dim=16)),
}


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_legacy_and_partial_configs_read_the_same(case, tmp_path):
    theirs, ours = _both(tmp_path, LEGACY[case])
    assert ours == theirs


def test_loading_a_model_folder_imports_no_torch(tmp_path):
    """config.json, the tokenizer and the weights load with jax + tokenizers + jinja2 alone."""
    from posttrain.models import Transformer, preset, save_pretrained
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    from flax import nnx

    save_pretrained(Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), str(tmp_path / "m"),
                    tokenizer=tok)
    code = (f"import sys\nfrom posttrain.models import from_pretrained\nfrom posttrain.tokenizer import Tokenizer\n"
            f"t = Tokenizer.from_pretrained({str(tmp_path / 'm')!r})\nm = from_pretrained({str(tmp_path / 'm')!r})\n"
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
            "print(sorted(k for k in ('torch', 'transformers') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_gemma4_per_layer_config_reads_as_the_global_fields():
    """transformers >= 5.15 writes Gemma 4's full layers' head size and kv heads as per_layer_config, keyed by layer
    (what 5.25.0's save_pretrained writes for the flat config below: no global_head_dim key): the same ModelConfig."""
    flat = dict(model_type="gemma4_text", num_hidden_layers=6, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, attention_k_eq_v=True, global_head_dim=16,
                num_global_key_value_heads=1)
    per_layer = {k: v for k, v in flat.items() if "global" not in k}
    per_layer["per_layer_config"] = {"05": {"head_dim": 16, "num_key_value_heads": 1}}
    a, b = (config_from_hf(read_hf_config(raw)[0]) for raw in (flat, per_layer))
    assert a == b and (b.global_head_dim, b.global_kv_heads) == (16, 1)
    same = dict(per_layer, attention_k_eq_v=False, per_layer_config={})  # full layers as wide as the sliding ones
    assert config_from_hf(read_hf_config(same)[0]).global_head_dim == 8
