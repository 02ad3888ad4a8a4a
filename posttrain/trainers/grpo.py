"""GRPO-family recipe: rollouts from the train state's own weights, reward functions, prefix-shared groups.

`GRPOTrainer(config).train()` (or `posttrain grpo --config ...`): loads the tokenizer, the prompts
(TRL's prompt-only rows, other columns go to the reward functions) and the policy (LoRA or full),
builds a `Sampler` on the policy and a `rl.GroupRollout` batch source, and trains with
`losses/grpo.make_grpo_loss` (`policy_loss`: TRL 1.16's loss types, clipping, GSPO, KL) through
`train.lifecycle.run_trainer`, so the run folder, resume, checkpoints, sinks and the mesh behave
as for SFT. Each step: n samples for each of `train.batch_size` prompts (one prefill per prompt),
rewards, group advantages, and one row per prompt with its n completions as branches; a rollout
serves `grpo.num_iterations` (μ) steps. The sampler's log-probs are the "old" log-probs; with
beta = 0 there is no reference forward at all, else the reference is the policy with its LoRA
adapters off (no copy) or a frozen copy (full fine-tuning).

Reward functions (`grpo.rewards`, name -> weight): the built-ins of `posttrain.rewards`
(math_answer: the `\\boxed{}` / `####` answer against the "answer" column; last_number: the same with the
completion's last number as a fallback; format with grpo.format_pattern; overlong; reward_model with
grpo.reward_model)
or any "package.module:function" with TRL's signature `(prompts, completions, **columns)`.

With `env.enabled` (posttrain/agentic) a sample is a multi-turn episode instead: the model calls the
`tools:` (calculator, python, ...) in the `env.format`, each call's output is appended to the
episode's KV cache and generation continues, up to `env.max_turns` actions and `env.max_tokens`
tokens; `env.verifier` scores the final action (the episode's reward; grpo.rewards is not used);
tool-output tokens are context, never targets of the loss (`agentic.AgenticRollout`).

What it is not: PPO (no critic), or a server-based (vLLM) rollout.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from typing import Literal, Optional

import jax
from flax import nnx

from posttrain import config as C
from posttrain import rewards as R
from posttrain.agentic.config import EnvSection, ToolsSection, make_env_factory
from posttrain.agentic.rollout import AgenticRollout
from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.grpo import make_grpo_loss
from posttrain.models import count_params
from posttrain.models.lora import LoraParam, trainable_fraction
from posttrain.rl.rollout import GroupRollout
from posttrain.sandbox import MODES
from posttrain.train import make_train_step, merge
from posttrain.train.lifecycle import check_processes, frozen_copy, run_trainer, training_state
from posttrain.train.metrics import model_flops_per_token
from posttrain.trainers.sft import build_mesh, build_model, build_tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptDataSection:
    train: str  # prompt rows: {"prompt": str | [messages], other columns...} (.jsonl, .parquet, folder)
    max_prompt_length: int = 256  # the sampler's prompt budget in tokens; longer prompts are row errors
    skip_bad_rows: bool = False  # skip (and count) bad rows instead of raising
    shuffle: bool = True  # shuffle the prompt stream every epoch
    seed: int = 0  # shuffle seed

    def __post_init__(self):
        if self.max_prompt_length < 1:
            raise PosttrainError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOSection:
    num_generations: int = 8  # samples per prompt (the group size n)
    max_new_tokens: int = 64  # completion budget per sample
    temperature: float = 1.0  # sampling temperature (the loss uses the same one)
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = 0  # top-k sampling; 0 = off
    num_iterations: int = 1  # μ: optimisation steps per rollout batch
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    epsilon_low: float = 0.2  # lower clip range
    epsilon_high: float = 0.2  # upper clip range (DAPO clip-higher: 0.28)
    delta: Optional[float] = None  # two-sided cap on the ratio (INTELLECT-2); None = off
    beta: float = 0.0  # KL weight to the reference; 0 = no reference forward
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence = GSPO
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantage scaling (TRL's scale_rewards)
    # reward -> weight: built-ins (math_answer, last_number, countdown, format, overlong, reward_model)
    # or "module:function"
    rewards: dict[str, float] = dataclasses.field(default_factory=lambda: {"math_answer": 1.0})
    format_pattern: Optional[str] = None  # regex for the "format" reward (full match)
    overlong_cache: int = 0  # DAPO soft overlong penalty: tokens of the soft zone before max_new_tokens
    reward_model: Optional[str] = None  # a *ForSequenceClassification folder for the "reward_model" reward
    reward_timeout_s: Optional[float] = 60.0  # a reward call running longer counts as failed
    # where code_tests runs model-written code: auto (bwrap, else a fresh uid as root), bwrap, uid, or
    # unsafe_inprocess_guard (a Python-level guard only; warns). See posttrain/sandbox and docs/security.md
    sandbox: str = "auto"
    on_reward_error: Literal["zero", "drop"] = "zero"  # failed reward: 0, or drop the samples from the loss
    dynamic_sampling: bool = False  # DAPO: replace groups whose rewards do not vary
    max_refills: int = 3  # dynamic sampling: extra rollouts per step at most

    def __post_init__(self):
        if self.num_generations < 2:
            raise PosttrainError(f"grpo.num_generations must be >= 2 (advantages compare samples of a prompt), "
                                 f"got {self.num_generations}")
        if self.max_new_tokens < 1 or self.num_iterations < 1:
            raise PosttrainError("grpo.max_new_tokens and grpo.num_iterations must be >= 1")
        if not self.temperature > 0:
            raise PosttrainError(f"grpo.temperature must be > 0 (RL samples), got {self.temperature}")
        if not self.rewards:
            raise PosttrainError("grpo.rewards is empty; name at least one reward function, e.g. {math_answer: 1.0}")
        if self.beta < 0:
            raise PosttrainError(f"grpo.beta must be >= 0, got {self.beta}")
        for name, w in self.rewards.items():
            if not math.isfinite(w):
                raise PosttrainError(f"grpo.rewards.{name}: the weight must be a finite number, got {w}")
        if self.epsilon_low < 0 or self.epsilon_high < 0 or self.max_refills < 0:
            raise PosttrainError("grpo.epsilon_low, grpo.epsilon_high and grpo.max_refills must be >= 0")
        if not 0 <= self.overlong_cache <= self.max_new_tokens:
            raise PosttrainError(f"grpo.overlong_cache must be in [0, grpo.max_new_tokens={self.max_new_tokens}], "
                                 f"got {self.overlong_cache}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    model: C.ModelSection  # the policy (required)
    data: PromptDataSection  # prompts (required)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)  # sampling, loss, rewards
    optim: C.OptimSection = dataclasses.field(default_factory=C.OptimSection)  # AdamW + lr schedule
    lora: C.LoraSection = dataclasses.field(default_factory=C.LoraSection)  # adapters; off by default
    train: C.TrainSection = dataclasses.field(default_factory=C.TrainSection)  # steps; batch = prompts per step
    checkpoint: C.CheckpointSection = dataclasses.field(default_factory=C.CheckpointSection)  # save / resume
    metrics: C.MetricsSection = dataclasses.field(default_factory=C.MetricsSection)  # metric sinks, MFU
    profile: C.ProfileSection = dataclasses.field(default_factory=C.ProfileSection)  # JAX profiler window
    sharding: C.ShardingSection = dataclasses.field(default_factory=C.ShardingSection)  # device mesh
    env: EnvSection = dataclasses.field(default_factory=EnvSection)  # multi-turn tool episodes; off by default
    tools: ToolsSection = dataclasses.field(default_factory=ToolsSection)  # the tools episodes may call
    run_dir: str = "runs/grpo"  # folder for checkpoints, logs and the saved config

    def __post_init__(self):
        if self.env.enabled:
            if self.grpo.rewards != {"math_answer": 1.0}:
                raise PosttrainError("grpo.rewards is not used with env.enabled (env.verifier scores each episode); "
                                     "remove it or set env.verifier")
            if self.grpo.dynamic_sampling or self.grpo.overlong_cache:
                raise PosttrainError("grpo.dynamic_sampling and grpo.overlong_cache are not supported with "
                                     "env.enabled; turn them off")


def _check_signature(fn, name: str, columns) -> None:
    """A 'module:function' reward must take what the runner passes it (prompts, completions, completion_ids
    and the data columns, as keywords); otherwise every call would fail, zeroed, and the run learn nothing."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the runner counts its failures
        return
    bind = sig.bind if columns is not None else sig.bind_partial  # columns unknown: no "missing argument"
    try:
        bind(**dict.fromkeys(["prompts", "completions", "completion_ids", *(columns or ())]))
    except TypeError as err:
        raise PosttrainError(f"grpo.rewards: {name!r} cannot take a reward function's arguments ({err}); it is "
                             "called as f(prompts=..., completions=..., completion_ids=..., **data columns"
                             f" ({', '.join(columns or ()) or 'none'})), so define it as def f(prompts, completions, "
                             "**kwargs)") from None


