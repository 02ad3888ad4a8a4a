"""Gemma 4 text against Hugging Face transformers: logits, greedy decoding with the KV cache, export, presets,
the multimodal folder's text model, unsupported options.

Two tiny random checkpoints built locally with transformers' `save_pretrained`, both with keys as values
on the global layers (their own head size and kv heads), proportional RoPE and a sliding window of 4
tokens (shorter than the rows): "dense" adds per-layer input embeddings and two KV-shared layers (one
sliding, one global) with double-wide MLPs; "moe" adds the routed experts beside every dense MLP.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.models import Transformer, count_params, from_pretrained, preset, save_pretrained
from posttrain.models.hf import config_from_hf, config_to_hf

V = 128
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=4,
            final_logit_softcapping=5.0, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 1e6}})
CASES = {
    "dense": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                  use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=V),
    "moe": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
}
B, T = 3, 11
LENS = np.array([11, 7, 4])


def _text_config(case: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("gemma4_text", **BASE, **CASES[case])


def _randomize(model) -> None:
    """Non-trivial norms, scales and layer scalars (a w vs 1 + w or a dropped scale shows), bigger embeddings
    (logits of order 1) and decisive routers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.add_(0.3 * torch.randn_like(p))
            elif "router.proj" in name:
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name:
                p.mul_(10.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gemma4")
    out = {}
    for case in CASES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_text_config(case), dtype=torch.float32)
        _randomize(model)
        model.save_pretrained(root / case)
        out[case] = os.fspath(root / case)
    return out


def _batch(seed=0):
    """Left-padded rows of unequal lengths; positions start at each row's first real token."""
    toks = np.random.default_rng(seed).integers(3, V, (B, T))
    mask = (np.arange(T)[None] >= (T - LENS)[:, None]).astype(np.int64)
    return toks, mask, np.maximum(np.cumsum(mask, 1) - 1, 0)


def _hf(path, cls=None):
    from transformers import AutoModelForCausalLM

    return (cls or AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@functools.lru_cache(maxsize=None)
def _hf_logits(path, cls=None):
    toks, mask, pos = _batch()
    with torch.no_grad():
        return _hf(path, cls)(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask),
                              position_ids=torch.tensor(pos)).logits.numpy()


_fwd = jax.jit(lambda m, x, p, s: m(x, p, segment_ids=s).logits)


def _ours(model):
    toks, mask, pos = _batch()
    return np.asarray(_fwd(model, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask)))


def _max_valid_diff(a, b):
    return max(float(np.abs(a[i, T - n:] - b[i, T - n:]).max()) for i, n in enumerate(LENS))


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(ckpts, case):
    model = from_pretrained(ckpts[case])
    cfg = model.cfg
    assert (cfg.family, cfg.k_eq_v, cfg.global_kv_heads, cfg.global_head_dim) == ("gemma4", True, 1, 16)
    if case == "dense":
        assert [cfg.kv_source(i) for i in range(4)] == [None, None, 0, 1]
        assert [cfg.layer_mlp_dim(i) for i in range(4)] == [48, 48, 96, 96] and cfg.per_layer_dim == 8
    else:
        assert cfg.moe_layers == (0, 1) and cfg.moe_beside_mlp and cfg.router_aux_loss_coef == 0.0
    ref = _hf_logits(ckpts[case])
    assert np.abs(ref).max() > 1.0  # logits of order 1: a 1e-4 bound means something
    assert _max_valid_diff(_ours(model), ref) <= 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers(ckpts, case):
    """The sampler (prefill + cached decode; KV-shared layers read their source layer's cache) picks
    transformers' tokens with its log-probabilities, past the sliding window."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, V, n).tolist() for n in (9, 4, 13)]
    new = 10
    hf = _hf(ckpts[case])
    hf.generation_config.eos_token_id = None  # no stop and no EOS suppression
    out = Sampler(from_pretrained(ckpts[case]), max_len=32).generate(
        prompts, SamplingParams(max_new_tokens=new, temperature=0.0))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
        tokens = ref.sequences[0, len(p):].numpy()
        np.testing.assert_array_equal(out.tokens[i], tokens)
        logprobs = torch.log_softmax(torch.stack(ref.scores)[:, 0], -1).numpy()[np.arange(new), tokens]
        np.testing.assert_allclose(out.logprobs[i], logprobs, atol=1e-4)


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_export_round_trip_loads_in_transformers(ckpts, case, tmp_path):
    model = from_pretrained(ckpts[case])
    out = save_pretrained(model, str(tmp_path / "export"))
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["architectures"] == ["Gemma4ForCausalLM"]
    # transformers reads what posttrain wrote: the same model as the original folder (whose logits are ours)
    assert _max_valid_diff(_hf_logits(out), _hf_logits(ckpts[case])) <= 1e-6
    back = nnx.to_flat_state(nnx.state(from_pretrained(out)))
    for (key, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), back):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(key))


class _OneKey:
    """nnx.Rngs for shapes only: every draw is the same key. (Each draw from an nnx.Rngs under eval_shape
    updates its counter, which costs flax time that grows with the trace: 3-5x this test's time.)"""

    def params(self):
        return jax.random.key(0)


@pytest.mark.parametrize("name", ["gemma4-e2b", "gemma4-e4b", "gemma4-26b-a4b", "gemma4-31b"])
def test_presets_count_like_transformers(name):
    """eval_shape counts (layer_scalar is a buffer in both) equal transformers' model of the same config on
    the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    n = count_params(nnx.eval_shape(lambda: Transformer(preset(name), rngs=_OneKey())))
    hf_cfg = config_to_hf(preset(name))
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg))
    assert n == sum(p.numel() for p in ref.parameters())


@pytest.mark.parity
def test_multimodal_folder_loads_its_text_model_only_when_asked(ckpts, tmp_path):
    """A `gemma4` folder (vision tower + the "dense" text model) is an error naming the key unless
    text_only=True; then its text model equals transformers' on text."""
    import types

    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

    from posttrain.config import ModelSection
    from posttrain.trainers.sft import build_model

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    mm = Gemma4ForConditionalGeneration(Gemma4Config(text_config=_text_config("dense").to_dict(),
                                                     vision_config=vision))
    text = AutoModelForCausalLM.from_pretrained(ckpts["dense"], dtype=torch.float32)
    missing, _ = mm.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing
    path = str(tmp_path / "mm")
    mm.save_pretrained(path)
    with pytest.raises(PosttrainError, match=r"model_type 'gemma4'.*vision_config.*text_only=True"):
        from_pretrained(path)
    with pytest.raises(PosttrainError, match=r"model.text_only: true in a run config"):
        build_model(ModelSection(path=path), types.SimpleNamespace(vocab_size=V))
    model = from_pretrained(path, text_only=True)
    ref = _hf_logits(path, Gemma4ForConditionalGeneration)
    assert _max_valid_diff(_ours(model), ref) <= 1e-4
    # the run-config key: every trainer builds its model through build_model
    via_config = build_model(ModelSection(path=path, text_only=True), types.SimpleNamespace(vocab_size=V))
    assert _max_valid_diff(_ours(via_config), ref) <= 1e-4
    assert _max_valid_diff(ref, _hf_logits(ckpts["dense"])) <= 1e-6  # the same text model


@pytest.mark.parametrize("key, value", [("use_bidirectional_attention", "all"), ("attention_dropout", 0.1),
                                        ("attention_bias", True)])
def test_unsupported_options_name_the_key(key, value):
    cfg = _text_config("moe")
    setattr(cfg, key, value)
    with pytest.raises(PosttrainError, match=key):
        config_from_hf(cfg)
