"""The RL recipe base: the opening every sampling recipe shares (GRPO, PPO, online DPO, and a new one).

What it is: `RLRecipe`, a `Recipe` whose policy samples while it trains. Its config has an RL section named
as the recipe (`grpo:`, `ppo:`, `online_dpo:`, ...: `config.Sampling` + `config.Rewards`, `self.section`)
and optionally a `rollout:` section (`config.RolloutSection`). `RLRecipe.load()` does what they all did
alike: the prompts (TRL's prompt-only rows; other columns go to the reward functions), the reward functions
(`rewards.registry`), the row length (the longest prompt + n completion slots, rounded up to 8), the policy
(LoRA or full, on the mesh) and the position check; then the recipe's `make_loss()`. A recipe with
`takes_images` reads TRL's vision prompt rows with a Qwen3-VL or Gemma 3 folder (`self.images`, `data.prompts`).
For the batch source:
  - `make_sampler(model)`: one prompt bucket (the longest prompt's: prefill and decode compile once), on the
    sampler's own devices when `rollout.devices` is set (a data-parallel mesh of the last devices, the
    weights pushed there after every update) or the training mesh, in `rollout.dtype`;
  - `sampling_params(**extra)`: the section's SamplingParams (n = num_generations, the tokenizer's stops);
  - `rollout_kwargs()`: the GroupRollout keywords every rollout shares (prompts, sampling, rewards, seed).
A recipe names what its loss can take of the rollout section (`rollout_options`): `devices` always;
`dtype` (a sampler in another precision), `kv_dtype` (its KV cache stored in another: float8, int8),
`is_mode` (the sampler/trainer mismatch correction) and
`max_staleness` (off-policy batches) where its loss supports them; the others are refused in `check()`.

A new RL recipe is a config (an RL section + `rollout:`), `make_loss()` and `build()` (tests/
test_seventh_trainer.py adds one). Advantage estimators (`losses.advantages`) and policy-loss variants
(`losses.policy`) are registered by name, so RLOO or REINFORCE++ are settings (`grpo.advantages`).

What it is not: a rollout (`posttrain.rl`), a loss (`posttrain.losses`) or the driver (`recipes.recipe`).
"""

from __future__ import annotations

from typing import ClassVar

from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.recipes.build import build_model, image_spec
from posttrain.recipes.recipe import Recipe, group_rows
from posttrain.rewards.registry import reward_functions
from posttrain.sharding import make_mesh, preset_rules

# the rollout section's keys a recipe may not support
ROLLOUT_OPTIONS = ("dtype", "kv_dtype", "is_mode", "max_staleness")


def round_up(x: int, to: int = 8) -> int:
    return -(-x // to) * to


class RLRecipe(Recipe):
    """Base of the sampling recipes; see the module docstring."""

    samples = True
    rollout_options: ClassVar[tuple] = ()  # of ROLLOUT_OPTIONS, what this recipe's loss supports
    takes_images: ClassVar[bool] = False  # reads TRL's vision prompt rows with a VLM folder (self.images)

    @property
    def section(self):
        """The recipe's RL section (`config.<name>`: sampling, rewards, loss)."""
        return getattr(self.config, self.name)

    # ---------------------------------------------------------------- what a recipe may change
    def slot_width(self) -> tuple[int, str]:
        """(tokens after the prompt per sample: a row's completion slot, the key that sets it)."""
        return self.section.max_new_tokens, f"{self.name}.max_new_tokens"

    def num_samples(self) -> int:
        """Completions per prompt (the slots of a row)."""
        return self.section.num_generations

    def rewards(self) -> tuple[list, list]:
        """(reward functions, weights) of the RL section (`rewards.registry.reward_functions`)."""
        return reward_functions(self.section, self.tokenizer, self.prompts, key=self.name)

    def make_loss(self):
        """The loss_fn(policy, batch, *, frozen, rng) of the recipe (called at the end of `load`)."""
        raise NotImplementedError

    def check(self) -> None:
        rollout = getattr(self.config, "rollout", None)
        if rollout is None:
            return
        for key in ROLLOUT_OPTIONS:
            if getattr(rollout, key) and key not in self.rollout_options:
                raise PosttrainError(f"rollout.{key} is not supported by {self.name} (it supports "
                                     f"{', '.join(['devices', *self.rollout_options])}); remove it")

    # ---------------------------------------------------------------- the shared opening
    def load(self) -> None:
        c, tok = self.config, self.tokenizer
        self.images = image_spec(c.model, tok) if self.takes_images else None  # a VLM folder: image prompts
        self.prompts, self.data_stats = load_prompts(c.data.train, tok, max_prompt_length=c.data.max_prompt_length,
                                                     skip_bad_rows=c.data.skip_bad_rows, images=self.images)
        self.longest = max(len(p.ids) for p in self.prompts)
        self.width, what = self.slot_width()
        self.length = round_up(self.longest + self.num_samples() * self.width)  # [prompt | n slots]
        self.reward_funcs, self.reward_weights = self.rewards()
        self.model = build_model(c.model, tok, c.lora, self.mesh, self.rules, images=self.takes_images)
        if c.data.max_prompt_length + self.width > self.model.cfg.max_position:
            raise PosttrainError(f"data.max_prompt_length + {what} exceeds the model's maximum position "
                                 f"{self.model.cfg.max_position}")
        self.loss_fn = self.make_loss()

    def make_sampler(self, model=None) -> Sampler:
        """The sampler of `model` (default: self.model): one prompt bucket, rollout.devices and rollout.dtype."""
        c = self.config
        rollout = getattr(c, "rollout", None)
        own = self.sampler_devices is not None  # rollout.devices: the sampler's own mesh (data parallel)
        mesh, rules = (make_mesh("dp", self.sampler_devices), preset_rules("dp")) if own else (self.mesh, self.rules)
        return Sampler(self.model if model is None else model, max_len=c.data.max_prompt_length + self.width,
                       pad_id=self.tokenizer.pad_id, mesh=mesh, rules=rules, buckets=(self.longest,),
                       dtype=rollout.dtype if rollout is not None else None, own_mesh=own,
                       kv_dtype=rollout.kv_dtype if rollout is not None else None)

    def sampling_params(self, **extra) -> SamplingParams:
        s = self.section
        return SamplingParams(**{**dict(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                        top_k=s.top_k, n=self.num_samples(), stop_ids=self.tokenizer.eos_ids),
                                 **extra})

    def rollout_kwargs(self) -> dict:
        """The keywords of `rl.GroupRollout` (and its subclasses) after (prompts, tok, sampler, graphdef)."""
        c, s = self.config, self.section
        return dict(batch_size=c.train.batch_size, length=self.length, seed=c.data.seed, shuffle=c.data.shuffle,
                    reward_funcs=self.reward_funcs, reward_weights=self.reward_weights,
                    reward_timeout_s=s.reward_timeout_s, on_reward_error=s.on_reward_error)

    @classmethod
    def plan_rows(cls, c) -> tuple[int, int]:
        s = getattr(c, cls.name)
        return group_rows(c, s.num_generations, s.max_new_tokens)