def reward_functions(g: GRPOSection, tok, prompts=None) -> tuple[list, list[float]]:
    """(functions, weights) named by grpo.rewards; unknown names are config errors. `prompts`: the
    prompt rows, whose data columns the functions get (an imported function's signature is checked
    against them; None: not checked for missing arguments)."""
    columns = None if prompts is None else sorted({k for q in prompts for k in q.columns})
    funcs = []
    if g.sandbox not in MODES:
        raise PosttrainError(f"sandbox: unknown mode {g.sandbox!r}; use one of {', '.join(MODES)}")
    for name in g.rewards:
        if name == "math_answer":
            funcs.append(R.math_answer)
        elif name == "last_number":  # the same check, falling back to the completion's last number
            funcs.append(R.math_answer_reward(last_number=True, name="last_number"))
        elif name == "countdown":  # the expression over the row's "nums" equals its "target"
            funcs.append(R.countdown)
        elif name == "code_tests":  # the completion's code against the row's "tests", in a limited subprocess
            funcs.append(R.code_tests_reward(sandbox=g.sandbox))
        elif name == "format":
            if not g.format_pattern:
                raise PosttrainError("grpo.rewards names 'format' but grpo.format_pattern is not set")
            funcs.append(R.format_reward(g.format_pattern))
        elif name == "overlong":
            funcs.append(R.overlong_penalty(g.max_new_tokens, g.overlong_cache, tokenizer=tok))
        elif name == "reward_model":
            if not g.reward_model:
                raise PosttrainError("grpo.rewards names 'reward_model' but grpo.reward_model (a folder) is not set")
            funcs.append(R.reward_model_reward(R.RewardModel(g.reward_model)))
        elif ":" in name:
            mod, _, attr = name.partition(":")
            try:
                fn = getattr(importlib.import_module(mod), attr)
            except Exception as err:  # ImportError, AttributeError, SyntaxError in the user's module, ...
                raise PosttrainError(f"grpo.rewards: cannot import {name!r} ({type(err).__name__}: {err}); give "
                                     "'package.module:function'") from None
            if not callable(fn):
                raise PosttrainError(f"grpo.rewards: {name!r} is not a function")
            _check_signature(fn, name, columns)
            funcs.append(fn)
        else:
            raise PosttrainError(f"grpo.rewards: unknown reward {name!r}; use math_answer, last_number, countdown, "
                                 "code_tests, format, overlong, reward_model, or 'package.module:function'")
    return funcs, [float(w) for w in g.rewards.values()]


