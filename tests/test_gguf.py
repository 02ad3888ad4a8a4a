"""GGUF in and out (posttrain/models/gguf/, `posttrain convert` and `posttrain export --gguf`).

Tiny checks (a random Llama made with transformers and a real byte-level BPE tokenizer trained here): our GGUF
export read back by transformers' own GGUF loader (the independent reader) gives the HF folder's logits (f32 to
1e-4, q8_0 to 5e-2); `posttrain convert` of that GGUF gives back the same weights, logits and tokenizer. Bad inputs
(truncated file, unknown quantization type, unsupported architecture, no tokenizer) exit 2 with one line naming
the file and the field, and leave nothing at --out. The demo-real quick path runs on the tiny chat model.
The real model's checks (SmolLM2-135M-Instruct against transformers' own GGUF conversion): tests/test_gguf_real.py.
"""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

from posttrain.cli import main

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 3,
          "for i in range(10): print(i * i)", "Hello, world! How are you today?", "1234 + 5678 = 6912",
          "import numpy as np\nx = np.zeros((3, 4))\n", "the cat sat on the mat; the dog sat on the log"]
TEXTS = ["Hello world", "def f(x):\n    return x ** 2", "  leading spaces and tabs\t!", "12345 + 678 = 13023",
         "ünïcödé 你好 🤗", "<|im_start|>user\nhi<|im_end|>"]


def _bpe_tokenizer(path: Path):
    """A real byte-level BPE tokenizer (GPT-2 pre-tokenizer, ~300 tokens with merges, ChatML specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML)
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama HF folder with the BPE tokenizer (default rope: transformers' GGUF loader reads no
    rope_freqs), and its f32 and q8_0 GGUF exports through the CLI."""
    import torch
    from hf_models import hf_config
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf")
    tok = _bpe_tokenizer(root / "hf")
    cfg = hf_config("llama")
    cfg.vocab_size, cfg.rope_parameters = len(tok), {"rope_type": "default", "rope_theta": 10000.0}
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root / "hf")
    out = {"root": root, "hf": str(root / "hf"), "tok": tok, "model": model}
    for kind in ("f32", "q8_0"):
        out[kind] = str(root / f"tiny-{kind}.gguf")
        assert main(["export", "--model", out["hf"], "--gguf", out[kind], "--gguf-type", kind]) == 0
    return out


def _ids(tok) -> "np.ndarray":
    rng = np.random.default_rng(0)
    return rng.integers(0, len(tok), size=(2, 24))


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _pt_logits(path, ids):
    import jax.numpy as jnp

    from posttrain.models import from_pretrained

    model = from_pretrained(path)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return np.asarray(model(jnp.asarray(ids, dtype=jnp.int32), pos).logits, dtype=np.float32)


def _q8_0_reference(model):
    """A copy of the transformers `model` whose matrices went through the gguf package's reference Q8_0 quantizer
    and back (llama.cpp's rule: 2-D tensors with whole 32-wide blocks per row; norms and biases stay f32). A row
    permutation (llama's q/k for GGUF) does not change a row's blocks, so this is what a right q8_0 export holds."""
    import copy

    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            a = p.detach().numpy().astype(np.float32)
            if a.ndim == 2 and a.shape[-1] % 32 == 0:
                p.copy_(torch.from_numpy(dequantize(quantize(a, Q.Q8_0), Q.Q8_0).reshape(a.shape)))
            elif a.ndim == 2:
                p.copy_(torch.from_numpy(a.astype(np.float16).astype(np.float32)))
    return ref


