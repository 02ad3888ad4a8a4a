"""GGUF files (llama.cpp's format) <-> Hugging Face folders and posttrain models, through the `gguf` package.

`convert(gguf_file, out_dir)` (`posttrain convert --gguf FILE --out DIR`) reads a GGUF with `gguf.GGUFReader`,
dequantizes every tensor to float32 with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and whatever
else the package implements), renames llama.cpp's tensors to transformers' names, undoes llama.cpp's row
permutation of the q/k projections (llama.cpp interleaves the two rotary halves of each head: `names.permute`,
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

from posttrain.models.gguf.names import ARCHS, EXPORT_FAMILIES, GEMMA, GGUF_TYPES
from posttrain.models.gguf.read import convert
from posttrain.models.gguf.write import export_gguf

__all__ = ["ARCHS", "EXPORT_FAMILIES", "GEMMA", "GGUF_TYPES", "convert", "export_gguf"]