class GRPOTrainer:
    def __init__(self, config: GRPOConfig, *, progress: bool = True):
        self.config = c = config
        self.progress = progress
        check_processes(c)
        if c.train.micro_batch_size not in (None, c.train.batch_size):
            raise PosttrainError("train.micro_batch_size is not supported by grpo (the policy loss normalises over "
                                 "the whole batch); lower train.batch_size instead")
        if jax.process_count() > 1:
            raise PosttrainError("posttrain grpo runs in one process for now (the sampler's multi-process "
                                 "placement is not built); run it without --distributed")
        if c.lora.enabled and c.lora.dropout > 0:
            raise PosttrainError("lora.dropout must be 0 for grpo: the sampler would sample from a noised policy "
                                 "and its log-probs would no longer be the trainer's")
        if c.train.eval_every:
            raise PosttrainError("train.eval_every is not supported by grpo (no evaluation set); set it to 0")
        self.tokenizer = build_tokenizer(c.model)
        self.prompts, self.data_stats = load_prompts(c.data.train, self.tokenizer,
                                                     max_prompt_length=c.data.max_prompt_length,
                                                     skip_bad_rows=c.data.skip_bad_rows)
        g = c.grpo
        self.agentic = c.env.enabled
        if self.agentic:  # episodes: the env's verifier is the reward; a row slot holds a whole episode
            self.make_env = make_env_factory(c.env, c.tools)
            self.reward_funcs, self.reward_weights, width, what = [], [], c.env.max_tokens, "env.max_tokens"
        else:
            self.reward_funcs, self.reward_weights = reward_functions(c.grpo, self.tokenizer, self.prompts)
            width, what = g.max_new_tokens, "grpo.max_new_tokens"
        self.width = width  # tokens after the prompt per sample: the score slot width of a group row
        up = lambda x: -(-x // 8) * 8  # noqa: E731
        self.length = up(max(len(p.ids) for p in self.prompts) + g.num_generations * width)
        self.mesh, self.rules = build_mesh(c.sharding)
        self.model = build_model(c.model, self.tokenizer, c.lora, self.mesh, self.rules)
        if c.data.max_prompt_length + width > self.model.cfg.max_position:
            raise PosttrainError(f"data.max_prompt_length + {what} exceeds the model's maximum position "
                                 f"{self.model.cfg.max_position}")
        self.trainable = LoraParam if c.lora.enabled else nnx.Param
        self.loss_fn = make_grpo_loss(num_generations=g.num_generations, max_new_tokens=width,
                                      temperature=g.temperature, loss_type=g.loss_type, epsilon_low=g.epsilon_low,
                                      epsilon_high=g.epsilon_high, beta=g.beta, delta=g.delta,
                                      importance_sampling_level=g.importance_sampling_level,
                                      reference="adapters_off" if c.lora.enabled else "frozen")

    def setup(self) -> dict:
        c, g, tok = self.config, self.config.grpo, self.tokenizer
        frozen = frozen_graphdef = None
        if g.beta and not c.lora.enabled:  # full fine-tuning with a KL term: a frozen copy of the start
            frozen_graphdef, frozen = frozen_copy(self.model)
        graphdef, state, optimizer, lr = training_state(c, self.model, trainable=self.trainable, mesh=self.mesh,
                                                        rules=self.rules)
        raw = make_train_step(self.loss_fn, optimizer, graphdef, schedule=lr, frozen_graphdef=frozen_graphdef,
                              trainable=self.trainable, mesh=self.mesh, rules=self.rules)
        # one prompt bucket (the longest prompt's): prefill and decode compile once for the whole run
        longest = max(len(p.ids) for p in self.prompts)
        sampler = Sampler(self.model, max_len=c.data.max_prompt_length + self.width, pad_id=tok.pad_id,
                          mesh=self.mesh, rules=self.rules, buckets=(longest,))
        params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                top_k=g.top_k, n=g.num_generations, stop_ids=tok.eos_ids)
        common = dict(batch_size=c.train.batch_size, n=g.num_generations, params=params, length=self.length,
                      seed=c.data.seed, shuffle=c.data.shuffle, num_iterations=g.num_iterations, scale=g.scale_rewards)
        if self.agentic:
            rollout = AgenticRollout(self.prompts, tok, sampler, graphdef, make_env=self.make_env,
                                     max_tokens=c.env.max_tokens, max_turns=c.env.max_turns, fmt=c.env.format,
                                     workers=c.env.tool_workers, **common)
        else:
            rollout = GroupRollout(self.prompts, tok, sampler, graphdef, reward_funcs=self.reward_funcs,
                                   reward_weights=self.reward_weights, reward_timeout_s=g.reward_timeout_s,
                                   on_reward_error=g.on_reward_error, dynamic_sampling=g.dynamic_sampling,
                                   max_refills=g.max_refills, **common)
        return dict(graphdef=graphdef, state=state, raw_step=raw, step=lambda s, b: raw(s, b, frozen),
                    frozen=frozen, rollout=rollout, sampler=sampler)

    def train(self) -> dict:
        c, g = self.config, self.config.grpo
        n_params = count_params(self.model)
        frac = trainable_fraction(self.model) if c.lora.enabled else 1.0
        parts = self.setup()
        summary = (f"[grpo] {len(self.prompts)} prompts ({self.data_stats}), {g.num_generations} samples x "
                   f"{g.max_new_tokens} tokens each, rows of {self.length} tokens, {n_params:,} parameters, "
                   f"trainable {frac:.2%}, loss {g.loss_type}, beta {g.beta}, "
                   + (f"episodes of {c.env.max_turns} turns / {c.env.max_tokens} tokens, tools "
                      f"{', '.join(c.tools.names)}, verifier {c.env.verifier}" if self.agentic
                      else f"rewards {dict(g.rewards)}"))
        flops = model_flops_per_token(self.model.cfg, self.length) * (4 / 3 if g.beta else 1.0)
        state, result = run_trainer(c, parts["state"], parts["step"], parts["rollout"], name="grpo", mesh=self.mesh,
                                    rules=self.rules, summary=summary, progress=self.progress,
                                    flops_per_token=flops, host_metrics=parts["rollout"].metrics)
        self.model = merge(parts["graphdef"], state)
        return result
