"""GGUF files (llama.cpp's format) <-> Hugging Face folders and posttrain models, through the `gguf` package.

`convert(gguf_file, out_dir)` (`posttrain convert --gguf FILE --out DIR`) reads a GGUF with `gguf.GGUFReader`,
dequantizes every tensor to float32 with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and whatever
else the package implements), renames llama.cpp's tensors to transformers' names, undoes llama.cpp's row
permutation of the q/k projections (llama.cpp interleaves the two rotary halves of each head: `_permute` below,
the rule of llama.cpp's convert_hf_to_gguf.py and of transformers' LlamaTensorProcessor), and writes
config.json, model.safetensors (float32), generation_config.json, tokenizer.json, tokenizer_config.json (with
the chat template) and special_tokens_map.json. The tokenizer model is built by transformers' own GGUF tokenizer
converters (`transformers.integrations.ggml`, which imports no torch), so token ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`; the special tokens (bos, eos, pad, unk) and whether bos/eos
are added come from the GGUF's own fields (transformers 5.12 reads eos as the bos token). A GGUF without
`output.weight` ties the output head to the embeddings. Llama-architecture files (Llama, Mistral, SmolLM, ...),
qwen2 and qwen3 (its q/k norms as attn_q_norm / attn_k_norm); `rope_freqs.weight` (Llama 3.1+ rope scaling)
becomes rope_parameters of type llama3. qwen3moe files (Qwen3-MoE: experts on every layer, renormalised top-k; the
router as ffn_gate_inp, the experts stacked [E, out, in] as ffn_{gate,up,down}_exps, split back into one Linear per
expert as transformers saves them). gemma, gemma2 and gemma3 files as llama.cpp's Gemma converters write them:
every norm stored as 1 + w, the embedding scaling and GELU-tanh implied by the architecture, Gemma 2 / 3's sandwich
norms as post_attention_norm / ffn_norm / post_ffw_norm, Gemma 2's soft-caps as `*.attn_logit_softcapping` /
`*.final_logit_softcapping`, the window as `*.attention.sliding_window` over llama.cpp's fixed layer patterns
(Gemma 2 every 2nd layer full, Gemma 3 every 6th, its sliding layers at RoPE base 10 000) and queries scaled by
head_dim^-1/2 (`attention.key_length`).

`export_gguf(model, tokenizer, path, gguf_type)` (`posttrain export --run R|--model DIR --gguf OUT.gguf`) is the
reverse for the families of EXPORT_FAMILIES, written with `gguf.GGUFWriter`: llama.cpp's names, the q/k permutation
(llama), the Gemma conventions above, hyper-parameters, rope scaling
(llama3 as `rope_freqs.weight`, linear as metadata), a byte-level BPE tokenizer as `tokenizer.ggml.model = gpt2`
(tokens, token types, merges, special ids, add_bos/add_eos, chat template); weights as f32, f16, bf16 or q8_0
(norms and other 1-D tensors stay f32, as llama.cpp keeps them). Both directions write to a temporary sibling
and rename at the end, so a failure leaves nothing at the destination.

What it is not: an inference engine or a quantizer beyond q8_0, and no torch anywhere. `tokenizer.ggml.pre`
(llama.cpp's pre-tokenizer regex choice) is not interpreted: the GPT-2 byte-level split is used, as transformers
does. References: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; llama.cpp convert_hf_to_gguf.py;
transformers/modeling_gguf_pytorch_utils.py and integrations/ggml.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig, RopeConfig

# GGUF general.architecture values convert reads
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3")
# family -> GGUF arch (llama.cpp writes Mistral as llama)
EXPORT_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                   "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3"}
_FAMILY = {"qwen3moe": "qwen3_moe"}  # GGUF arch -> posttrain family, where the names differ
# llama.cpp's stacked experts [E, ...] <-> transformers' (on disk) one Linear per expert
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
            "ffn_down_exps.weight": "down_proj.weight"}
GEMMA = ("gemma", "gemma2", "gemma3")  # llama.cpp stores their norms as 1 + w and scales the embeddings itself
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")

# llama.cpp tensor names <-> transformers' (per layer: "blk.{i}." <-> "model.layers.{i}.").
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
          "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma 2 / 3's sandwich norms (gguf-py: ATTN_POST_NORM, FFN_PRE_NORM = ffn_norm, FFN_POST_NORM)
_SANDWICH = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}

# ModelConfig fields, beyond a plain Llama's, that each GGUF architecture expresses; and those it must have
_FIELDS = ("sliding_window", "num_experts", "layer_types", "sandwich_norm", "attn_softcap", "final_softcap",
           "query_scale", "embed_scale", "norm_unit_offset", "qkv_bias", "qk_norm", "rope_local")
_GEMMA_FIELDS = ("norm_unit_offset", "embed_scale")
_ALLOWED = {"llama": (), "qwen2": ("qkv_bias",), "qwen3": ("qk_norm",), "qwen3moe": ("qk_norm", "num_experts"),
            "gemma": _GEMMA_FIELDS,
            "gemma2": _GEMMA_FIELDS + ("sandwich_norm", "attn_softcap", "final_softcap", "query_scale",
                                       "sliding_window", "layer_types"),
            "gemma3": _GEMMA_FIELDS + ("sandwich_norm", "qk_norm", "query_scale", "sliding_window", "layer_types",
                                       "rope_local")}
_REQUIRED = {"qwen3": ("qk_norm",), "qwen3moe": ("qk_norm", "num_experts", "norm_topk_prob"), "gemma": _GEMMA_FIELDS,
             "gemma2": _GEMMA_FIELDS + ("sandwich_norm", "attn_softcap", "final_softcap"),
             "gemma3": _GEMMA_FIELDS + ("sandwich_norm", "qk_norm")}
# llama.cpp's fixed sliding patterns (llama-model.cpp set_swa_pattern): Gemma 2 every 2nd layer full, Gemma 3 every
# 6th; Gemma 3's sliding layers rotate with base 10 000 (rope_freq_base_train_swa)
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_THETA = 10_000.0


def _layer_names(arch: str) -> dict:
    """llama.cpp's per-layer tensor names -> transformers' (after "blk.{i}." / "model.layers.{i}."); a qwen3moe
    layer's experts are _EXPERTS'."""
    if arch == "qwen3moe":
        return {**_LAYER, "ffn_gate_inp.weight": "mlp.gate.weight"}
    return {**_LAYER, **_SANDWICH} if arch in ("gemma2", "gemma3") else _LAYER


def _permute(w: np.ndarray, n_head: int, reverse: bool) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, rows [0, 2, 4, ..., 1, 3, ...] of HF's rotate-half layout
    become interleaved pairs. Forward (HF -> GGUF) is llama.cpp's `permute`; reverse is transformers'
    `_reverse_permute_weights`. Works for weights [rows, D] and biases [rows]."""
    half = w.shape[0] // n_head // 2
    if reverse:
        return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(r: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores as rope_freqs.weight for llama3 rope scaling
    (convert_hf_to_gguf.py LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (r.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl, high_wl = r.original_max_position / r.low_freq_factor, r.original_max_position / r.high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(r.factor)
        else:
            s = (r.original_max_position / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
            out.append(1 / ((1 - s) / r.factor + s))
    return np.asarray(out, dtype=np.float32)


def _rope_from_factors(factors: np.ndarray, theta: float, head_dim: int, where: str) -> RopeConfig:
    """The llama3 RopeConfig whose factors are `factors` (Llama 3.1/3.2 use low 1, high 4; the pre-training
    length is searched over powers of two), or an error naming the tensor."""
    factor = float(factors.max())
    for low, high in ((1.0, 4.0),):
        for k in range(4, 21):
            r = RopeConfig(theta=theta, kind="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                           original_max_position=2 ** k)
            if np.allclose(_llama3_factors(r, head_dim), factors, rtol=1e-5, atol=1e-6):
                return r
    raise PosttrainError(f"{where}: tensor rope_freqs.weight holds rope factors that are not Llama 3's rope scaling "
                         "(low_freq_factor 1, high_freq_factor 4); posttrain cannot express them")


# ----------------------------------------------------------------------------- reading


def _reader(path: str):
    """A GGUFReader that checks each tensor's type and extent first, so a truncated file or an unknown type is
    a PosttrainError naming the tensor (the package itself fails deep inside numpy)."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            # Arrays (the vocabulary, token types and merges: ~150k entries) sliced from one plain ndarray view
            # instead of one memmap view built through _get per entry: 7-12 s -> about 1 s for SmolLM2. Same parts
            # (per entry: [length, bytes] for strings, [value] for numbers), same indices, so contents() agrees.
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            buf = self.data.view(np.ndarray)
            itype = int(buf[orig_offs:orig_offs + 4].view(np.uint32)[0])
            nptype = self.gguf_scalar_to_np.get(gguf.GGUFValueType(itype))
            if itype != gguf.GGUFValueType.STRING and nptype is None:
                return super()._get_field_parts(orig_offs, raw_type)  # nested arrays: the package's own path
            offs = orig_offs + 12
            n = int(buf[orig_offs + 4:offs].view(np.uint64)[0])
            parts = [buf[orig_offs:orig_offs + 4].view(np.uint32), buf[orig_offs + 4:offs].view(np.uint64)]
            if nptype is not None:
                size = np.dtype(nptype).itemsize
                values = buf[offs:offs + n * size].view(nptype)
                if len(values) != n:
                    raise ValueError("array runs past the end of the file")
                parts += [values[i:i + 1] for i in range(n)]
                idxs = list(range(2, 2 + n))
                return 12 + n * size, parts, idxs, [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(itype)]
            mv = memoryview(buf)
            idxs = []
            for _ in range(n):
                (k,) = struct.unpack_from("<Q", mv, offs)
                if offs + 8 + k > len(buf):
                    raise ValueError("string array runs past the end of the file")
                parts += [buf[offs:offs + 8].view(np.uint64), buf[offs + 8:offs + 8 + k]]
                idxs.append(len(parts) - 1)
                offs += 8 + k
            return offs - orig_offs, parts, idxs, [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _n, name_data, _nd, dims, raw_dtype, offset_tensor = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise PosttrainError(f"{path}: tensor {name!r} has unknown quantization type {int(raw_dtype[0])} "
                                         "(field tensor_info.type); re-quantize it with llama.cpp to a standard type "
                                         "such as Q8_0, Q4_0 or F16") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                end = start_offs + int(offset_tensor[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise PosttrainError(f"{path}: truncated GGUF file ({size} bytes; tensor {name!r} needs bytes up "
                                         f"to {end}); download or copy the file again")
            super()._build_tensors(start_offs, fields)

    if not os.path.isfile(path):
        raise PosttrainError(f"{path}: GGUF file does not exist; pass the path of a .gguf file")
    try:
        return Reader(path)
    except PosttrainError:
        raise
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError, TypeError) as e:
        raise PosttrainError(f"{path}: truncated or corrupt GGUF file: its header (metadata fields and tensor infos) "
                             f"could not be read ({e}); download or copy the file again") from None


def _field(r, key: str, path: str, default=None, required: bool = False):
    f = r.fields.get(key)
    if f is None:
        if required:
            raise PosttrainError(f"{path}: GGUF field {key!r} is missing; the file was not written by a complete "
                                 "llama.cpp conversion")
        return default
    return f.contents()


def _config(r, path: str, arch: str, tensors: dict) -> ModelConfig:
    p = arch + "."
    heads = int(_field(r, p + "attention.head_count", path, required=True))
    embed = int(_field(r, p + "embedding_length", path, required=True))
    head_dim = int(_field(r, p + "attention.key_length", path) or _field(r, p + "rope.dimension_count", path)
                   or embed // heads)
    theta = float(_field(r, p + "rope.freq_base", path, 10_000.0))
    rope = RopeConfig(theta=theta)
    scaling = _field(r, p + "rope.scaling.type", path)
    if "rope_freqs.weight" in tensors:
        rope = _rope_from_factors(tensors["rope_freqs.weight"], theta, head_dim, path)
    elif scaling == "linear":
        rope = RopeConfig(theta=theta, kind="linear", factor=float(_field(r, p + "rope.scaling.factor", path)))
    elif scaling not in (None, "none"):
        raise PosttrainError(f"{path}: GGUF field {p}rope.scaling.type = {scaling!r} is not supported (none, "
                             "linear and Llama 3's rope_freqs are)")
    kw = {}
    if arch in GEMMA:  # llama.cpp's query scale is head_dim^-1/2 (but for the 27B models), GELU-tanh MLPs
        kw.update(norm_unit_offset=True, embed_scale=True, activation="gelu_tanh")
    if arch in ("gemma2", "gemma3"):
        kw.update(sandwich_norm=True, query_scale=head_dim ** -0.5)
        window = _field(r, p + "attention.sliding_window", path)
        n = int(_field(r, p + "block_count", path, required=True))
        if window:
            every = _SWA_PATTERN[arch]
            kw.update(sliding_window=int(window),
                      layer_types=tuple("sliding" if (i + 1) % every else "full" for i in range(n)))
    if arch == "gemma2":
        kw.update(attn_softcap=float(_field(r, p + "attn_logit_softcapping", path, 50.0)),
                  final_softcap=float(_field(r, p + "final_logit_softcapping", path, 30.0)))
    if arch == "gemma3":
        kw.update(qk_norm=True, rope_local=RopeConfig(theta=GEMMA3_LOCAL_THETA))
    if arch == "qwen3moe":  # experts on every layer, renormalised top-k (llama.cpp's qwen3moe)
        kw.update(qk_norm=True, num_experts=int(_field(r, p + "expert_count", path, required=True)),
                  experts_per_token=int(_field(r, p + "expert_used_count", path, required=True)),
                  expert_mlp_dim=int(_field(r, p + "expert_feed_forward_length", path, required=True)),
                  norm_topk_prob=True)
    return ModelConfig(
        family=_FAMILY.get(arch, arch), vocab_size=tensors["token_embd.weight"].shape[0], embed_dim=embed,
        num_layers=int(_field(r, p + "block_count", path, required=True)),
        num_heads=heads, num_kv_heads=int(_field(r, p + "attention.head_count_kv", path, heads)), head_dim=head_dim,
        mlp_dim=int(_field(r, p + "feed_forward_length", path, required=True)),
        max_position=int(_field(r, p + "context_length", path, 8192)),
        norm_eps=float(_field(r, p + "attention.layer_norm_rms_epsilon", path, 1e-5)),
        tie_embeddings="output.weight" not in tensors, qkv_bias=arch == "qwen2", rope=rope,
        **{"qk_norm": arch == "qwen3", **kw})


def _tokenizer_dict(r, path: str) -> dict:
    """The tokenizer fields under transformers' names (GGUF_TOKENIZER_MAPPING); errors name the missing field."""
    if "tokenizer.ggml.tokens" not in r.fields:
        raise PosttrainError(f"{path}: GGUF has no tokenizer (field 'tokenizer.ggml.tokens' is missing); convert a "
                             "GGUF that embeds its vocabulary (llama.cpp writes it by default)")
    kind = _field(r, "tokenizer.ggml.model", path)
    if kind not in ("gpt2", "llama"):
        raise PosttrainError(f"{path}: GGUF field 'tokenizer.ggml.model' = {kind!r} is not supported; posttrain "
                             "converts byte-level BPE ('gpt2') and SentencePiece ('llama') vocabularies")
    names = {"tokenizer.ggml.model": "tokenizer_type", "tokenizer.ggml.tokens": "tokens",
             "tokenizer.ggml.scores": "scores", "tokenizer.ggml.token_type": "token_type",
             "tokenizer.ggml.merges": "merges", "tokenizer.ggml.bos_token_id": "bos_token_id",
             "tokenizer.ggml.eos_token_id": "eos_token_id", "tokenizer.ggml.unknown_token_id": "unk_token_id",
             "tokenizer.ggml.padding_token_id": "pad_token_id", "tokenizer.ggml.add_space_prefix": "add_prefix_space"}
    d = {ours: _field(r, key, path) for key, ours in names.items() if key in r.fields}
    if kind == "gpt2":  # a BPE without merges (the byte tokenizer): the package cannot write an empty array
        d.setdefault("merges", [])
    return d


def _tokenizer_files(r, path: str, arch: str, tmp: str) -> dict:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json; the special ids for config.json."""
    from tokenizers import processors
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS  # torch-free

    d = _tokenizer_dict(r, path)
    tokens = d["tokens"]
    conv = _FAMILY.get(arch, arch)  # transformers' converters are keyed by model_type
    if arch in GEMMA:  # a byte-level BPE through the Llama converter (it reads both kinds), SentencePiece as Gemma's
        conv = "llama" if d["tokenizer_type"] == "gpt2" else "gemma2"
    raw = GGUF_TO_FAST_CONVERTERS[conv](dict(d)).converted()

    def tok(key):
        i = d.get(key)
        if i is None:
            return None
        if not 0 <= i < len(tokens):
            raise PosttrainError(f"{path}: GGUF field for {key} = {i} is outside the vocabulary ({len(tokens)} "
                                 "tokens)")
        return tokens[i]

    bos, eos, pad, unk = tok("bos_token_id"), tok("eos_token_id"), tok("pad_token_id"), tok("unk_token_id")
    add_bos = bool(_field(r, "tokenizer.ggml.add_bos_token", path, d["tokenizer_type"] == "llama")) and bos is not None
    add_eos = bool(_field(r, "tokenizer.ggml.add_eos_token", path, False)) and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    specials = [(t, tokens.index(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    raw.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    raw.save(os.path.join(tmp, "tokenizer.json"))
    names = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    names = {k: v for k, v in names.items() if v is not None}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "add_bos_token": add_bos, "add_eos_token": add_eos,
           "clean_up_tokenization_spaces": False, "model_max_length": int(_field(r, arch + ".context_length", path,
                                                                                  8192))}
    template = _field(r, "tokenizer.chat_template", path)
    if template:
        cfg["chat_template"] = template
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, ensure_ascii=False)
    with open(os.path.join(tmp, "special_tokens_map.json"), "w") as fh:
        json.dump(names, fh, indent=2, ensure_ascii=False)
    return {k: d.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _hf_tensors(r, path: str, arch: str) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in transformers' layout ([out, in] for linear weights)."""
    from gguf.quants import dequantize

    out = {}
    for t in r.tensors:
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise PosttrainError(f"{path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which the "
                                 "gguf package cannot dequantize; re-quantize the model to Q8_0, Q4_0 or F16") from None
        out[t.name] = np.asarray(w, dtype=np.float32).reshape(tuple(reversed([int(x) for x in t.shape])))
    return out


def convert(gguf_file: str, out: str) -> str:
    """GGUF file -> Hugging Face folder at `out` (written in a temporary sibling, renamed at the end)."""
    from safetensors.numpy import save_file

    from posttrain.models.hf import EXPORT_MARKER, check_export_target, install
    from posttrain.models.hf_config import config_to_hf

    r = _reader(gguf_file)
    arch = _field(r, "general.architecture", gguf_file, required=True)
    if arch not in ARCHS:
        raise PosttrainError(f"{gguf_file}: GGUF field 'general.architecture' = {arch!r} is not supported; posttrain "
                             f"converts {', '.join(ARCHS)} GGUF files")
    _tokenizer_dict(r, gguf_file)  # no tokenizer: fail before the slow part
    check_export_target(out)  # never a file or a run folder; an existing folder only if empty or an export
    src = _hf_tensors(r, gguf_file, arch)
    for need in ("token_embd.weight", "output_norm.weight"):
        if need not in src:
            raise PosttrainError(f"{gguf_file}: tensor {need!r} is missing; the GGUF is incomplete")
    cfg = _config(r, gguf_file, arch, src)
    layer_names = _layer_names(arch)
    tensors = {}
    for name, w in src.items():
        if arch in GEMMA and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = w
            continue
        if name == "rope_freqs.weight":
            continue  # became rope_parameters
        parts = name.split(".", 2)
        if arch == "qwen3moe" and parts[0] == "blk" and parts[2] in _EXPERTS:  # [E, ...] -> one Linear per expert
            for e in range(w.shape[0]):
                tensors[f"model.layers.{parts[1]}.mlp.experts.{e}.{_EXPERTS[parts[2]]}"] = np.ascontiguousarray(w[e])
            continue
        if parts[0] != "blk" or parts[2] not in layer_names:
            raise PosttrainError(f"{gguf_file}: tensor {name!r} has no transformers name for architecture {arch!r}; "
                                 "the file holds a model variant posttrain does not convert")
        if arch == "llama" and parts[2].startswith(("attn_q.", "attn_k.")):
            w = _permute(w, cfg.num_heads if parts[2].startswith("attn_q.") else cfg.num_kv_heads, reverse=True)
        tensors[f"model.layers.{parts[1]}.{layer_names[parts[2]]}"] = np.ascontiguousarray(w)
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".posttrain-convert-", dir=parent)
    try:
        ids = _tokenizer_files(r, gguf_file, arch, tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        hf = config_to_hf(cfg, **{k: v for k, v in ids.items() if v is not None})
        hf["dtype"] = "float32"
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf, fh, indent=2)
        gen = {k: v for k, v in ids.items() if v is not None}
        eot = _field(r, "tokenizer.ggml.eot_token_id", gguf_file)
        if eot is not None and eot != gen.get("eos_token_id"):  # end of turn stops generation too
            gen["eos_token_id"] = [i for i in (gen.get("eos_token_id"), eot) if i is not None]
        with open(os.path.join(tmp, "generation_config.json"), "w") as fh:
            json.dump(gen, fh, indent=2)
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as fh:  # a later convert or export may replace it
            json.dump({"written_by": "posttrain convert", "files": sorted(os.listdir(tmp))}, fh, indent=1)
        install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ----------------------------------------------------------------------------- writing


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
    out, back = {}, {v: k for k, v in _EXPERTS.items()}
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
    odd = [k for k in _FIELDS if getattr(cfg, k) and k not in _ALLOWED[arch]]
    odd += [f"no {k}" for k in _REQUIRED.get(arch, ()) if not getattr(cfg, k)]
    act = "gelu_tanh" if arch in GEMMA else "silu"
    if cfg.activation != act:
        odd.append(f"activation {cfg.activation} (the architecture's is {act})")
    if cfg.query_scale is not None and "query_scale" in _ALLOWED[arch] \
            and not math.isclose(cfg.query_scale, cfg.head_dim ** -0.5, rel_tol=1e-6):
        odd.append(f"query_scale {cfg.query_scale:.6g} (llama.cpp's is head_dim^-1/2 = {cfg.head_dim ** -0.5:.6g})")
    if arch == "qwen3moe" and cfg.dense_layers:
        odd.append("dense_layers (llama.cpp's qwen3moe has experts on every layer)")
    every = _SWA_PATTERN.get(arch)
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
    layer_back = {v: k for k, v in _layer_names(arch).items()}
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
            w.add_tensor("rope_freqs.weight", _llama3_factors(cfg.rope, cfg.head_dim))
        for hf_name, a in _stack_experts(state, cfg, arch).items():
            if hf_name in _GLOBAL_BACK:
                gname = _GLOBAL_BACK[hf_name]
            elif hf_name.startswith("blk."):
                gname = hf_name  # stacked experts, named already
            else:
                _m, _l, i, rest = hf_name.split(".", 3)
                gname = f"blk.{i}.{layer_back[rest]}"
                if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                    a = _permute(a, cfg.num_heads if "q_proj" in rest else cfg.num_kv_heads, reverse=False)
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

