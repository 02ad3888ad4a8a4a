"""A trained reward model as a scorer: `RewardModel(path).score(prompts, completions) -> [N] float32`.

What it is: loads a Hugging Face `*ForSequenceClassification` folder (written by
`trainers.reward_model.export_rm_run`, or by transformers / TRL's RewardTrainer) with
`from_pretrained(path, head="score")` and its tokenizer, and scores (prompt, completion)
pairs exactly as the reward-model trainer does (`data.preference.tokenize_pair`, TRL 1.16): plain
strings are encode(prompt + completion + eos text); conversations (`prompt` a list of messages,
`completion` a list of messages or an assistant reply string) are the chat template's rendering
of prompt + reply.
The score is the head at the token transformers scores (the rightmost token that is not
`config.pad_token_id`, `models.heads.score_index`), so the scores equal
`AutoModelForSequenceClassification`'s on the same ids.

Speed: rows are right-padded to a power-of-two length bucket (at least `min_bucket`, at most
`max_length`) and to `batch_size` rows, so repeated calls reuse a handful of compiled forwards.
A sequence longer than `max_length` keeps its last `max_length` tokens (the score is read at
the end) and is counted in `self.truncated`.

What it is not: a reward-function protocol or the built-in rule rewards (RL rollouts), nor a trainer.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.data.formats import messages
from posttrain.errors import PosttrainError
from posttrain.models.heads import last_token_scores, score_index
from posttrain.models.hf import from_pretrained
from posttrain.tokenizer import Tokenizer

Messages = list  # [{"role": ..., "content": ...}, ...]


def tokenize_completion(tok: Tokenizer, prompt: Union[str, Messages], completion: Union[str, Messages],
                        where: str = "") -> list[int]:
    """Token ids of prompt + completion, as `data.preference.tokenize_pair` builds a pair's
    [prompt | answer] (TRL 1.16): plain strings tokenized whole with the tokenizer's specials and
    the eos text appended (unless the completion ends with it); conversations rendered whole by
    the chat template. tests/test_reward_model.py checks the two agree."""
    if isinstance(prompt, str) and isinstance(completion, str):
        eos = tok.eos_token or ""
        return tok.encode(prompt + (completion if completion.endswith(eos) else completion + eos))
    if not isinstance(prompt, list):
        raise PosttrainError(f"{where}: prompt is {type(prompt).__name__}; give a string with a string completion, "
                             "or a list of messages")
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    msgs = messages({"prompt": prompt}, "prompt", where) + messages({"completion": completion}, "completion", where)
    return tok.apply_chat_template(msgs, where=where)


class RewardModel:
    """Scores (prompt, completion) pairs with a HF sequence-classifier folder (num_labels 1)."""

    def __init__(self, path: str, *, max_length: int = 1024, batch_size: int = 8, dtype: str = "float32",
                 min_bucket: int = 32, tokenizer: Optional[str] = None):
        self.path = path
        self.tokenizer = Tokenizer.from_pretrained(tokenizer or path)
        self.model = from_pretrained(path, dtype=dtype, head="score")
        if self.model.score[...].shape[-1] != 1:
            raise PosttrainError(f"{path}: the classifier has {self.model.score[...].shape[-1]} labels; a reward model "
                                 "has num_labels = 1")
        with open(os.path.join(path, "config.json")) as fh:
            # The id transformers skips when it looks for each row's last token (None: the last token).
            self.pad_id = json.load(fh).get("pad_token_id")
        self.max_length = min(max_length, self.model.cfg.max_position)
        self.batch_size = batch_size
        self.min_bucket = min(min_bucket, self.max_length)
        self.truncated = 0
        graphdef, state = nnx.split(self.model)
        self._state = state
        pad_id = self.pad_id

        def forward(st, tokens, segment_ids):
            model = nnx.merge(graphdef, st)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            out = model(tokens, positions, segment_ids=segment_ids, return_hidden=True, return_logits=False)
            return last_token_scores(model, out.hidden[-1], score_index(tokens, segment_ids, pad_id=pad_id))[:, 0]

        self._forward = jax.jit(forward)

    def _bucket(self, n: int) -> int:
        b = self.min_bucket
        while b < n:
            b *= 2
        return min(b, self.max_length)

    def encode(self, prompts: Sequence, completions: Sequence) -> list[list[int]]:
        if len(prompts) != len(completions):
            raise PosttrainError(f"score: {len(prompts)} prompts but {len(completions)} completions; give one "
                                 "completion per prompt (repeat a prompt for several completions)")
        rows = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids = tokenize_completion(self.tokenizer, p, c, where=f"pair {i}")
            if not ids:
                raise PosttrainError(f"pair {i}: prompt + completion give no tokens")
            if len(ids) > self.max_length:
                self.truncated += 1
                if self.truncated == 1:
                    warnings.warn(f"pair {i}: {len(ids)} tokens > max_length={self.max_length}; scoring the last "
                                  f"{self.max_length} (counted in RewardModel.truncated)", stacklevel=3)
                ids = ids[-self.max_length:]
            rows.append(ids)
        return rows

    def score_ids(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Scores [N] float32 of already tokenized sequences."""
        out = np.zeros(len(rows), np.float32)
        fill = 0 if self.pad_id is None else self.pad_id
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths share a bucket
        for start in range(0, len(rows), self.batch_size):
            idx = order[start:start + self.batch_size]
            T = self._bucket(max(len(rows[i]) for i in idx))
            tokens = np.full((self.batch_size, T), fill, np.int32)
            seg = np.zeros((self.batch_size, T), np.int32)
            for b in range(self.batch_size):  # filler rows repeat the first so every row is a real sequence
                ids = rows[idx[b] if b < len(idx) else idx[0]]
                tokens[b, :len(ids)] = ids
                seg[b, :len(ids)] = 1
            scores = np.asarray(jax.device_get(self._forward(self._state, tokens, seg)))
            out[idx] = scores[:len(idx)]
        return out

    def score(self, prompts: Sequence, completions: Sequence) -> np.ndarray:
        """Scores [N] float32 of prompt i followed by completion i (strings, or conversations)."""
        if len(prompts) == 0:
            return np.zeros(0, np.float32)
        return self.score_ids(self.encode(prompts, completions))
