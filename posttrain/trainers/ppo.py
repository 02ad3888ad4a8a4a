"""PPO recipe: a policy and a critic, KL-shaped per-token rewards, GAE, PPO epochs over mini-batches.

`PPOTrainer(config).train()` (or `posttrain ppo --config configs/ppo_tiny.yaml`): the RL opening of
GRPO (`recipes.rl.RLRecipe`: prompts, reward functions, policy, sampler; `rollout.devices` samples on
devices of its own), the policy (LoRA or full) and a critic, one train
step over both (`rl/ppo.make_ppo_loss`) on the shared driver, `recipes.recipe` (run folder,
resume, checkpoints, sinks, mesh as every trainer). The batch source is `rl/ppo.PPORollout`:
samples on the train state's weights, rewards, one forward for the reference log-probs and the
critic's values, −β·KL per token + the score at the last token, GAE, whitening, then
`ppo.num_iterations` passes in shuffled mini-batches of `ppo.mini_batch_size` prompts, one optimizer
step each (train.steps counts these steps).

Critic (`ppo.critic`): `separate` (its own Transformer with a value head, from the policy's start or
`ppo.critic_path`) or `shared` (a value head on the policy), one NNX module with the policy
(`rl/critic.py`, built by `recipes/critic.py`: one train state, two AdamW chains). The reference is the
policy with its LoRA adapters off (no copy) or a frozen copy of its start.

What it is not: GRPO (no critic, group advantages) or an off-policy method.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
from flax import nnx

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.errors import PosttrainError
from posttrain.losses.logps import branch_logps
from posttrain.models.lora import adapters_off
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model
from posttrain.recipes.critic import check_reward_model, ppo_model, ppo_optimizer
from posttrain.recipes.recipe import Parts
from posttrain.recipes.rl import RLRecipe
from posttrain.rl.critic import critic_values
from posttrain.rl.ppo import AdaptiveKL, FixedKL, PPORollout, make_ppo_loss
from posttrain.train import merge
from posttrain.train.trainer import frozen_copy


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOSection(C.Sampling, C.Rewards):
    """Sampling and rewards as every RL section has them (`config.Sampling`, `config.Rewards`), then PPO's
    passes, clipping, critic, GAE and KL penalty."""

    key = "ppo"
    aliases = {"kl_coef": "beta", "ppo_epochs": "num_iterations"}  # the names GRPO uses for the same things

    num_generations: C.AtLeast1 = 1  # samples per prompt (> 1: one prefix-shared row per prompt)
    num_iterations: C.AtLeast1 = 2  # μ: passes over each rollout batch (formerly ppo_epochs)
    mini_batch_size: Optional[C.AtLeast1] = None  # prompts per optimizer step; None = train.batch_size
    epsilon_low: C.NonNegative = 0.2  # policy ratio clip, lower
    epsilon_high: C.NonNegative = 0.2  # policy ratio clip, upper
    dual_clip: Optional[float] = None  # dual-clip c (> 1 + epsilon_high, e.g. 3.0); None = off
    value_clip: Optional[C.Positive] = 0.2  # value clip range around the old values; None = unclipped
    vf_coef: C.NonNegative = 0.1  # weight of the value loss
    entropy_coef: C.NonNegative = 0.0  # weight of the entropy bonus
    gamma: C.Probability = 1.0  # discount
    lam: C.Probability = 0.95  # GAE λ
    whiten_advantages: bool = True  # whiten the advantages over the rollout's tokens
    beta: C.NonNegative = 0.05  # KL weight: β of the per-token KL penalty (start value when adaptive; was kl_coef)
    kl_estimator: Literal["k1", "k3"] = "k1"  # per-token KL to the reference in the reward
    kl_target: Optional[C.Positive] = None  # adaptive KL controller's target (mean per-token KL); None = fixed β
    kl_horizon: C.AtLeast1 = 10000  # adaptive KL controller's horizon (sequences)
    missing_eos_penalty: Optional[float] = None  # subtracted from the score of a completion without a stop token
    critic: Literal["separate", "shared"] = "separate"  # own Transformer, or a value head on the policy
    critic_path: Optional[str] = None  # separate critic from this folder (reward model or causal LM); None = policy
    critic_lr: Optional[C.Positive] = None  # the critic's peak learning rate; None = optim.lr

    def __post_init__(self):
        super().__post_init__()
        checks = [
            (self.kl_target is None or self.beta > 0,
             "ppo.kl_target needs ppo.beta > 0 as its start value (or kl_target null: a fixed beta)"),
            (self.dual_clip is None or self.dual_clip > 1 + self.epsilon_high,
             f"ppo.dual_clip must be > 1 + ppo.epsilon_high (e.g. 3.0) or null, got {self.dual_clip}"),
            (not (self.critic == "shared" and self.critic_path),
             "ppo.critic_path is for ppo.critic=separate; a shared critic is a head on the policy")]
        for ok, msg in checks:
            if not ok:
                raise PosttrainError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig(C.RunConfig):
    model: C.ModelSection  # the policy (required)
    data: C.PromptDataSection  # prompts (required)
    ppo: PPOSection = dataclasses.field(default_factory=PPOSection)  # critic, rewards, KL, GAE, clipping
    rollout: C.RolloutSection = dataclasses.field(default_factory=C.RolloutSection)  # the sampler's own devices
    run_dir: str = "runs/ppo"  # folder for checkpoints, logs and the saved config


class PPOTrainer(RLRecipe):
    name = "ppo"
    help = "PPO with a critic, GAE and KL-shaped rewards from a YAML config"
    config_class = PPOConfig

    # rollout.devices only: the loss takes the sampler's log-probs as the old policy's (another precision
    # would bias every ratio; no correction is wired in)
    rollout_options = ()

    def check(self) -> None:
        super().check()
        c, p = self.config, self.config.ppo
        if c.train.batch_size % (p.mini_batch_size or c.train.batch_size):
            raise PosttrainError(f"ppo.mini_batch_size={p.mini_batch_size} must divide "
                                 f"train.batch_size={c.train.batch_size}")
        check_reward_model(p.reward_model if "reward_model" in p.rewards else None)

    def make_loss(self):
        return make_ppo_loss(**{k: getattr(self.config.ppo, k) for k in (
            "num_generations", "max_new_tokens", "temperature", "epsilon_low", "epsilon_high", "dual_clip",
            "value_clip", "vf_coef", "entropy_coef")})

    def load(self) -> None:
        super().load()  # the policy in self.model; PPO trains it with a critic, one module
        self.model, self.trainable = ppo_model(self.config, self.tokenizer, self.model, self.mesh, self.rules)

    def rollout(self, graphdef, frozen):
        """The batch source: PPORollout, with one jitted forward for the reference log-probs and the values."""
        c, p = self.config, self.config.ppo
        n, use_ref = p.num_generations, p.beta > 0
        frozen_graphdef, fz = frozen or (None, None)

        @jax.jit
        def prepare(st, batch, fz):
            with sh.use_mesh(self.mesh, self.rules):
                model = merge(graphdef, st)
                values = critic_values(model, batch)
                if not use_ref:
                    return batch["old_logps"], values  # β = 0: KL(π_old ‖ π_ref) is not needed
                ref = adapters_off(model.policy) if c.lora.enabled else nnx.merge(frozen_graphdef, fz)
                return branch_logps(ref, batch, n, temperature=p.temperature)[0], values

        kl = FixedKL(p.beta) if p.kl_target is None else AdaptiveKL(p.beta, p.kl_target, p.kl_horizon)
        return PPORollout(self.prompts, self.tokenizer, self.make_sampler(self.model.policy), graphdef, n=n,
                          params=self.sampling_params(), prepare=lambda st, b: prepare(st, b, fz), kl_controller=kl,
                          kl_estimator=p.kl_estimator, gamma=p.gamma, lam=p.lam, whiten=p.whiten_advantages,
                          num_iterations=p.num_iterations, mini_batch_size=p.mini_batch_size,
                          missing_eos_penalty=p.missing_eos_penalty, **self.rollout_kwargs())

    def build(self) -> Parts:
        c, p = self.config, self.config.ppo
        frozen = frozen_copy(self.model.policy) if p.beta > 0 and not c.lora.enabled else None
        mu = p.num_iterations * (c.train.batch_size // (p.mini_batch_size or c.train.batch_size))  # steps a rollout
        f = flops_per_token(self.model.policy.cfg, self.length)  # policy (+ critic) train, + prepare forwards
        summary = (f"{len(self.prompts)} prompts ({self.data_stats}), {p.num_generations} samples x "
                   f"{p.max_new_tokens} tokens each, rows of {self.length} tokens, {p.critic} critic, "
                   f"{p.num_iterations} passes x {mu // p.num_iterations} mini-batches per rollout, beta {p.beta} "
                   f"({'adaptive, target ' + str(p.kl_target) if p.kl_target else 'fixed'}), rewards {dict(p.rewards)}")
        # The step takes no frozen model (`prepare` reads it): Parts.frozen stays None.
        return Parts(model=self.model, loss_fn=self.loss_fn, trainable=self.trainable, optimizer=ppo_optimizer(c),
                     batches=lambda graphdef: self.rollout(graphdef, frozen), summary=summary,
                     flops_per_token=f * (1.0 if p.critic == "shared" else 2.0) + f / 3 * (1 + (p.beta > 0)) / mu)

    @staticmethod
    def done_line(r: dict) -> str:
        return (f"{r['step']} steps, reward {r.get('reward/mean', float('nan')):.3f}, "
                f"kl {r.get('kl', float('nan')):.4f}")

    @classmethod
    def run_model(cls, config, tok):
        return ppo_model(config, tok, build_model(config.model, tok, config.lora))

    @classmethod
    def exported(cls, config, model):
        """The policy alone, as a causal LM (a shared value head is dropped)."""
        policy = model.policy
        policy.score = nnx.data(None)
        return policy


RECIPE = PPOTrainer
