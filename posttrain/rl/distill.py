"""Sampled data for distillation: teacher-generated datasets and GKD's on-policy student samples.

What it is:
  - `teacher_samples(teacher, tok, prompts, ...)`: the teacher completes every prompt with the
    shared `Sampler` (one compiled shape: fixed chunks of prompts, one prompt bucket); the result
    is a list of `data.pipeline.Example`s (prompt ids + completion ids, the loss on the completion,
    exactly the sampled ids: no decode/re-encode round trip), which the trainer then distils on
    offline, like any SFT dataset (sequence-level KD, Kim & Rush 2016, arXiv 1606.07947).
  - `OnPolicyBatches`: the batch source of on-policy distillation (GKD, Agarwal et al. 2024, arXiv
    2306.13649; TRL 1.16's `GKDTrainer` with `lmbda`): before each step, with probability λ
    (drawn from the step number, so a resumed run draws the same), the student samples
    completions for the next `batch_size` prompts from the train state's own weights
    (`Sampler.update`: no copy, no recompile) and the step distils the teacher on them; otherwise
    the next offline batch is used. Its position (offline iterator, prompt stream, steps served) is
    checkpointed, so a killed run resumes to the same weights.

  - `cached_teacher_samples(...)`: teacher_samples cached in the run folder (distill.mode =
    teacher_generated), and `attach_projection` (distill.projection's learned matrix on the student).

What it is not: the loss (`losses/distill_step.py`) or the trainer (`trainers/distill.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import defaultdict

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.data.pipeline import Example, to_arrays
from posttrain.generate import Sampler, SamplingParams
from posttrain.train.step import merged_state


def _sample(sampler: Sampler, prompts, params: SamplingParams, key) -> list[np.ndarray]:
    out = sampler.generate([np.asarray(p, np.int32) for p in prompts], params, key=key)
    return [np.asarray(out.tokens[i, :out.lengths[i]], np.int32) for i in range(len(prompts))]


def _example(prompt, completion, where: str) -> Example:
    ids = np.concatenate([np.asarray(prompt, np.int32), completion])
    mask = np.concatenate([np.zeros(len(prompt), np.int32), np.ones(len(completion), np.int32)])
    return Example(ids, mask, where)


def teacher_samples(teacher, tok, prompts, *, max_new_tokens: int, temperature: float, seed: int = 0,
                    chunk: int = 32) -> list[Example]:
    """One teacher completion per prompt (`data.prompts.Prompt`s) as training examples."""
    longest = max(len(p.ids) for p in prompts)
    sampler = Sampler(teacher, max_len=longest + max_new_tokens, pad_id=tok.pad_id, buckets=(longest,))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=tok.eos_ids)
    out = []
    for i in range(0, len(prompts), chunk):
        part = [p.ids for p in prompts[i:i + chunk]]
        n = len(part)
        part += [part[0]] * (chunk - n)  # one compiled batch shape
        done = _sample(sampler, part, params, jax.random.fold_in(jax.random.key(seed), i))[:n]
        out += [_example(p.ids, c, p.where) for p, c in zip(prompts[i:i + n], done)]
    return out


def cached_teacher_samples(path: str, key_parts, teacher, tok, prompts, *, max_new_tokens: int,
                           temperature: float, seed: int, reuse: bool) -> list[Example]:
    """`teacher_samples` of `prompts`, read from `path` (an .npz) when it holds them for the same key
    (`key_parts`: what defines the teacher and the sampling, and the prompts' ids) and `reuse` is set;
    else sampled and written atomically, with a readable copy `teacher_data.jsonl` beside it."""
    digest = hashlib.sha256(repr(key_parts).encode())
    for p in prompts:
        digest.update(np.int64(len(p.ids)).tobytes() + p.ids.tobytes())
    key = digest.hexdigest()
    if reuse and os.path.isfile(path):
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) == key:
                ends = np.cumsum(f["lengths"])
                return [Example(ids, mask, p.where) for ids, mask, p in
                        zip(np.split(f["ids"], ends[:-1]), np.split(f["mask"], ends[:-1]), prompts)]
    out = teacher_samples(teacher, tok, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    tmp = path + ".tmp.npz"
    np.savez(tmp, key=key, ids=np.concatenate([e.ids for e in out]),
             mask=np.concatenate([e.loss_mask for e in out]), lengths=np.asarray([len(e.ids) for e in out]))
    readable = os.path.join(os.path.dirname(path), "teacher_data.jsonl")
    with open(readable + ".tmp", "w") as fh:  # for people to read
        for p, e in zip(prompts, out):
            fh.write(json.dumps({"prompt": p.prompt, "completion": tok.decode(
                e.ids[len(p.ids):], skip_special_tokens=False)}) + "\n")
    os.replace(readable + ".tmp", readable)
    os.replace(tmp, path)
    return out


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether step `step` (0-based) distils on the student's samples: a draw fixed by (seed, step)."""
    return bool(np.random.default_rng([seed, step]).random() < lmbda)


class OnPolicyBatches:
    def __init__(self, offline, prompts, sampler: Sampler, graphdef, *, batch_size: int, seq_len: int, pad_id: int,
                 lmbda: float, params: SamplingParams, seed: int = 0, shuffle: bool = True):
        self.offline, self.prompts, self.sampler, self.graphdef = offline, prompts, sampler, graphdef
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.lmbda, self.params, self.seed = lmbda, params, seed
        ds = grain.MapDataset.range(len(prompts))
        if shuffle:
            ds = ds.shuffle(seed=seed)
        self._stream = iter(ds.repeat(None).to_iter_dataset(grain.ReadOptions(num_threads=0)))
        self.calls = 0
        self._stats: dict = defaultdict(list)

    def __call__(self, state) -> dict:
        step, self.calls = self.calls, self.calls + 1
        if self.offline is None or on_policy_step(self.seed, step, self.lmbda):
            self._stats["on_policy"].append(1.0)
            return self.student_batch(state, step)
        self._stats["on_policy"].append(0.0)
        return next(self.offline)

    def student_batch(self, state, step: int) -> dict:
        self.sampler.update(merged_state(state))
        group = [self.prompts[next(self._stream)] for _ in range(self.batch_size)]
        t0 = time.perf_counter()
        done = _sample(self.sampler, [p.ids for p in group], self.params,
                       jax.random.fold_in(jax.random.key(self.seed), step))
        self._stats["time/generate_s"].append(time.perf_counter() - t0)
        self._stats["completion/length"].append(float(np.mean([len(c) for c in done])))
        return to_arrays([_example(p.ids, c, p.where) for p, c in zip(group, done)], self.seq_len, self.pad_id,
                         False)

    def get_state(self) -> dict:
        return {"offline": None if self.offline is None else self.offline.get_state(),
                "prompts": self._stream.get_state(), "calls": self.calls}

    def set_state(self, st: dict) -> None:
        if self.offline is not None:
            self.offline.set_state(st["offline"])
        self._stream.set_state(st["prompts"])
        self.calls = st["calls"]

    def metrics(self) -> dict:
        """Means since the last call: on_policy (fraction of steps), completion/length, time/generate_s."""
        out = {k: float(np.mean(v)) for k, v in self._stats.items() if v}
        self._stats.clear()
        return out


class ProjectionParam(nnx.Param):
    """distill.projection's [teacher width, student width] matrix; trained with the student (also under LoRA)."""


def attach_projection(model, teacher_width: int, seed: int = 0):
    w = 0.02 * jax.random.normal(jax.random.key(seed), (teacher_width, model.cfg.embed_dim), jnp.float32)
    model.distill_projection = ProjectionParam(w, out_sharding=(None, "embed"), eager_sharding=False)
    return model