def test_export_read_back_by_transformers(tiny):
    """f32 GGUF -> transformers' GGUF loader: the HF folder's logits to 1e-4; q8_0: the HF folder quantized by the
    gguf package's reference quantizer, to the same 1e-4 (a wrong tensor, permutation or block shows; 5e-2 against
    the unquantized model could not see zeroed q/k projections)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = _ids(tiny["tok"])
    for kind in ("f32", "q8_0"):
        want = _hf_logits(tiny["model"] if kind == "f32" else _q8_0_reference(tiny["model"]), ids)
        path = tiny[kind]
        back = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32)
        assert not back.config.tie_word_embeddings
        err = float(np.abs(_hf_logits(back, ids) - want).max())
        print(f"{kind}: transformers' GGUF reader vs the HF folder, logits max|d| = {err:.3g}")
        assert err <= 1e-4, (kind, err)
    # the quantization itself is visible at this tolerance: the q8_0 file is not the f32 model
    assert float(np.abs(_hf_logits(tiny["model"], ids) - _hf_logits(_q8_0_reference(tiny["model"]), ids)).max()) > 1e-3


def test_convert_round_trip(tiny, tmp_path):
    """posttrain convert of our f32 GGUF: the same weights, posttrain logits, tokenizer and chat template."""
    from safetensors.numpy import load_file

    from posttrain.tokenizer import Tokenizer

    out = tmp_path / "back"
    assert main(["convert", "--gguf", tiny["f32"], "--out", str(out)]) == 0
    a, b = load_file(os.path.join(tiny["hf"], "model.safetensors")), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    ids = _ids(tiny["tok"])
    assert np.array_equal(_pt_logits(tiny["hf"], ids), _pt_logits(str(out), ids))
    ours, theirs = Tokenizer.from_pretrained(out), Tokenizer.from_pretrained(tiny["hf"])
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    chat = [{"role": "user", "content": "Hi 🤗"}, {"role": "assistant", "content": "Hello!"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_id, theirs.eos_id, theirs.pad_id)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == theirs.eos_id


def test_qwen2_and_llama3_rope(tiny, tmp_path):
    """qwen2 (qkv biases, tied head, no q/k permutation): transformers reads our GGUF exactly and convert gives
    posttrain the same logits; llama3 rope goes out as rope_freqs.weight and comes back as rope_parameters, and the
    bf16 export of bf16-representable weights gives the same logits to 1e-5 (dropping the llama3 scaling moves them
    ~2e-3, which the former 2e-2 bound for rounded f32 weights could not see)."""
    import torch
    from hf_models import hf_config
    from transformers import AutoModelForCausalLM

    ids = _ids(tiny["tok"])
    for fam, kind in (("qwen2", "f32"), ("llama", "bf16")):
        cfg = hf_config(fam)  # the llama family's rope is llama3 (factor 8, original length 32)
        cfg.vocab_size = len(tiny["tok"])
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name or "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
                elif name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(6.0)  # attention scores of order 1: a RoPE error moves the logits
                if kind == "bf16":  # bf16-representable weights: the bf16 export is exact, so its bound can be tight
                    p.copy_(p.to(torch.bfloat16).float())
        model.save_pretrained(tmp_path / fam)
        tiny["tok"].save_pretrained(tmp_path / fam)
        gguf_file = tmp_path / f"{fam}.gguf"
        assert main(["export", "--model", str(tmp_path / fam), "--gguf", str(gguf_file), "--gguf-type", kind]) == 0
        assert main(["convert", "--gguf", str(gguf_file), "--out", str(tmp_path / f"{fam}-back")]) == 0
        err = float(np.abs(_pt_logits(str(tmp_path / f"{fam}-back"), ids) - _pt_logits(str(tmp_path / fam), ids)).max())
        print(f"{fam} {kind}: posttrain logits after export + convert, max|d| = {err:.3g}")
        back = json.loads((tmp_path / f"{fam}-back" / "config.json").read_text())
        if fam == "qwen2":
            theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32)
            assert theirs.config.tie_word_embeddings and back["tie_word_embeddings"]
            assert float(np.abs(_hf_logits(theirs, ids) - _hf_logits(model, ids)).max()) <= 1e-4
            assert err <= 1e-6
        else:
            assert back["rope_parameters"] == cfg.rope_parameters | {"rope_type": "llama3"}
            assert err <= 1e-5  # bf16-representable weights: exact up to the f32 forward


def test_export_run_lora_merged(tiny, tmp_path):
    """`export --run R --gguf`: a LoRA run merged on the same path as the HF export; convert gives those weights."""
    import yaml
    from safetensors.numpy import load_file

    repo = Path(__file__).resolve().parents[1]
    cfg = {"model": {"path": tiny["hf"], "dtype": "float32"},
           "data": {"train": str(repo / "tests/data/sft_prompt_completion.jsonl"), "max_length": 32},
           "optim": {"lr": 1e-2, "warmup_steps": 0}, "lora": {"enabled": True, "rank": 2, "alpha": 4},
           "train": {"steps": 2, "batch_size": 2, "log_every": 1}, "run_dir": str(tmp_path / "run")}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["sft", "--config", str(tmp_path / "sft.yaml")]) == 0
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", "--run", str(tmp_path / "run"), "--gguf", str(tmp_path / "run.gguf")]) == 0
    assert main(["convert", "--gguf", str(tmp_path / "run.gguf"), "--out", str(tmp_path / "back")]) == 0
    hf, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    base = load_file(os.path.join(tiny["hf"], "model.safetensors"))
    assert set(hf) == set(back) and all(np.array_equal(hf[k], back[k]) for k in hf)
    assert not all(np.array_equal(hf[k], base[k]) for k in hf)  # the adapters were merged


def test_export_refuses_other_families(tmp_path):
    from posttrain.errors import PosttrainError
    from posttrain.models import ModelConfig
    from posttrain.models.gguf import export_gguf

    cfg = ModelConfig(family="gemma4", vocab_size=8, embed_dim=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, mlp_dim=8)
    with pytest.raises(PosttrainError, match="family 'gemma4' is not supported"):
        export_gguf(types.SimpleNamespace(cfg=cfg), None, str(tmp_path / "x.gguf"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("change,why", [
    (dict(query_scale=24 ** -0.5), "query_scale 0.204124 .llama.cpp's is head_dim"),
    (dict(layer_types=("sliding",) * 3 + ("full",)), "layer types other than llama.cpp's fixed pattern"),
    (dict(attn_softcap=None), "no attn_softcap"),
    (dict(activation="silu"), "activation silu"),
])
def test_export_refuses_what_llama_cpp_reads_otherwise(change, why, tmp_path):
    """A Gemma 2 that llama.cpp would run differently (it scales queries by head_dim^-1/2, slides every other layer,
    always soft-caps) is refused by name; the Gemma 2 of transformers' defaults passes these checks."""
    from posttrain.errors import PosttrainError
    from posttrain.models import ModelConfig
    from posttrain.models.gguf import export_gguf

    cfg = ModelConfig(family="gemma2", vocab_size=8, embed_dim=8, num_layers=4, num_heads=1, num_kv_heads=1,
                      head_dim=16, mlp_dim=8, norm_unit_offset=True, embed_scale=True, sandwich_norm=True,
                      activation="gelu_tanh", query_scale=16 ** -0.5, attn_softcap=50.0, final_softcap=30.0,
                      sliding_window=4, layer_types=("sliding", "full") * 2)
    with pytest.raises(PosttrainError, match="no tokenizer"):  # every check passed: the tokenizer is next
        export_gguf(types.SimpleNamespace(cfg=cfg), None, str(tmp_path / "x.gguf"))
    with pytest.raises(PosttrainError, match=why):
        export_gguf(types.SimpleNamespace(cfg=cfg.replace(**change)), None, str(tmp_path / "x.gguf"))
    assert not list(tmp_path.iterdir())


