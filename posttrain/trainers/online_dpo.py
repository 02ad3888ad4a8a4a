"""Online DPO recipe: the policy samples two completions per prompt, a judge picks the better, DPO loss.

`OnlineDPOTrainer(config).train()` (or `posttrain online_dpo --config ...`) is TRL 1.16's
`OnlineDPOTrainer` (trl/experimental/online_dpo) on the shared driver (`recipes.recipe`). Each step:
  1. `train.batch_size` prompts, 2 samples each from the train state's own weights (`rl.GroupRollout`
     with n = 2: one prefill per prompt, rollout r keyed fold_in(key(data.seed), r), so a resumed run
     samples what the uninterrupted one did);
  2. the judge: the reward functions of `online_dpo.rewards` (`rewards.registry`: the built-ins, a
     `reward_model` folder, or "module:function"), weighted and summed (a sample no function scored
     counts 0, TRL's nansum); minus `missing_eos_penalty` for a sample cut at max_new_tokens;
  3. TRL's pairing: the first sample is chosen unless the second scores higher (a tie keeps the
     first), the other is rejected; the prompt's row is [prompt | chosen | rejected], the DPO recipe's
     prefix-shared pair row (its score entries in [2, max_new_tokens] slots);
  4. the DPO loss (`losses.preference.dpo_loss`) against the reference: the policy with its LoRA
     adapters off (`recipes.recipe.lora_reference`) or a frozen copy of the start (full fine-tuning).
     "sigmoid" is the DPO recipe's loss; "ipo" is TRL's online IPO, (Δ − 1/(2β))² on the summed
     log-ratios (TRL's offline DPOTrainer, and `dpo.loss_type=ipo`, average them per token).
Metrics (TRL's names): loss, rewards/{chosen,rejected,margins,accuracies}, logps/{chosen,rejected},
objective/{kl,entropy,non_score_reward} (the step's), objective/{scores,scores_margin},
val/contain_eos_token, completion/length and the reward runner's rewards/<name>/* (the rollout's).

What it is not: offline DPO (trainers/dpo.py), a pairwise judge (an LLM comparing the two), or
vLLM generation.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import config as C
from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.logps import branch_logps
from posttrain.losses.preference import dpo_loss
from posttrain.models.lora import LoraParam
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model
from posttrain.recipes.recipe import Parts, Recipe, group_rows, lora_reference
from posttrain.rewards.registry import reward_functions
from posttrain.rl.rollout import GroupRollout
from posttrain.train.step import merge
from posttrain.train.trainer import frozen_copy


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineDPOSection(C.Sampling, C.Rewards):
    """Sampling and rewards as every RL section has them (`config.Sampling`, `config.Rewards`), then the loss."""

    key = "online_dpo"

    num_generations: Literal[2] = 2  # samples per prompt: one pair (fixed, as TRL)
    temperature: C.Positive = 0.9  # sampling temperature; TRL's default 0.9 (the loss uses none, as TRL)
    beta: C.Positive = 0.1  # strength of the implicit KL to the reference (IPO's tau); default 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # TRL OnlineDPOConfig.loss_type
    missing_eos_penalty: Optional[C.Positive] = None  # subtracted from the score of a sample without EOS


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineDPOConfig(C.RunConfig):
    model: C.ModelSection  # the policy (also the reference's weights; required)
    data: C.PromptDataSection  # prompts (required)
    online_dpo: OnlineDPOSection = dataclasses.field(default_factory=OnlineDPOSection)  # sampling, judge, loss
    run_dir: str = "runs/online_dpo"  # folder for checkpoints, logs and the saved config


def pair_order(scores) -> np.ndarray:
    """Sample indices [chosen_0, rejected_0, chosen_1, ...] of the pairs (2i, 2i + 1) of `scores`: TRL's rule
    (`mask = first >= second`): the first is chosen unless the second scores higher."""
    s = np.asarray(scores, np.float64).reshape(-1, 2)
    second = (s[:, 1] > s[:, 0]).astype(np.int64)
    first = 2 * np.arange(len(s))
    return np.stack([first + second, first + 1 - second], 1).reshape(-1)


def make_pair_loss(*, beta: float, loss_type: str):
    """loss_fn(policy, batch, *, frozen, rng) over [prompt | chosen | rejected] rows, `frozen` the reference:
    `dpo_loss` summed over the pairs, the metrics of `losses.dpo.make_dpo_loss` and TRL's objective/*.
    IPO gets unit lengths: TRL's OnlineDPOTrainer squares the summed log-ratio margin."""

    def loss_fn(policy, batch, *, frozen=None, rng=None):
        _, logps, counts = branch_logps(policy, batch, 2)
        ref = jax.lax.stop_gradient(branch_logps(frozen, batch, 2)[1])
        real = (counts[:, 0] > 0).astype(jnp.float32)  # padding rows and dropped pairs count nothing
        one = jnp.ones_like(real)
        losses, rc, rr = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], loss_type=loss_type, beta=beta,
                                  chosen_lengths=one, rejected_lengths=one)
        s = lambda x: jnp.sum(x * real)  # noqa: E731
        kl = s((logps - ref).sum(1)) / 2  # per sample: the sum over its tokens of log pi - log pi_ref
        return s(losses), {"denom": jnp.sum(real), "loss": s(losses), "rewards/chosen": s(rc),
                           "rewards/rejected": s(rr), "rewards/margins": s(rc - rr), "rewards/accuracies": s(rc > rr),
                           "logps/chosen": s(logps[:, 0]), "logps/rejected": s(logps[:, 1]), "objective/kl": kl,
                           "objective/non_score_reward": -beta * kl, "objective/entropy": -s(logps.sum(1)) / 2}

    return loss_fn


