"""Online DPO's rollout: two samples per prompt from the train state's weights, judged, ordered into pairs.

What it is: `PairRollout`, a `GroupRollout` with n = 2 (the same prompt stream, sampling, reward runner
and checkpoint state) whose rows are preference pairs [prompt | chosen | rejected]: each prompt's two
samples scored by the reward functions (weighted, summed; a sample no function scored counts 0, TRL's
nansum), minus `missing_eos_penalty` for a sample cut at max_new_tokens, then ordered by `pair_order`
(TRL 1.16 OnlineDPOTrainer's rule: the first is chosen unless the second scores higher). Statistics
(TRL's names): objective/scores, objective/scores_margin, val/contain_eos_token, completion/length.

What it is not: the loss (`losses.dpo.make_pair_loss`) or the recipe (`trainers/online_dpo.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from posttrain.rl.rollout import GroupRollout
from posttrain.train.step import merged_state


def pair_order(scores) -> np.ndarray:
    """Sample indices [chosen_0, rejected_0, chosen_1, ...] of the pairs (2i, 2i + 1) of `scores`: TRL's rule
    (`mask = first >= second`): the first is chosen unless the second scores higher."""
    s = np.asarray(scores, np.float64).reshape(-1, 2)
    second = (s[:, 1] > s[:, 0]).astype(np.int64)
    first = 2 * np.arange(len(s))
    return np.stack([first + second, first + 1 - second], 1).reshape(-1)


class PairRollout(GroupRollout):
    """A `GroupRollout` with n = 2 (same prompt stream, sampling, rewards, checkpoint state) whose rows are
    pairs: each group's two samples ordered (chosen, rejected) by their scores (`pair_order`)."""

    def __init__(self, *args, missing_eos_penalty: Optional[float] = None, **kwargs):
        super().__init__(*args, n=2, scale="none", **kwargs)
        self.eos_penalty = missing_eos_penalty

    def rollout(self, state, r: int) -> dict:
        self.sampler.update(merged_state(state))
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), r), 0)
        group, out, _, keep, total = self._sample(key, self.batch_size)
        eos = np.array([f == "stop" for f in out.finish_reasons])
        scores = np.nan_to_num(total.reshape(-1), nan=0.0)  # TRL: nansum over the functions
        if self.eos_penalty:
            scores = scores - self.eos_penalty * ~eos
        order = pair_order(scores)
        out = dataclasses.replace(out, tokens=out.tokens[order], logprobs=out.logprobs[order],
                                  lengths=out.lengths[order], finish_reasons=[out.finish_reasons[i] for i in order],
                                  routes=None if out.routes is None else out.routes[order])
        keep = np.repeat(keep.reshape(-1, 2).all(1), 2)  # a sample dropped (on_reward_error=drop) drops its pair
        pairs = scores[order].reshape(-1, 2)
        for k, v in {"objective/scores": scores.mean(), "objective/scores_margin": (pairs[:, 0] - pairs[:, 1]).mean(),
                     "val/contain_eos_token": eos.mean(), "completion/length": out.lengths.mean()}.items():
            self._stats[k].append(float(v))
        batch = self.rows(group, out, np.zeros((self.batch_size, 2)), keep)
        for k in ("old_logps", "sampler_logps", "advantages"):  # policy-gradient fields the DPO loss does not read
            batch.pop(k, None)
        return batch
