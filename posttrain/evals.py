"""Evaluation of a model's sampled answers.

What it is: `accuracy(model, tok, pairs, max_new_tokens)`: greedy exact-match accuracy of the
completions of (prompt, answer) string pairs, with the compiled sampler.
"""

from __future__ import annotations

import numpy as np

from posttrain.generate import Sampler, SamplingParams
from posttrain.tokenizer import Tokenizer


def accuracy(model, tok: Tokenizer, pairs, max_new_tokens: int = 8) -> float:
    """Greedy exact-match accuracy of completions for (prompt, answer) string pairs."""
    prompts = [tok.encode(p) for p, _ in pairs]
    sampler = Sampler(model, max_len=max(len(p) for p in prompts) + max_new_tokens + 16)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                   stop_ids=tok.eos_ids))
    texts = out.texts(tok)
    return float(np.mean([t.strip() == a for t, (_, a) in zip(texts, pairs)]))
