"""Online DPO recipe: the policy samples two completions per prompt, a judge picks the better, DPO loss.

`OnlineDPOTrainer(config).train()` (or `posttrain online_dpo --config ...`) is TRL 1.16's
`OnlineDPOTrainer` (trl/experimental/online_dpo) on the shared driver (`recipes.recipe`) and the RL opening
(`recipes.rl.RLRecipe`: prompts, rewards, policy, sampler; `rollout.devices` and `rollout.dtype` as GRPO's).
Each step:
  1. `train.batch_size` prompts, 2 samples each from the train state's own weights (`rl.pairs.PairRollout`,
     a GroupRollout with n = 2: one prefill per prompt, rollout r keyed fold_in(key(data.seed), r), so a
     resumed run samples what the uninterrupted one did);
  2. the judge: the reward functions of `online_dpo.rewards` (`rewards.registry`: the built-ins, a
     `reward_model` folder, or "module:function"), weighted and summed (a sample no function scored
     counts 0, TRL's nansum); minus `missing_eos_penalty` for a sample cut at max_new_tokens;
  3. TRL's pairing: the first sample is chosen unless the second scores higher (a tie keeps the
     first), the other is rejected; the prompt's row is [prompt | chosen | rejected], the DPO recipe's
     prefix-shared pair row (its score entries in [2, max_new_tokens] slots);
  4. the DPO loss (`losses.dpo.make_pair_loss`) against the reference: the policy with its LoRA
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

from flax import nnx

from posttrain import config as C
from posttrain.losses.dpo import make_pair_loss
from posttrain.models.lora import LoraParam
from posttrain.plan import flops_per_token
from posttrain.recipes.recipe import Parts, lora_reference
from posttrain.recipes.rl import RLRecipe
from posttrain.rl.pairs import PairRollout
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
    rollout: C.RolloutSection = dataclasses.field(default_factory=C.RolloutSection)  # sampler devices, precision
    run_dir: str = "runs/online_dpo"  # folder for checkpoints, logs and the saved config


class OnlineDPOTrainer(RLRecipe):
    name = "online_dpo"
    help = "online DPO: pairs sampled from the policy, judged by reward functions, DPO loss"
    config_class = OnlineDPOConfig

    rollout_options = ("dtype", "kv_dtype")  # the loss recomputes both log-probs: the sampler's precision is free

    def make_loss(self):
        o = self.config.online_dpo
        loss_fn = make_pair_loss(beta=o.beta, loss_type=o.loss_type)
        return lora_reference(loss_fn) if self.config.lora.enabled else loss_fn

    def rollout(self, graphdef) -> PairRollout:
        """The batch source: pairs sampled with the state's own weights (one prompt bucket: one compile)."""
        o = self.config.online_dpo
        return PairRollout(self.prompts, self.tokenizer, self.make_sampler(), graphdef, params=self.sampling_params(),
                           missing_eos_penalty=o.missing_eos_penalty, **self.rollout_kwargs())

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


RECIPE = OnlineDPOTrainer
