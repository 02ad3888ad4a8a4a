"""The real GGUF model (SmolLM2-135M-Instruct Q4_1 from `make real-model`): posttrain's conversion (`posttrain
convert`) against transformers' own GGUF conversion: every tensor, token ids on >= 200 mixed texts, the rendered
chat template, float32 logits and 64 greedy tokens on 5 chat prompts. The tiny GGUF checks are tests/test_gguf.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from posttrain.cli import main


def _real_gguf() -> Path:
    from posttrain.demos.real_model import gguf_path

    return gguf_path()


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """posttrain's conversion (through the CLI) and transformers' own (model + tokenizer), once per session."""
    path = _real_gguf()
    if not path.is_file():
        pytest.skip(f"{path} is absent: run `make real-model` (make test does) to fetch SmolLM2-135M-Instruct")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("real") / "smollm2"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one torch thread decodes 4x faster than two beside JAX's threads
    t0 = time.perf_counter()
    assert main(["convert", "--gguf", str(path), "--out", str(out)]) == 0
    t1 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    t2 = time.perf_counter()
    print(f"\nreal: posttrain convert {t1 - t0:.1f} s, transformers' GGUF load (model + tokenizer) {t2 - t1:.1f} s")
    yield {"out": str(out), "ref": ref, "ref_tok": ref_tok}
    torch.set_num_threads(threads)


def _texts() -> list[str]:
    """>= 200 mixed texts: code, emoji, CJK, numbers, whitespace, specials, and combinations of them."""
    seeds = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
             "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;", "🤗🚀✨ emoji 👩‍💻 and flags 🇫🇷",
             "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
             "3.14159 * 2 = 6.28318; 10**9 = 1000000000",
             "   indented\n\ttabbed\r\nwindows  line", "Ünïcödé façade naïve café — “quotes” ‘single’",
             "<|im_start|>system\nYou are helpful.<|im_end|>", "https://example.com/a?b=c&d=e#frag",
             "The quick brown fox jumps over the lazy dog.", "<|endoftext|>The end<|im_end|>", "x" * 40]
    texts = list(seeds)
    for i, a in enumerate(seeds):
        for j, b in enumerate(seeds):
            if i != j:
                texts.append(a + (" ", "\n", "")[(i + j) % 3] + b)
                texts.append(b[: len(b) // 2] + "  " + a[len(a) // 2:])
    texts += [s.upper() for s in seeds] + [s[::-1] for s in seeds]
    return texts


def _conversations() -> list[list[dict]]:
    users = ["What is 2 + 2?", "Write a haiku about the sea 🌊", "用中文介绍一下你自己。",
             "Explain recursion in Python.", "List three prime numbers."]
    convs = [[{"role": "user", "content": u}] for u in users]
    convs += [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": u},
               {"role": "assistant", "content": "Sure! " + u[::-1]}, {"role": "user", "content": "Thanks"}]
              for u in users]
    return convs


@pytest.mark.real
def test_real_tensors_match_transformers(real):
    from safetensors import safe_open

    ref = {k: v.detach().numpy() for k, v in real["ref"].state_dict().items()}
    worst, n = 0.0, 0
    with safe_open(os.path.join(real["out"], "model.safetensors"), "numpy") as f:
        keys = set(f.keys())
        assert keys == set(ref) - {"lm_head.weight"}  # tied: transformers' state dict lists the head too
        for k in keys:
            worst = max(worst, float(np.abs(f.get_tensor(k) - ref[k]).max()))
            n += 1
    print(f"\nreal: {n} tensors, max|d| vs transformers = {worst:.3g}")
    assert worst <= 1e-6
    assert json.loads(open(os.path.join(real["out"], "config.json")).read())["tie_word_embeddings"] is True


@pytest.mark.real
def test_real_tokenizer_matches_transformers(real):
    from posttrain.tokenizer import Tokenizer

    ours, ref = Tokenizer.from_pretrained(real["out"]), real["ref_tok"]
    texts = _texts()
    same = sum(ours.encode(t) == list(ref(t).input_ids) for t in texts)
    convs = _conversations()
    rendered = [(ours.apply_chat_template(c, add_generation_prompt=g, tokenize=False),
                 ref.apply_chat_template(c, add_generation_prompt=g, tokenize=False)) for c in convs for g in (0, 1)]
    same_tpl = sum(a == b for a, b in rendered)
    same_chat_ids = sum(ours.encode(a, add_special_tokens=False) == list(ref(b, add_special_tokens=False).input_ids)
                        for a, b in rendered)
    print(f"\nreal: token ids identical on {same}/{len(texts)} texts, chat template identical on "
          f"{same_tpl}/{len(rendered)} renders, their ids on {same_chat_ids}/{len(rendered)}")
    assert len(texts) >= 200 and same == len(texts)
    assert same_tpl == same_chat_ids == len(rendered)
    # the GGUF's own special ids (transformers 5.12 reads eos as the bos token; the model's config has 2)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)


@pytest.mark.real
def test_real_logits_and_greedy_match_transformers(real):
    import jax
    import torch

    from posttrain.generate import Sampler, SamplingParams
    from posttrain.models import from_pretrained
    from posttrain.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(real["out"])
    model = from_pretrained(real["out"])
    prompts = [tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True)
               for u in ("Write a long story about a dragon who learns to bake bread.",
                         "Explain in detail how a bicycle works.", "Describe the water cycle step by step.",
                         "Write a Python function that sorts a list, and explain it line by line.",
                         "Tell me about the history of the printing press.")]
    n = min(len(p) for p in prompts)
    ids = np.asarray([p[:n] for p in prompts], dtype=np.int32)
    t0 = time.perf_counter()
    pos = jax.numpy.broadcast_to(jax.numpy.arange(n), ids.shape)
    ours = np.asarray(model(jax.numpy.asarray(ids), pos).logits, dtype=np.float32)
    with torch.no_grad():
        theirs = real["ref"](torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    rel = float(np.abs(ours - theirs).max() / (theirs.max() - theirs.min()))
    t1 = time.perf_counter()
    new = 64
    out = Sampler(model, max_len=max(map(len, prompts)) + new).generate(
        prompts, SamplingParams(max_new_tokens=new, temperature=0.0), key=jax.random.key(0))
    t2 = time.perf_counter()
    matches = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = real["ref"].generate(torch.as_tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                       max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                       pad_token_id=2)[0, len(p):].tolist()
        mine = out.tokens[i, : out.lengths[i]].tolist()
        matches += mine == ref
        if mine != ref:
            k = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            print(f"prompt {i}: first difference at token {k}: {tok.decode(mine[:k + 1])!r} vs "
                  f"{tok.decode(ref[:k + 1])!r}")
    t3 = time.perf_counter()
    print(f"\nreal: logits relative max|d| = {rel:.3g} of the range ({theirs.min():.2f}..{theirs.max():.2f}); greedy "
          f"{new} tokens identical on {matches}/{len(prompts)} prompts; times: logits {t1 - t0:.1f} s, posttrain "
          f"sampler {t2 - t1:.1f} s, transformers generate {t3 - t2:.1f} s")
    assert rel <= 1e-5
    assert matches == len(prompts)
