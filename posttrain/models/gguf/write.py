"""posttrain model -> GGUF file (`export_gguf`): llama.cpp's names, hyper-parameters, the byte-level BPE
tokenizer and the weights. `models.gguf` describes the conventions."""

from __future__ import annotations

import json
import math
import os
import tempfile

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.gguf.names import (
    ALLOWED,
    EXPERTS,
    EXPORT_FAMILIES,
    FIELDS,
    GEMMA,
    GEMMA3_LOCAL_THETA,
    GGUF_TYPES,
    GLOBAL_BACK,
    REQUIRED,
    SWA_PATTERN,
    layer_tensor_names,
    llama3_factors,
    permute,
)


def _hf_state(model) -> dict[str, np.ndarray]:
    """The model's weights under transformers' names, float32 on the host (what save_pretrained writes)."""
    import jax
    from flax import nnx

    from posttrain.models.hf_names import weight_map
    from posttrain.models.layers import Buffer

    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, Buffer))))
    out = {}
    for key, (names, _, save, *_alt) in weight_map(model.cfg).items():
        arr = np.asarray(jax.device_get(flat[key][...]), dtype=np.float32)
        for n, a in zip(names, save(arr)):
            out[n] = np.ascontiguousarray(a)
    return out


def _vocab(tokenizer, vocab_size: int, where: str):
    """(tokens by id, token types, merges, add_bos, add_eos) of a byte-level BPE tokenizer, padded to the model's
    vocabulary with unused tokens as llama.cpp's converter does."""
    from gguf import TokenType

    light = getattr(tokenizer, "_light", None)  # posttrain's torch-free tokenizer, when it loaded one
    spec = json.loads((light.raw if light is not None else tokenizer.hf.backend_tokenizer).to_str())
    model = spec.get("model") or {}
    pre = json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        raise PosttrainError(f"{where}: tokenizer.json has a {model.get('type')} model with pre-tokenizer "
                             f"{(spec.get('pre_tokenizer') or {}).get('type')}; GGUF export supports byte-level BPE "
                             "tokenizers (GPT-2, Llama 3, Qwen, SmolLM style)")
    n = max([*model["vocab"].values(), *(a["id"] for a in spec.get("added_tokens", []))]) + 1
    if n > vocab_size:
        raise PosttrainError(f"{where}: the tokenizer has {n} tokens but the model's embedding only {vocab_size}; "
                             "export the tokenizer the model was trained with")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(TokenType.UNUSED)] * vocab_size
    for t, i in model["vocab"].items():
        tokens[i], types[i] = t, int(TokenType.NORMAL)
    for a in spec.get("added_tokens", []):
        tokens[a["id"]] = a["content"]
        types[a["id"]] = int(TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    probe, plain = tokenizer.encode("a", add_special_tokens=True), tokenizer.encode("a", add_special_tokens=False)
    add_bos = tokenizer.bos_id is not None and len(probe) > len(plain) and probe[0] == tokenizer.bos_id
    add_eos = tokenizer.eos_id is not None and len(probe) > len(plain) and probe[-1] == tokenizer.eos_id
    return tokens, types, merges, add_bos, add_eos


def _unk_id(tokenizer):
    spec = getattr(tokenizer, "_special", None)  # (token, id) of a named special, without building transformers'
    return spec("unk_token")[1] if spec is not None else tokenizer.hf.unk_token_id


def _stack_experts(state: dict, cfg: ModelConfig, arch: str) -> dict:
    """qwen3moe: each layer's per-expert Linears (transformers' names) stacked into llama.cpp's [E, out, in]
    ffn_{gate,up,down}_exps, in place of the first expert's entry (the rest unchanged)."""
    if arch != "qwen3moe":
        return state
    out, back = {}, {v: k for k, v in EXPERTS.items()}
    for name, a in state.items():
        parts = name.split(".")
        if parts[3:5] != ["mlp", "experts"]:
            out[name] = a
        elif parts[5] == "0":
            i, which = parts[2], ".".join(parts[6:])
            out[f"blk.{i}.{back[which]}"] = np.stack(
                [state[f"model.layers.{i}.mlp.experts.{e}.{which}"] for e in range(cfg.num_experts)])
    return out


def _inexpressible(cfg: ModelConfig, arch: str) -> list[str]:
    """What of `cfg` the GGUF architecture `arch` cannot express (as llama.cpp reads it); [] when it can."""
    odd = [k for k in FIELDS if getattr(cfg, k) and k not in ALLOWED[arch]]
    odd += [f"no {k}" for k in REQUIRED.get(arch, ()) if not getattr(cfg, k)]
    act = "gelu_tanh" if arch in GEMMA else "silu"
    if cfg.activation != act:
        odd.append(f"activation {cfg.activation} (the architecture's is {act})")
    if cfg.query_scale is not None and "query_scale" in ALLOWED[arch] \
            and not math.isclose(cfg.query_scale, cfg.head_dim ** -0.5, rel_tol=1e-6):
        odd.append(f"query_scale {cfg.query_scale:.6g} (llama.cpp's is head_dim^-1/2 = {cfg.head_dim ** -0.5:.6g})")
    if arch == "qwen3moe" and cfg.dense_layers:
        odd.append("dense_layers (llama.cpp's qwen3moe has experts on every layer)")
    every = SWA_PATTERN.get(arch)
    if every and cfg.sliding_window:
        want = tuple("sliding" if (i + 1) % every else "full" for i in range(cfg.num_layers))
        if tuple(cfg.layer_type(i) for i in range(cfg.num_layers)) != want:
            odd.append(f"layer types other than llama.cpp's fixed pattern (every {every}th layer full)")
    if arch == "gemma2" and not cfg.sliding_window:
        odd.append("no sliding_window (llama.cpp's gemma2 slides every other layer)")
    local = cfg.rope_local
    if arch == "gemma3" and local is not None and (local.kind != "default" or local.theta != GEMMA3_LOCAL_THETA):
        odd.append(f"sliding-layer RoPE {local.kind} base {local.theta:g} (llama.cpp's is default base 10000)")
    return odd


def export_gguf(model, tokenizer, path: str, gguf_type: str = "f32", name: str = "posttrain") -> str:
    """Write `model` (a llama / mistral / qwen2 / qwen3 / gemma / gemma2 / gemma3 Transformer) and its tokenizer as
    one GGUF file at `path`."""
    import gguf
    from gguf.quants import quantize

    cfg = model.cfg
    arch = EXPORT_FAMILIES.get(cfg.family)
    if arch is None:
        raise PosttrainError(f"GGUF export: family {cfg.family!r} is not supported; posttrain writes GGUF for "
                             f"{', '.join(EXPORT_FAMILIES)} models (export a Hugging Face folder with --out instead)")
    odd = _inexpressible(cfg, arch)
    if odd or getattr(model, "score", None) is not None:
        what = ", ".join(odd) or "a score head"
        raise PosttrainError(f"GGUF export: this {cfg.family} model has {what}, which the GGUF {arch} architecture "
                             "cannot express; export a Hugging Face folder with --out instead")
    if gguf_type not in GGUF_TYPES:
        raise PosttrainError(f"--gguf-type {gguf_type!r}: use one of {', '.join(GGUF_TYPES)}")
    kinds = ("default", "linear") if arch in GEMMA else ("default", "linear", "llama3")  # rope_freqs: llama's
    if cfg.rope.kind not in kinds:
        raise PosttrainError(f"GGUF export: rope type {cfg.rope.kind!r} is not supported for the GGUF {arch} "
                             f"architecture ({', '.join(kinds)})")
    if tokenizer is None:
        raise PosttrainError("GGUF export: the model has no tokenizer; a GGUF must carry its vocabulary")
    tokens, types, merges, add_bos, add_eos = _vocab(tokenizer, cfg.vocab_size, "GGUF export")
    Q, F = gguf.GGMLQuantizationType, gguf.LlamaFileType
    wtype, ftype = {"f32": (Q.F32, F.ALL_F32), "f16": (Q.F16, F.MOSTLY_F16), "bf16": (Q.BF16, F.MOSTLY_BF16),
                    "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0)}[gguf_type]
    if os.path.isdir(path):
        raise PosttrainError(f"--gguf {path} is a folder; give the path of the .gguf file to write")
    if os.path.isfile(path):  # replace an earlier GGUF, never another file (a run's config.yaml, weights, ...)
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise PosttrainError(f"--gguf {path} is an existing file that is not GGUF; choose a new path")
    state = _hf_state(model)
    layer_back = {v: k for k, v in layer_tensor_names(arch).items()}
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".posttrain-gguf-", suffix=".gguf", dir=parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(name)
        w.add_file_type(int(ftype))
        w.add_context_length(cfg.max_position)
        w.add_embedding_length(cfg.embed_dim)
        w.add_block_count(cfg.num_layers)
        w.add_feed_forward_length(cfg.mlp_dim)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_rope_dimension_count(cfg.head_dim)
        if cfg.head_dim * cfg.num_heads != cfg.embed_dim or arch in GEMMA:  # Gemma's readers default to 256
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
        if arch == "qwen3moe":
            w.add_expert_count(cfg.num_experts)
            w.add_expert_used_count(cfg.experts_per_token)
            w.add_expert_feed_forward_length(cfg.expert_mlp_dim)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(float(cfg.attn_softcap))
            w.add_final_logit_softcapping(float(cfg.final_softcap))
        if cfg.sliding_window:
            w.add_sliding_window(int(cfg.sliding_window))
        w.add_rope_freq_base(float(cfg.rope.theta))
        w.add_layer_norm_rms_eps(float(cfg.norm_eps))
        w.add_vocab_size(cfg.vocab_size)
        if cfg.rope.kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(cfg.rope.factor))
        if wtype != Q.F32:
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)  # none (a byte tokenizer): no field; posttrain reads that, llama.cpp does not
        for setter, value in ((w.add_bos_token_id, tokenizer.bos_id), (w.add_eos_token_id, tokenizer.eos_id),
                              (w.add_pad_token_id, tokenizer.pad_id), (w.add_unk_token_id, _unk_id(tokenizer))):
            if value is not None:
                setter(int(value))
        extra = [i for i in tokenizer.eos_ids if i != tokenizer.eos_id]
        if extra:  # a chat's end-of-turn stop id (generation_config.json): llama.cpp's end-of-turn token
            w.add_eot_token_id(int(extra[0]))
        w.add_add_bos_token(add_bos)
        w.add_add_eos_token(add_eos)
        if tokenizer.chat_template:
            w.add_chat_template(tokenizer.chat_template)
        if cfg.rope.kind == "llama3":
            w.add_tensor("rope_freqs.weight", llama3_factors(cfg.rope, cfg.head_dim))
        for hf_name, a in _stack_experts(state, cfg, arch).items():
            if hf_name in GLOBAL_BACK:
                gname = GLOBAL_BACK[hf_name]
            elif hf_name.startswith("blk."):
                gname = hf_name  # stacked experts, named already
            else:
                _m, _l, i, rest = hf_name.split(".", 3)
                gname = f"blk.{i}.{layer_back[rest]}"
                if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                    a = permute(a, cfg.num_heads if "q_proj" in rest else cfg.num_kv_heads, reverse=False)
            if arch in GEMMA and hf_name.endswith("norm.weight"):
                a = a + np.float32(1.0)  # llama.cpp's Gemma converters store the norms as 1 + w
            t = wtype if a.ndim >= 2 else Q.F32  # llama.cpp keeps norms and biases in f32
            if t == Q.Q8_0 and a.shape[-1] % 32:
                t = Q.F16  # rows not a whole number of q8_0 blocks: llama.cpp's fallback
            if t == Q.F32:
                w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
            elif t == Q.F16:
                w.add_tensor(gname, a.astype(np.float16))
            else:
                w.add_tensor(gname, quantize(a, t), raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