class PairRollout(GroupRollout):
    """A `GroupRollout` with n = 2 (same prompt stream, sampling, rewards, checkpoint state) whose rows are
    pairs: each group's two samples ordered (chosen, rejected) by their scores (`pair_order`)."""

    def __init__(self, *args, missing_eos_penalty: Optional[float] = None, **kwargs):
        super().__init__(*args, n=2, scale="none", **kwargs)
        self.eos_penalty = missing_eos_penalty

    def rollout(self, state, r: int) -> dict:
        self.sampler.update(merge(self.graphdef, state))
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


class OnlineDPOTrainer(Recipe):
    name = "online_dpo"
    help = "online DPO: pairs sampled from the policy, judged by reward functions, DPO loss"
    config_class = OnlineDPOConfig

    samples = True

    def load(self) -> None:
        c, o, tok = self.config, self.config.online_dpo, self.tokenizer
        self.prompts, self.data_stats = load_prompts(c.data.train, tok, max_prompt_length=c.data.max_prompt_length,
                                                     skip_bad_rows=c.data.skip_bad_rows)
        self.reward_funcs, self.reward_weights = reward_functions(o, tok, self.prompts, key="online_dpo")
        self.longest = max(len(p.ids) for p in self.prompts)
        self.length = -(-(self.longest + 2 * o.max_new_tokens) // 8) * 8  # [prompt | 2 slots], rounded up to 8
        self.model = build_model(c.model, tok, c.lora, self.mesh, self.rules)
        if c.data.max_prompt_length + o.max_new_tokens > self.model.cfg.max_position:
            raise PosttrainError(f"data.max_prompt_length + online_dpo.max_new_tokens exceeds the model's maximum "
                                 f"position {self.model.cfg.max_position}")
        self.loss_fn = make_pair_loss(beta=o.beta, loss_type=o.loss_type)
        if c.lora.enabled:
            self.loss_fn = lora_reference(self.loss_fn)

    def rollout(self, graphdef) -> PairRollout:
        """The batch source: pairs sampled with the state's own weights (one prompt bucket: one compile)."""
        c, o, tok = self.config, self.config.online_dpo, self.tokenizer
        sampler = Sampler(self.model, max_len=c.data.max_prompt_length + o.max_new_tokens, pad_id=tok.pad_id,
                          mesh=self.mesh, rules=self.rules, buckets=(self.longest,))
        params = SamplingParams(max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_p=o.top_p,
                                top_k=o.top_k, n=2, stop_ids=tok.eos_ids)
        return PairRollout(self.prompts, tok, sampler, graphdef, batch_size=c.train.batch_size, params=params,
                           reward_funcs=self.reward_funcs, reward_weights=self.reward_weights, length=self.length,
                           seed=c.data.seed, shuffle=c.data.shuffle, reward_timeout_s=o.reward_timeout_s,
                           on_reward_error=o.on_reward_error, missing_eos_penalty=o.missing_eos_penalty)

    def build(self) -> Parts:
        c, o = self.config, self.config.online_dpo
        mode = "adapters off" if c.lora.enabled else "frozen copy"
        return Parts(model=self.model, loss_fn=self.loss_fn, trainable=LoraParam if c.lora.enabled else nnx.Param,
                     frozen=None if c.lora.enabled else frozen_copy(self.model), batches=self.rollout,
                     flops_per_token=flops_per_token(self.model.cfg, self.length) * 4 / 3,  # + the reference forward
                     summary=(f"{len(self.prompts)} prompts ({self.data_stats}), 2 samples x {o.max_new_tokens} tokens "
                              f"each, rows of {self.length} tokens, loss {o.loss_type} beta {o.beta}, reference: "
                              f"{mode}, rewards {dict(o.rewards)}"))

    @staticmethod
    def done_line(r: dict) -> str:
        return (f"{r['step']} steps, score {r.get('objective/scores', float('nan')):.3f}, reward accuracy "
                f"{r.get('rewards/accuracies', float('nan')):.1%}")

    @classmethod
    def plan_rows(cls, c) -> tuple[int, int]:
        return group_rows(c, 2, c.online_dpo.max_new_tokens)


RECIPE = OnlineDPOTrainer