def test_export_refuses_qwen3_moe_llama_cpp_cannot_run(tmp_path):
    """llama.cpp's qwen3moe has experts on every layer and renormalises the top-k weights."""
    from posttrain.errors import PosttrainError
    from posttrain.models import ModelConfig
    from posttrain.models.gguf import export_gguf

    cfg = ModelConfig(family="qwen3_moe", vocab_size=8, embed_dim=8, num_layers=2, num_heads=1, num_kv_heads=1,
                      head_dim=8, mlp_dim=8, qk_norm=True, num_experts=4, experts_per_token=2, expert_mlp_dim=8)
    with pytest.raises(PosttrainError, match="no tokenizer"):  # every check passed: the tokenizer is next
        export_gguf(types.SimpleNamespace(cfg=cfg), None, str(tmp_path / "x.gguf"))
    for change, why in ((dict(dense_layers=(1,)), "dense_layers"), (dict(norm_topk_prob=False), "no norm_topk_prob")):
        with pytest.raises(PosttrainError, match=why):
            export_gguf(types.SimpleNamespace(cfg=cfg.replace(**change)), None, str(tmp_path / "x.gguf"))
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- bad inputs


def _writer_file(path: Path, arch: str, tokenizer: bool) -> None:
    """A small GGUF of `arch` with one tensor and the llama hyper-parameters, with or without a vocabulary."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, v in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 8),
                   ("attention.head_count", 1)):
        w.add_uint32(f"{arch}.{key}", v)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _truncated(src: str, dst: Path) -> None:
    data = Path(src).read_bytes()
    dst.write_bytes(data[: len(data) * 2 // 3])


def _unknown_type(src: str, dst: Path) -> None:
    import gguf

    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    r.tensors[1].field.parts[4][0] = 99  # the tensor info's type field
    r.data.flush()


BAD = {  # case -> (writer(tiny, path), fragments of the message besides the file name)
    "truncated": (lambda t, p: _truncated(t["f32"], p), ("truncated GGUF file", "tensor 'blk.")),
    "truncated-header": (lambda t, p: p.write_bytes(Path(t["f32"]).read_bytes()[:300]), ("truncated or corrupt GGUF",
                                                                                         "header")),
    "unknown-type": (lambda t, p: _unknown_type(t["f32"], p), ("unknown quantization type 99", "tensor_info.type")),
    "architecture": (lambda t, p: _writer_file(p, "phi3", True), ("general.architecture", "'phi3'")),
    "no-tokenizer": (lambda t, p: _writer_file(p, "llama", False), ("tokenizer.ggml.tokens",)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_gguf(case, tiny, tmp_path, capsys):
    make, expect = BAD[case]
    src = tmp_path / f"{case}.gguf"
    make(tiny, src)
    out = tmp_path / "out"
    before = sorted(os.listdir(tmp_path))
    assert main(["convert", "--gguf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: ") and "Traceback" not in err, err
    assert str(src) in err and all(e in err for e in expect), err
    assert sorted(os.listdir(tmp_path)) == before and not out.exists()


def test_demo_real_quick_path(tiny, tmp_path, monkeypatch):
    """`make demo-real`'s path (configs/real/*.yaml, chat prompts, base -> GRPO -> DPO -> q8_0 GGUF, summary) with
    1-step runs on the tiny chat model instead of SmolLM2: the stages chain, each export is scored on the same
    held-out questions, and the GGUF holds the DPO model, not the GRPO one: the 1-step DPO runs without warm-up
    (the config's 2 warm-up steps give update 0 a learning rate of 0, and LoRA B starts at 0, so the DPO export was
    bit-identical to the GRPO one) and moves the logits well above the identity checks' 1e-4; an f32 GGUF of the DPO
    run is read back by transformers to 1e-4, and the demo's q8_0 GGUF equals the DPO model quantized by the gguf
    package's reference quantizer to 1e-4. Skipping the DPO stage (its exports taken from the GRPO run) fails here:
    `scripts/mutation_check.py dpo_stage_skipped`."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.demos import demo_real
    from posttrain.runs import export_run_gguf

    monkeypatch.setitem(demo_real.QUICK, "dpo", [*demo_real.QUICK["dpo"], "optim.warmup_steps=0", "optim.lr=1e-3"])
    out = tmp_path / "demo-real"
    summary = demo_real.run(str(out), quick=True, progress=False, base=tiny["hf"])
    assert [s["stage"] for s in summary["stages"]] == ["base", "grpo", "dpo"]
    # accuracy is the share of the 8 held-out questions answered right
    assert all(float(s["accuracy"] * 8).is_integer() and s["shapes"] for s in summary["stages"])
    assert json.loads((out / "summary.json").read_text())["stages"][2]["folder"] == str(out / "dpo" / "hf")
    def read(name):
        return [json.loads(line) for line in (out / "data" / f"{name}.jsonl").read_text().splitlines()]

    rows, train = read("eval"), {json.dumps(r["prompt"]) for r in read("prompts")}
    assert len(rows) == 8 and rows[0]["prompt"][0]["role"] == "user"
    assert not train & {json.dumps(r["prompt"]) for r in rows}  # held-out questions are never trained on
    ids = np.arange(12, dtype=np.int64)[None] % len(tiny["tok"])

    def hf(folder, gguf=None):
        if gguf:
            return AutoModelForCausalLM.from_pretrained(folder, gguf_file=os.path.basename(gguf), dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    dpo, grpo = hf(str(out / "dpo" / "hf")), hf(str(out / "grpo" / "hf"))
    moved = float(np.abs(_hf_logits(dpo, ids) - _hf_logits(grpo, ids)).max())
    f32 = export_run_gguf(str(out / "dpo"), str(tmp_path / "dpo-f32.gguf"), "f32")
    f32_err = float(np.abs(_hf_logits(hf(str(tmp_path), f32), ids) - _hf_logits(dpo, ids)).max())
    q8_err = float(np.abs(_hf_logits(hf(str(out / "dpo"), summary["gguf"]), ids)
                          - _hf_logits(_q8_0_reference(dpo), ids)).max())
    print(f"DPO vs GRPO logits max|d| = {moved:.3g}; f32 GGUF vs DPO {f32_err:.3g}; q8_0 GGUF vs reference "
          f"q8_0 DPO {q8_err:.3g}")
    assert f32_err <= 1e-4 and q8_err <= 1e-4
    assert moved >= 1e-2  # the DPO stage changed the model 100x above the identity tolerance
