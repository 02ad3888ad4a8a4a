"""GGUF file -> Hugging Face folder (`convert`): the reader, the config, the tokenizer files and the tensors.
`models.gguf` describes the conventions."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

import numpy as np

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig, RopeConfig
from posttrain.models.gguf.names import (
    ARCHS,
    EXPERTS,
    FAMILY_OF_ARCH,
    GEMMA,
    GEMMA3_LOCAL_THETA,
    GLOBAL,
    SWA_PATTERN,
    layer_tensor_names,
    permute,
    rope_from_factors,
)


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
        rope = rope_from_factors(tensors["rope_freqs.weight"], theta, head_dim, path)
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
            every = SWA_PATTERN[arch]
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
        family=FAMILY_OF_ARCH.get(arch, arch), vocab_size=tensors["token_embd.weight"].shape[0], embed_dim=embed,
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
    conv = FAMILY_OF_ARCH.get(arch, arch)  # transformers' converters are keyed by model_type
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
    layer_names = layer_tensor_names(arch)
    tensors = {}
    for name, w in src.items():
        if arch in GEMMA and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        if name in GLOBAL:
            tensors[GLOBAL[name]] = w
            continue
        if name == "rope_freqs.weight":
            continue  # became rope_parameters
        parts = name.split(".", 2)
        if arch == "qwen3moe" and parts[0] == "blk" and parts[2] in EXPERTS:  # [E, ...] -> one Linear per expert
            for e in range(w.shape[0]):
                tensors[f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERTS[parts[2]]}"] = np.ascontiguousarray(w[e])
            continue
        if parts[0] != "blk" or parts[2] not in layer_names:
            raise PosttrainError(f"{gguf_file}: tensor {name!r} has no transformers name for architecture {arch!r}; "
                                 "the file holds a model variant posttrain does not convert")
        if arch == "llama" and parts[2].startswith(("attn_q.", "attn_k.")):
            w = permute(w, cfg.num_heads if parts[2].startswith("attn_q.") else cfg.num_kv_heads, reverse=True)
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
