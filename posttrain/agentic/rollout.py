"""Multi-turn tool episodes on the shared sampler, and the GRPO batch source built on them.

What it is:
- `run_episodes(sampler, tok, prompts, make_env, params, ...)`: `params.n` episodes for each prompt,
  all advanced together. Each round is ONE batched decode (`Sampler.begin`, then `Sampler.extend`)
  over the episodes still running: a row samples until a stop token (the end of its answer), a
  stop sequence of the tool-call format (`parsing.stop_strings`, e.g. `</tool_call>`) or its
  budget; the finished actions go to their environments (`Environment.step`, in a thread pool:
  the python tool is a subprocess); an episode whose environment answers with an observation (a
  tool's output) continues in the next round with the observation's tokens appended to its KV
  cache (prefilled onto it, never recomputed); an episode that is done drops out of the batch, so
  a short episode never waits for a long one and a long one waits at most for the round in flight.
  A stop sequence that does not close a tool call (a Gemma ``` fence around plain code) continues
  the same action in the next round. Episodes end when the environment says done, after
  `max_turns` actions, or when the next observation plus one token would not fit in `max_tokens`
  (the budget after the prompt: actions + observations; truncated, reward so far, 0 for ToolEnv).
  An environment or verifier that raises (or returns a non-finite reward) ends that episode with
  reward 0 (`episode/env_errors`), never the rollout.
- `SampledEpisode` token layout: `ids` are the tokens after the prompt exactly as sampled (actions) or as
  the environment's text encodes (observations, `tok.encode(text, add_special_tokens=False)`),
  `mask` is 1 on sampled tokens only, `logprobs` are the sampler's (0 on observations). The
  sampled ids are kept as they were sampled (never re-tokenized from text).
- `episode_rows(...)`: GRPO rows, one per prompt, its k episodes as branches (`data.branches.group_row`,
  slot width `max_tokens`), with `score_w` = the mask, so the policy loss sees no prompt and no
  tool-output token, and `old_logps` = the sampler's log-probs.
- `AgenticRollout`: a `GroupRollout` (same prompt stream, checkpoint state, μ reuse and metrics)
  whose rollouts are `run_episodes` on the train state's own weights (no copy) and whose rewards
  are the episodes' rewards; `evaluate(...)`: greedy episodes on held-out rows (accuracy, tool use).

What it is not: the environments or tools (`env.py`, `tools.py`), nor chat-template rendering of
tool messages (observations are text appended as the environment writes it, `render_tool_result`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections import defaultdict
from typing import Callable, Mapping, Optional, Sequence

import jax
import numpy as np

from posttrain.agentic.parsing import ends_tool_call, stop_strings
from posttrain.data.branches import ROW_FIELDS, SCORE_FIELDS, group_row
from posttrain.data.prompts import Prompt, tokenize_prompt
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.advantages import estimate_advantages
from posttrain.rl.rollout import GroupRollout
from posttrain.train.step import merged_state


@dataclasses.dataclass
class SampledEpisode:
    """One episode of a batch: what was sampled and observed after the prompt, and how it ended."""

    prompt_index: int  # the prompt it continues (episodes k*i .. k*i + k - 1 share prompt i)
    ids: list = dataclasses.field(default_factory=list)  # tokens after the prompt
    mask: list = dataclasses.field(default_factory=list)  # 1 = sampled by the policy, 0 = observation
    logprobs: list = dataclasses.field(default_factory=list)  # sampler log-probs, 0 on observations
    reward: float = 0.0  # sum of the environment's step rewards
    turns: int = 0  # actions taken
    tool_calls: int = 0  # (ToolEnv) calls that ran a tool
    parse_errors: int = 0  # (ToolEnv) malformed calls
    tool_errors: int = 0  # (ToolEnv) unknown tools, tools that failed
    done: bool = False  # the environment ended it
    env_error: bool = False  # the environment (or its verifier) raised or gave a non-finite reward: reward 0
    truncated: bool = False  # the turn or token budget ended it first
    rounds: int = 0  # batched decodes it took part in
    action: list = dataclasses.field(default_factory=list)  # ids of the action being written

    @property
    def trained_tokens(self) -> int:
        return int(sum(self.mask))


def _row(p: Prompt) -> dict:
    return {"prompt": p.prompt, **p.columns}


def _step(work) -> tuple:
    """(observation, reward, done, failed) of env.step(action): an environment (or verifier) that raises
    ends its episode with reward 0, counted, never the rollout; a non-finite reward counts as 0 too."""
    env, action = work
    try:
        obs, reward, done = env.step(action)
        reward = float(reward)
    except Exception:  # a user's verifier or environment: one episode fails, not the run
        return None, 0.0, True, True
    if not math.isfinite(reward):
        return None, 0.0, True, True
    return obs, reward, bool(done), False


def run_episodes(sampler: Sampler, tok, prompts: Sequence[Prompt], make_env: Callable[[], object],
                 params: SamplingParams, *, key: jax.Array, max_tokens: int, max_turns: int, fmt: str = "hermes",
                 workers: int = 1, stats: Optional[dict] = None) -> list[SampledEpisode]:
    """`params.n` episodes per prompt (episode i*n + j is prompt i's j-th), advanced in batched rounds
    (see the module docstring). `params.max_new_tokens` bounds one action, `max_tokens` the whole
    episode after the prompt. Round r samples with fold_in(key, r): the same key, weights and prompts
    give the same episodes. `stats` (a dict of lists), when given, collects timings."""
    n, B = params.n, len(prompts)
    envs = [make_env() for _ in range(B * n)]
    eps = [SampledEpisode(prompt_index=e // n) for e in range(B * n)]
    for e, env in enumerate(envs):
        env.reset(_row(prompts[e // n]))
    seqs = [tok.encode(s, add_special_tokens=False) for s in stop_strings(fmt)]
    stop_ids = set(params.stop_ids)
    M = params.max_new_tokens
    t0 = time.perf_counter()
    comp, turn = sampler.begin([p.ids for p in prompts], params, key=jax.random.fold_in(key, 0),
                               stop_sequences=seqs, max_new_tokens=[min(M, max_tokens)] * B)
    t_gen, t_env = time.perf_counter() - t0, 0.0
    one = dataclasses.replace(params, n=1)
    active, rnd = list(range(B * n)), 0
    pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else None
    try:
        while True:
            keep, appended, budgets, acting = [], [], [], []
            for j, e in enumerate(active):  # record what each row sampled this round
                ep, L = eps[e], int(comp.lengths[j])
                ids = comp.tokens[j, :L].tolist()
                ep.ids += ids
                ep.mask += [1] * L
                ep.logprobs += comp.logprobs[j, :L].tolist()
                ep.action += ids
                ep.rounds += 1
                room = min(M - len(ep.action), max_tokens - len(ep.ids))
                at_seq = comp.finish_reasons[j] == "stop" and ids[-1] not in stop_ids
                if at_seq and room > 0 and not ends_tool_call(tok.decode(ep.action), fmt):
                    keep.append(j)  # a stop sequence that closes no call: the action goes on
                    appended.append([])
                    budgets.append(room)
                else:
                    acting.append(j)
            t1 = time.perf_counter()
            texts = [tok.decode(eps[active[j]].action) for j in acting]
            work = [(envs[active[j]], t) for j, t in zip(acting, texts)]
            steps = list(pool.map(_step, work) if pool else map(_step, work))
            t_env += time.perf_counter() - t1
            for j, (obs, reward, done, failed) in zip(acting, steps):
                e = active[j]
                ep = eps[e]
                ep.reward += reward
                ep.turns += 1
                ep.env_error = ep.env_error or failed
                ep.action = []
                if done:
                    ep.done = True
                    continue
                obs_ids = tok.encode(obs, add_special_tokens=False) if obs else []
                if ep.turns >= max_turns or len(ep.ids) + len(obs_ids) + 1 > max_tokens:
                    ep.truncated = True
                    continue
                ep.ids += obs_ids
                ep.mask += [0] * len(obs_ids)
                ep.logprobs += [0.0] * len(obs_ids)
                keep.append(j)
                appended.append(obs_ids)
                budgets.append(min(M, max_tokens - len(ep.ids)))
            if not keep:
                break
            order = np.argsort(keep, kind="stable")  # rows in cache order (any order works; this is tidy)
            keep, appended, budgets = ([x[i] for i in order] for x in (keep, appended, budgets))
            rnd += 1
            t1 = time.perf_counter()
            comp, turn = sampler.extend(turn, keep, appended, one, key=jax.random.fold_in(key, rnd),
                                        stop_sequences=seqs, max_new_tokens=budgets)
            t_gen += time.perf_counter() - t1
            active = [active[j] for j in keep]
    finally:
        if pool:
            pool.shutdown()
    for ep, env in zip(eps, envs):
        record = getattr(env, "episode", None)  # ToolEnv's counters
        for f in ("tool_calls", "parse_errors", "tool_errors"):
            setattr(ep, f, int(getattr(record, f, 0) or 0))
    if stats is not None:
        stats["time/generate_s"].append(t_gen)
        stats["time/tools_s"].append(t_env)
        stats["episode/rounds"].append(rnd + 1)
    return eps


def episode_stats(eps: Sequence[SampledEpisode]) -> dict:
    """Means over episodes: reward, tool use, turns, lengths, truncation."""
    arr = lambda f: np.array([f(e) for e in eps], np.float64)  # noqa: E731
    rewards = arr(lambda e: e.reward)
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "episode/tool_use_rate": float(arr(lambda e: e.tool_calls > 0).mean()),
            "episode/tool_calls": float(arr(lambda e: e.tool_calls).mean()),
            "episode/parse_errors": float(arr(lambda e: e.parse_errors).mean()),
            "episode/tool_errors": float(arr(lambda e: e.tool_errors).mean()),
            "episode/turns": float(arr(lambda e: e.turns).mean()),
            "episode/length": float(arr(lambda e: len(e.ids)).mean()),
            "episode/trained_tokens": float(arr(lambda e: e.trained_tokens).mean()),
            "episode/truncated": float(arr(lambda e: e.truncated).mean()),
            "episode/env_errors": float(arr(lambda e: e.env_error).mean())}


def episode_rows(prompts: Sequence[Prompt], eps: Sequence[SampledEpisode], n: int, width: int, length: int, pad_id: int,
                 advantages: np.ndarray) -> dict:
    """The GRPO batch: one prefix-shared row per prompt (its n episodes as branches in [n, width] score
    slots), `score_w` 1 on sampled tokens only (prompt and observations are context, never targets),
    `old_logps` the sampler's, `advantages` [B, n]."""
    B, T = len(prompts), width
    batch = {f: np.zeros((B, length), np.int32) for f in ROW_FIELDS}
    batch["tokens"][:] = pad_id
    batch.update({f: np.zeros((B, n * T), np.float32 if f == "score_w" else np.int32) for f in SCORE_FIELDS})
    batch["old_logps"] = np.zeros((B, n * T), np.float32)
    batch["advantages"] = np.asarray(advantages, np.float32).reshape(B, n)
    for i, p in enumerate(prompts):
        group = eps[i * n:(i + 1) * n]
        row = group_row(p.ids, [e.ids for e in group], T)
        L = len(row["tokens"])
        for f in ROW_FIELDS:
            batch[f][i, :L] = row[f]
        for f in SCORE_FIELDS:
            batch[f][i] = row[f]
        for j, e in enumerate(group):
            m = len(e.ids)
            batch["score_w"][i, j * T:j * T + m] *= np.asarray(e.mask, np.float32)
            batch["old_logps"][i, j * T:j * T + m] = e.logprobs
    batch["old_logps"] *= batch["score_w"] != 0
    return batch


class AgenticRollout(GroupRollout):
    """GRPO's batch source over multi-turn episodes: `batch_size` prompts, `n` episodes each, rewards
    from the environments, advantages (the estimator named `advantages`), rows with tool outputs masked
    (`episode_rows`)."""

    def __init__(self, prompts: list[Prompt], tok, sampler: Sampler, graphdef, *, make_env: Callable[[], object],
                 batch_size: int, n: int, params: SamplingParams, length: int, max_tokens: int, max_turns: int,
                 fmt: str = "hermes", workers: int = 1, seed: int = 0, shuffle: bool = True, num_iterations: int = 1,
                 scale: str = "group", advantages: str = "group"):
        super().__init__(prompts, tok, sampler, graphdef, batch_size=batch_size, n=n, params=params,
                         reward_funcs=(), reward_weights=(), length=length, seed=seed, shuffle=shuffle,
                         num_iterations=num_iterations, scale=scale, advantages=advantages)
        self.make_env, self.max_tokens, self.max_turns, self.fmt, self.workers = (
            make_env, max_tokens, max_turns, fmt, workers)
        self.last_episodes: list[SampledEpisode] = []

    def rollout(self, state, r: int) -> dict:
        self.sampler.update(merged_state(state))
        key = jax.random.fold_in(jax.random.key(self.seed), r)
        group = [self.prompts[next(self._stream)] for _ in range(self.batch_size)]
        eps = run_episodes(self.sampler, self.tok, group, self.make_env, self.params, key=key,
                           max_tokens=self.max_tokens, max_turns=self.max_turns, fmt=self.fmt, workers=self.workers,
                           stats=self._stats)
        self.last_episodes = eps
        rewards = np.array([e.reward for e in eps], np.float64)
        lengths = np.array([sum(e.mask) for e in eps])  # the policy's own tokens: the loss's
        adv = estimate_advantages(self.advantages, rewards.reshape(-1, 1), None, self.n, scale=self.scale,
                                  lengths=lengths)
        adv = np.nan_to_num(np.asarray(adv, np.float64)).reshape(self.batch_size, self.n)
        for k, v in episode_stats(eps).items():
            self._stats[k].append(v)
        self._stats["completion/length"].append(float(np.mean([len(e.ids) for e in eps])))
        self._stats["completion/truncated"].append(float(np.mean([e.truncated for e in eps])))
        return episode_rows(group, eps, self.n, self.max_tokens, self.length, self.sampler.pad_id, adv)


def evaluate(model, tok, rows: Sequence[Mapping], make_env: Callable[[], object], *, max_new_tokens: int,
             max_tokens: int, max_turns: int, fmt: str = "hermes", batch_size: int = 64, temperature: float = 0.0,
             seed: int = 0, sampler: Optional[Sampler] = None) -> dict:
    """Episodes on `rows` ({"prompt", ...}), greedy by default: {"accuracy": mean episode reward (the
    fraction solved for a 0/1 verifier), "tool_use_rate", "turns", ..., "episodes", "sampler"}. The last
    batch is padded with repeats of its last row (one compiled shape). Pass `sampler` (of the same model
    shape) to reuse its compilations."""
    prompts = [tokenize_prompt(dict(r), f"row {i}", tok, 1 << 30) for i, r in enumerate(rows)]
    longest = max(len(p.ids) for p in prompts)
    if sampler is None or sampler.cfg != model.cfg:
        sampler = Sampler(model, max_len=longest + max_tokens, pad_id=tok.pad_id, buckets=(longest,))
    else:
        sampler.update(model)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=tok.eos_ids)
    eps: list[SampledEpisode] = []
    stats: dict = defaultdict(list)
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        pad = batch_size - len(chunk) if len(prompts) > batch_size else 0
        out = run_episodes(sampler, tok, chunk + [chunk[-1]] * pad, make_env, params,
                           key=jax.random.fold_in(jax.random.key(seed), s),
                           max_tokens=max_tokens, max_turns=max_turns, fmt=fmt, stats=stats)
        eps += out[:len(chunk)]
    summary = episode_stats(eps)
    return {"accuracy": summary["reward/mean"], "tool_use_rate": summary["episode/tool_use_rate"],
            "turns": summary["episode/turns"], "truncated": summary["episode/truncated"],
            "parse_errors": summary["episode/parse_errors"], "episodes": eps, "sampler": sampler}
