"""GRPO-family recipe: rollouts from the train state's own weights, reward functions, prefix-shared groups.

`GRPOTrainer(config).train()` (or `posttrain grpo --config ...`): the opening every RL recipe shares
(`recipes.rl.RLRecipe`: the prompts, TRL's prompt-only rows whose other columns go to the reward
functions; the rewards; the policy, LoRA or full; the `Sampler`), a `rl.GroupRollout` batch source and
`losses/grpo.make_grpo_loss` (`policy_loss`: TRL 1.16's loss types by name, clipping, GSPO, KL) on the
shared driver (`recipes.recipe`), so the run folder, resume, checkpoints, sinks and the mesh behave as
for SFT. Each step: n samples for each of `train.batch_size` prompts (one prefill per prompt), rewards,
advantages (`grpo.advantages`: group, rloo, reinforce_pp), and one row per prompt with its n
completions as branches; a rollout serves `grpo.num_iterations` (μ) steps. The sampler's log-probs are
the "old" log-probs; with beta = 0 there is no reference forward at all, else the reference is the
policy with its LoRA adapters off (no copy) or a frozen copy (full fine-tuning).

Reward functions (`grpo.rewards`, name -> weight): the built-ins of `rewards.registry.REWARDS`
(math_answer, last_number, countdown, code_tests, format, overlong, reward_model) or any
"package.module:function" with TRL's signature `(prompts, completions, **columns)`.

With `env.enabled` (posttrain/agentic) a sample is a multi-turn episode instead: the model calls the
`tools:` (calculator, python, ...) in the `env.format`, each call's output is appended to the
episode's KV cache and generation continues, up to `env.max_turns` actions and `env.max_tokens`
tokens; `env.verifier` scores the final action (the episode's reward; grpo.rewards is not used);
tool-output tokens are context, never targets of the loss (`agentic.AgenticRollout`).

What it is not: PPO (no critic), or a server-based (vLLM) rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, Optional

from annotated_types import Ge

from posttrain import config as C
from posttrain.agentic.config import EnvSection, ToolsSection, make_env_factory
from posttrain.agentic.rollout import AgenticRollout
from posttrain.errors import PosttrainError
from posttrain.losses.advantages import ESTIMATORS
from posttrain.losses.grpo import make_grpo_loss
from posttrain.losses.policy import POLICY_LOSSES
from posttrain.plan import flops_per_token
from posttrain.recipes.build import model_vision, trainable_filter
from posttrain.recipes.recipe import Parts, group_rows, lora_reference
from posttrain.recipes.rl import RLRecipe
from posttrain.rl.offpolicy import StaleRollout
from posttrain.rl.rollout import GroupRollout
from posttrain.train.trainer import frozen_copy
from posttrain.vision.batched import forward_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOSection(C.Sampling, C.Rewards):
    """Sampling (num_generations, max_new_tokens, temperature, top_p, top_k) and rewards (rewards, sandbox,
    ...) as every RL section has them (`config.Sampling`, `config.Rewards`), then GRPO's loss."""

    key = "grpo"

    num_generations: Annotated[int, Ge(2)] = 8  # samples per prompt (the group size n; advantages compare them)
    num_iterations: C.AtLeast1 = 1  # μ: optimisation steps per rollout batch
    # the policy loss (TRL 1.16's loss_type): token / sequence normalisation, clipping variant
    # (losses.policy.POLICY_LOSSES: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo; a function registered with
    # losses.policy.register_policy_loss adds a name)
    loss_type: str = "dapo"
    epsilon_low: C.NonNegative = 0.2  # lower clip range
    epsilon_high: C.NonNegative = 0.2  # upper clip range (DAPO clip-higher: 0.28)
    delta: Optional[C.Positive] = None  # two-sided cap on the ratio (INTELLECT-2); None = off
    beta: C.NonNegative = 0.0  # KL weight to the reference; 0 = no reference forward
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence = GSPO
    # advantage estimator (losses.advantages.ESTIMATORS): group (GRPO), rloo (TRL's RLOO), reinforce_pp
    # (REINFORCE++-baseline); a function registered with losses.advantages.register_advantages adds a name
    advantages: str = "group"
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantage scaling (TRL's scale_rewards; group only)
    dynamic_sampling: bool = False  # DAPO: replace groups whose rewards do not vary
    max_refills: C.Count = 3  # dynamic sampling: extra rollouts per step at most

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type not in POLICY_LOSSES:
            raise PosttrainError(f"grpo.loss_type must be one of {', '.join(POLICY_LOSSES)}, got {self.loss_type!r}")
        if self.advantages not in ESTIMATORS:
            raise PosttrainError(f"grpo.advantages must be one of {', '.join(sorted(ESTIMATORS))}, got "
                                 f"{self.advantages!r}")
        if self.advantages != "group" and self.scale_rewards != "group":
            raise PosttrainError(f"grpo.scale_rewards={self.scale_rewards} scales the group estimator only; remove it "
                                 f"or set grpo.advantages=group (now {self.advantages})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig(C.RunConfig):
    model: C.ModelSection  # the policy (required)
    data: C.PromptDataSection  # prompts (required)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)  # sampling, loss, rewards
    env: EnvSection = dataclasses.field(default_factory=EnvSection)  # multi-turn tool episodes; off by default
    tools: ToolsSection = dataclasses.field(default_factory=ToolsSection)  # the tools episodes may call
    rollout: C.RolloutSection = dataclasses.field(default_factory=C.RolloutSection)  # sampling precision, correction
    moe: C.MoESection = dataclasses.field(default_factory=C.MoESection)  # routing replay (MoE models)
    run_dir: str = "runs/grpo"  # folder for checkpoints, logs and the saved config

    def __post_init__(self):
        compute = self.model.compute_dtype or self.model.dtype
        own = self.rollout.dtype in (None, compute)  # exact log-probs
        own = own and self.rollout.kv_dtype in (None, self.rollout.dtype or compute)  # a cache stored in another dtype
        if not own and (self.env.enabled or self.grpo.num_iterations > 1):
            raise PosttrainError("rollout.dtype other than model.dtype (or a rollout.kv_dtype other than it) needs "
                                 "grpo.num_iterations=1 and env.enabled=false "
                                 "for now (the old policy is then the trainer's own); change one of them")
        if self.rollout.max_staleness and (self.env.enabled or self.grpo.num_iterations > 1 or not own):
            raise PosttrainError("rollout.max_staleness needs grpo.num_iterations=1, env.enabled=false and the model's "
                                 "own sampling precision for now; change one of them")
        if self.rollout.is_mode and own:
            raise PosttrainError(f"rollout.is_mode={self.rollout.is_mode} corrects a sampler in another precision, but "
                                 "rollout.dtype is the model's (its log-probs are exact); set rollout.dtype "
                                 "(or rollout.kv_dtype) or drop it")
        if self.env.enabled:
            if self.grpo.rewards != {"math_answer": 1.0}:
                raise PosttrainError("grpo.rewards is not used with env.enabled (env.verifier scores each episode); "
                                     "remove it or set env.verifier")
            if self.grpo.dynamic_sampling or self.grpo.overlong_cache:
                raise PosttrainError("grpo.dynamic_sampling and grpo.overlong_cache are not supported with "
                                     "env.enabled; turn them off")


class GRPOTrainer(RLRecipe):
    name = "grpo"
    help = "GRPO-family RL with reward functions from a YAML config"
    config_class = GRPOConfig

    # policy_loss corrects another sampler's log-probs
    rollout_options = ("dtype", "kv_dtype", "is_mode", "max_staleness")
    takes_images = True  # image prompts with a Qwen3-VL or Gemma 3 folder (rl/images.py; tower frozen unless
    # model.train_vision)

    def slot_width(self) -> tuple[int, str]:
        """An agentic episode takes up to env.max_tokens slots."""
        c = self.config
        return (c.env.max_tokens, "env.max_tokens") if c.env.enabled else (c.grpo.max_new_tokens, "grpo.max_new_tokens")

    def rewards(self) -> tuple[list, list]:
        """With env.enabled the env's verifier is the episode's reward (no reward functions)."""
        self.agentic = self.config.env.enabled
        if self.agentic:
            self.make_env = make_env_factory(self.config.env, self.config.tools)
            return [], []
        return super().rewards()

    def make_loss(self):
        c, g = self.config, self.config.grpo
        if c.moe.routing_replay and (not self.model.cfg.num_experts or self.agentic):
            raise PosttrainError("moe.routing_replay needs a mixture-of-experts model and env.enabled=false; set "
                                 "moe.routing_replay=false")
        self.vision = model_vision(self.model) if any(p.pixels is not None for p in self.prompts) else None
        if self.vision is not None and self.agentic:
            raise PosttrainError("image prompts with env.enabled are not supported yet; use text prompts or "
                                 "env.enabled=false")
        loss_fn = make_grpo_loss(num_generations=g.num_generations, max_new_tokens=self.width,
                                 temperature=g.temperature, loss_type=g.loss_type, epsilon_low=g.epsilon_low,
                                 epsilon_high=g.epsilon_high, beta=g.beta, delta=g.delta,
                                 importance_sampling_level=g.importance_sampling_level,
                                 is_mode=c.rollout.is_mode, is_clip_max=c.rollout.is_clip_max,
                                 is_clip_min=c.rollout.is_clip_min,
                                 forward=forward_rows if self.vision is not None else None)
        return lora_reference(loss_fn) if g.beta and c.lora.enabled else loss_fn

    def rollout(self, graphdef):
        """The batch source: a GroupRollout (or AgenticRollout) sampling with the state's own weights."""
        c, g, tok = self.config, self.config.grpo, self.tokenizer
        sampler = self.make_sampler()
        params = self.sampling_params(record_routes=c.moe.routing_replay)
        common = dict(batch_size=c.train.batch_size, n=g.num_generations, params=params, length=self.length,
                      seed=c.data.seed, shuffle=c.data.shuffle, num_iterations=g.num_iterations, scale=g.scale_rewards,
                      advantages=g.advantages)
        if self.agentic:
            return AgenticRollout(self.prompts, tok, sampler, graphdef, make_env=self.make_env,
                                  max_tokens=c.env.max_tokens, max_turns=c.env.max_turns, fmt=c.env.format,
                                  workers=c.env.tool_workers, **common)
        rollout = GroupRollout(self.prompts, tok, sampler, graphdef, **{**self.rollout_kwargs(), **common},
                               dynamic_sampling=g.dynamic_sampling, max_refills=g.max_refills, vision=self.vision)
        return StaleRollout(rollout, c.rollout.max_staleness) if c.rollout.max_staleness else rollout

    def build(self) -> Parts:
        c, g = self.config, self.config.grpo
        full_ref = g.beta and not c.lora.enabled  # full fine-tuning with a KL term: a frozen copy of the start
        summary = (f"{len(self.prompts)} prompts ({self.data_stats}), {g.num_generations} samples x "
                   f"{g.max_new_tokens} tokens each, rows of {self.length} tokens, loss {g.loss_type}, beta {g.beta}, "
                   + (f"episodes of {c.env.max_turns} turns / {c.env.max_tokens} tokens, tools "
                      f"{', '.join(c.tools.names)}, verifier {c.env.verifier}" if self.agentic
                      else f"rewards {dict(g.rewards)}"))
        trainable = trainable_filter(c.model, c.lora, self.model)  # a VLM's tower frozen unless train_vision
        return Parts(model=self.model, loss_fn=self.loss_fn, trainable=trainable,
                     frozen=frozen_copy(self.model) if full_ref else None, batches=self.rollout, summary=summary,
                     flops_per_token=flops_per_token(self.model.cfg, self.length) * (4 / 3 if g.beta else 1.0))

    @staticmethod
    def done_line(r: dict) -> str:
        return f"{r['step']} steps, reward {r.get('reward/mean', float('nan')):.3f}"

    @classmethod
    def plan_rows(cls, c) -> tuple[int, int]:
        """`group_rows`; an agentic episode takes up to env.max_tokens slots."""
        return group_rows(c, c.grpo.num_generations, c.env.max_tokens if c.env.enabled else c.grpo.max_new_tokens)


RECIPE = GRPOTrainer
