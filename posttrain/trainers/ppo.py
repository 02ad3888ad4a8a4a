"""PPO recipe: a policy and a critic, KL-shaped per-token rewards, GAE, PPO epochs over mini-batches.

`PPOTrainer(config).train()` (or `posttrain ppo --config configs/ppo_tiny.yaml`): the prompts and
reward functions of GRPO (`trainers/grpo.py`), the policy (LoRA or full) and a critic, one train
step over both (`losses/ppo.make_ppo_loss`) through `train.lifecycle.run_trainer` (run folder,
resume, checkpoints, sinks, mesh as every trainer). The batch source is `rl/ppo.PPORollout`:
samples on the train state's weights, rewards, one forward for the reference log-probs and the
critic's values, −β·KL per token + the score at the last token, GAE, whitening, then
`ppo.ppo_epochs` passes in shuffled mini-batches of `ppo.mini_batch_size` prompts, one optimizer
step each (train.steps counts these steps).

Critic (`ppo.critic`): `separate`, its own Transformer with a value head (`models/heads.py`),
started from the policy's weights or from `ppo.critic_path` (a reward-model folder keeps its score
head; a causal-LM folder gets a fresh one; LoRA, when on, applies to it too); or `shared`, the
value head on the policy's backbone. Policy and critic are one NNX module (`PolicyCritic`): one
train state, checkpoint and weights file hold both; the optimizer is `optax.multi_transform` of
two AdamW chains (own moments, clipping and schedule; the critic's lr is `ppo.critic_lr`). The
checkpoint also holds the rollout in use and β. The reference is the policy with its LoRA adapters
off (no copy) or a frozen copy of its start.

What it is not: GRPO (no critic, group advantages) or an off-policy method.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Literal, Optional

import jax
import optax
from flax import nnx

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.logps import branch_logps
from posttrain.losses.ppo import critic_values, make_ppo_loss
from posttrain.models import count_params, from_pretrained, load_config
from posttrain.models.heads import TRAINABLE_WITH_LORA, attach_score_head
from posttrain.models.hf import _tensor_files
from posttrain.models.lora import adapters_off, apply_lora
from posttrain.rl.ppo import AdaptiveKL, FixedKL, PPORollout
from posttrain.tokenizer import Tokenizer, check_same_tokenizer
from posttrain.train import make_optimizer, make_train_step, merge, schedule
from posttrain.train.lifecycle import check_processes, frozen_copy, run_trainer, training_state
from posttrain.train.metrics import model_flops_per_token
from posttrain.trainers.grpo import PromptDataSection, reward_functions
from posttrain.trainers.reward_model import _is_classifier
from posttrain.trainers.sft import build_mesh, build_model, build_tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOSection:
    num_generations: int = 1  # samples per prompt (> 1: one prefix-shared row per prompt)
    max_new_tokens: int = 64  # completion budget per sample
    temperature: float = 1.0  # sampling temperature (the loss uses the same one)
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = 0  # top-k sampling; 0 = off
    ppo_epochs: int = 2  # passes over each rollout batch
    mini_batch_size: Optional[int] = None  # prompts per optimizer step; None = train.batch_size
    epsilon_low: float = 0.2  # policy ratio clip, lower
    epsilon_high: float = 0.2  # policy ratio clip, upper
    dual_clip: Optional[float] = None  # dual-clip c (> 1 + epsilon_high, e.g. 3.0); None = off
    value_clip: Optional[float] = 0.2  # value clip range around the old values; None = unclipped
    vf_coef: float = 0.1  # weight of the value loss
    entropy_coef: float = 0.0  # weight of the entropy bonus
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE λ
    whiten_advantages: bool = True  # whiten the advantages over the rollout's tokens
    kl_coef: float = 0.05  # β of the per-token KL penalty (the start value when adaptive)
    kl_estimator: Literal["k1", "k3"] = "k1"  # per-token KL to the reference in the reward
    kl_target: Optional[float] = None  # adaptive KL controller's target (mean per-token KL); None = fixed β
    kl_horizon: int = 10000  # adaptive KL controller's horizon (sequences)
    missing_eos_penalty: Optional[float] = None  # subtracted from the score of a completion without a stop token
    critic: Literal["separate", "shared"] = "separate"  # own Transformer, or a value head on the policy
    critic_path: Optional[str] = None  # separate critic from this folder (reward model or causal LM); None = policy
    critic_lr: Optional[float] = None  # the critic's peak learning rate; None = optim.lr
    # reward -> weight, as grpo.rewards: math_answer, last_number, format, overlong, reward_model, "module:function"
    rewards: dict[str, float] = dataclasses.field(default_factory=lambda: {"math_answer": 1.0})
    format_pattern: Optional[str] = None  # regex for the "format" reward (full match)
    overlong_cache: int = 0  # DAPO soft overlong penalty zone (tokens)
    reward_model: Optional[str] = None  # a *ForSequenceClassification folder for the "reward_model" reward
    reward_timeout_s: Optional[float] = 60.0  # a reward call running longer counts as failed
    # where code_tests runs model-written code: auto (bwrap, else a fresh uid as root), bwrap, uid, or
    # unsafe_inprocess_guard (a Python-level guard only; warns). See posttrain/sandbox and docs/security.md
    sandbox: str = "auto"
    on_reward_error: Literal["zero", "drop"] = "zero"  # failed reward: 0, or drop the samples from the loss

    def __post_init__(self):
        checks = [
            (min(self.num_generations, self.max_new_tokens, self.ppo_epochs, self.mini_batch_size or 1,
                 self.kl_horizon) >= 1,
             "ppo.num_generations, max_new_tokens, ppo_epochs, mini_batch_size and kl_horizon must be >= 1"),
            (self.temperature > 0, f"ppo.temperature must be > 0 (RL samples), got {self.temperature}"),
            (0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "ppo.gamma and ppo.lam must be in [0, 1]"),
            (self.kl_coef >= 0, f"ppo.kl_coef must be >= 0, got {self.kl_coef}"),
            (self.kl_target is None or self.kl_target > 0 and self.kl_coef > 0,
             "ppo.kl_target must be > 0 (or null: a fixed kl_coef), with ppo.kl_coef > 0 as its start value"),
            (min(self.epsilon_low, self.epsilon_high, self.vf_coef, self.entropy_coef) >= 0,
             "ppo.epsilon_low, epsilon_high, vf_coef and entropy_coef must be >= 0"),
            (self.dual_clip is None or self.dual_clip > 1 + self.epsilon_high,
             f"ppo.dual_clip must be > 1 + ppo.epsilon_high (e.g. 3.0) or null, got {self.dual_clip}"),
            (self.value_clip is None or self.value_clip > 0, "ppo.value_clip must be > 0 or null (unclipped)"),
            (self.critic_lr is None or self.critic_lr > 0, "ppo.critic_lr must be > 0 or null (optim.lr)"),
            (not (self.critic == "shared" and self.critic_path),
             "ppo.critic_path is for ppo.critic=separate; a shared critic is a head on the policy"),
            (bool(self.rewards), "ppo.rewards is empty; name at least one reward function, e.g. {math_answer: 1.0}"),
            (0 <= self.overlong_cache <= self.max_new_tokens, "ppo.overlong_cache must be in [0, ppo.max_new_tokens]")]
        checks += [(math.isfinite(w), f"ppo.rewards.{k}: the weight must be a finite number") for k, w in
                   self.rewards.items()]
        for ok, msg in checks:
            if not ok:
                raise PosttrainError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    model: C.ModelSection  # the policy (required)
    data: PromptDataSection  # prompts (required)
    ppo: PPOSection = dataclasses.field(default_factory=PPOSection)  # critic, rewards, KL, GAE, clipping
    optim: C.OptimSection = dataclasses.field(default_factory=C.OptimSection)  # AdamW + lr schedule
    lora: C.LoraSection = dataclasses.field(default_factory=C.LoraSection)  # adapters (policy and critic)
    train: C.TrainSection = dataclasses.field(default_factory=C.TrainSection)  # steps = updates; batch = prompts
    checkpoint: C.CheckpointSection = dataclasses.field(default_factory=C.CheckpointSection)  # save / resume
    metrics: C.MetricsSection = dataclasses.field(default_factory=C.MetricsSection)  # metric sinks, MFU
    profile: C.ProfileSection = dataclasses.field(default_factory=C.ProfileSection)  # JAX profiler window
    sharding: C.ShardingSection = dataclasses.field(default_factory=C.ShardingSection)  # device mesh
    run_dir: str = "runs/ppo"  # folder for checkpoints, logs and the saved config


class PolicyCritic(nnx.Module):
    """The policy and its critic as one module (one train state); critic None = value head on the policy."""
    def __init__(self, policy, critic=None):
        self.policy, self.critic = policy, critic


def build_critic(c: PPOConfig, tok: Tokenizer, policy, mesh=None, rules=None):
    """The separate critic (see the module docstring), or None after attaching the shared value head."""
    p, mc = c.ppo, c.model
    if p.critic == "shared":
        attach_score_head(policy, seed=mc.seed + 1, drop_lm_head=False)
        return None
    if p.critic_path is None:
        critic = build_model(mc, tok, None, mesh, rules)  # the policy's start: same folder / preset and seed
        attach_score_head(critic, seed=mc.seed + 1)
    else:
        path = p.critic_path
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise PosttrainError(f"ppo.critic_path: {path} has no config.json; give a HF model or reward-model folder")
        cfg = load_config(path)
        if cfg.embed_dim != policy.cfg.embed_dim:
            raise PosttrainError(f"ppo.critic_path: {path} has hidden size {cfg.embed_dim} but the policy has "
                                 f"{policy.cfg.embed_dim}; use a critic of the policy's family and size")
        check_critic_tokenizer(path, tok, cfg.vocab_size)
        head = "score" if _is_classifier(path) else None  # a reward model's head is the value head's start
        critic = from_pretrained(path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules,
                                 head=head)
        if head is None:
            attach_score_head(critic, seed=mc.seed + 1)
        elif critic.score[...].shape[-1] != 1:
            raise PosttrainError(f"ppo.critic_path: {path} has {critic.score[...].shape[-1]} labels; need 1")
        critic.cfg = critic.cfg.replace(remat=mc.remat)
    if c.lora.enabled:
        apply_lora(critic, rank=c.lora.rank, alpha=c.lora.alpha, dropout=c.lora.dropout, targets=c.lora.targets,
                   seed=mc.seed + 1)
    return critic


def ppo_model(c: PPOConfig, tok: Tokenizer, policy, mesh=None, rules=None):
    """(PolicyCritic around `policy`, its trainable filter): the trainer's model, and a run's when loaded."""
    critic = build_critic(c, tok, policy, mesh, rules)
    return PolicyCritic(policy, critic), TRAINABLE_WITH_LORA if c.lora.enabled else nnx.Param


def check_critic_tokenizer(path: str, tok: Tokenizer, vocab_size: int) -> None:
    """The critic reads the policy's token ids: its tokenizer (when it has one) must be the policy's."""
    try:
        other = Tokenizer.from_pretrained(path)
    except PosttrainError:  # no tokenizer files: the vocabulary must at least cover the policy's ids
        if vocab_size < tok.vocab_size:
            raise PosttrainError(f"ppo.critic_path: {path} has a vocabulary of {vocab_size}, fewer than the "
                                 f"policy tokenizer's {tok.vocab_size} tokens; a critic must read the policy's "
                                 "token ids") from None
        return
    check_same_tokenizer(tok, other, f"ppo.critic_path: the tokenizer of {path} differs from the policy's")


def check_reward_model(path: Optional[str]) -> None:
    """ppo.reward_model must be a sequence-classifier folder with its score head (unset: reward_functions says)."""
    if path and (not _is_classifier(path) or "score.weight" not in _tensor_files(path)):
        raise PosttrainError(f"ppo.reward_model: {path} has no score head (not a *ForSequenceClassification "
                             "folder with score.weight); train one with `posttrain rm`, export it with "
                             "`posttrain export`, and point ppo.reward_model at the export")


def ppo_optimizer(c: PPOConfig):
    """multi_transform of the policy's AdamW chain (config.optim) and the critic's (lr ppo.critic_lr)."""
    critic_optim = dataclasses.replace(c.optim, lr=c.ppo.critic_lr or c.optim.lr)

    def labels(params):
        def which(path, _):
            names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            return "critic" if names[0] == "critic" or "score" in names else "policy"
        return jax.tree_util.tree_map_with_path(which, params)

    critic = make_optimizer(critic_optim, schedule(critic_optim, c.train.steps))
    policy = make_optimizer(c.optim, schedule(c.optim, c.train.steps))
    return optax.multi_transform({"policy": policy, "critic": critic}, labels)


class PPOTrainer:
    def __init__(self, config: PPOConfig, *, progress: bool = True):
        self.config = c = config
        self.progress = progress
        p = c.ppo
        check_processes(c)
        for bad, msg in [
            (c.train.micro_batch_size not in (None, c.train.batch_size),
             "train.micro_batch_size is not supported by ppo (the loss normalises over the mini-batch); use "
             "ppo.mini_batch_size"),
            (c.train.batch_size % (p.mini_batch_size or c.train.batch_size),
             f"ppo.mini_batch_size={p.mini_batch_size} must divide train.batch_size={c.train.batch_size}"),
            (jax.process_count() > 1, "posttrain ppo runs in one process for now; run it without --distributed"),
            (c.lora.enabled and c.lora.dropout > 0 or c.train.eval_every,
             "ppo needs lora.dropout = 0 (the sampler would sample a noised policy) and train.eval_every = 0")]:
            if bad:
                raise PosttrainError(msg)
        check_reward_model(p.reward_model if "reward_model" in p.rewards else None)
        self.tokenizer = build_tokenizer(c.model)
        self.prompts, self.data_stats = load_prompts(c.data.train, self.tokenizer,
                                                     max_prompt_length=c.data.max_prompt_length,
                                                     skip_bad_rows=c.data.skip_bad_rows)
        try:
            self.reward_funcs, self.reward_weights = reward_functions(p, self.tokenizer, self.prompts)
        except PosttrainError as err:  # the GRPO helper names its own section's keys
            raise PosttrainError(str(err).replace("grpo.", "ppo.")) from None
        up = lambda x: -(-x // 8) * 8  # noqa: E731
        self.length = up(max(len(q.ids) for q in self.prompts) + p.num_generations * p.max_new_tokens)
        self.mesh, self.rules = build_mesh(c.sharding)
        policy = build_model(c.model, self.tokenizer, c.lora, self.mesh, self.rules)
        if c.data.max_prompt_length + p.max_new_tokens > policy.cfg.max_position:
            raise PosttrainError(f"data.max_prompt_length + ppo.max_new_tokens exceeds the model's maximum position "
                                 f"{policy.cfg.max_position}")
        self.model, self.trainable = ppo_model(c, self.tokenizer, policy, self.mesh, self.rules)
        self.loss_fn = make_ppo_loss(**{k: getattr(p, k) for k in (
            "num_generations", "max_new_tokens", "temperature", "epsilon_low", "epsilon_high", "dual_clip",
            "value_clip", "vf_coef", "entropy_coef")})

    def setup(self) -> dict:
        c, p, tok = self.config, self.config.ppo, self.tokenizer
        n, use_ref = p.num_generations, p.kl_coef > 0
        frozen = frozen_graphdef = None
        if use_ref and not c.lora.enabled:  # full fine-tuning: a frozen copy of the policy's start
            frozen_graphdef, frozen = frozen_copy(self.model.policy)
        graphdef, state, optimizer, lr = training_state(c, self.model, trainable=self.trainable, mesh=self.mesh,
                                                        rules=self.rules, optimizer=ppo_optimizer(c))
        step = make_train_step(self.loss_fn, optimizer, graphdef, schedule=lr, trainable=self.trainable,
                               mesh=self.mesh, rules=self.rules)
        @jax.jit
        def prepare(st, batch, fz):
            with sh.use_mesh(self.mesh, self.rules):
                model = merge(graphdef, st)
                values = critic_values(model, batch)
                if not use_ref:
                    return batch["old_logps"], values  # β = 0: KL(π_old ‖ π_ref) is not needed
                ref = adapters_off(model.policy) if c.lora.enabled else nnx.merge(frozen_graphdef, fz)
                return branch_logps(ref, batch, n, temperature=p.temperature)[0], values

        sampler = Sampler(self.model.policy, max_len=c.data.max_prompt_length + p.max_new_tokens, pad_id=tok.pad_id,
                          mesh=self.mesh, rules=self.rules, buckets=(max(len(q.ids) for q in self.prompts),))
        params = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                top_k=p.top_k, n=n, stop_ids=tok.eos_ids)
        kl = FixedKL(p.kl_coef) if p.kl_target is None else AdaptiveKL(p.kl_coef, p.kl_target, p.kl_horizon)
        rollout = PPORollout(self.prompts, tok, sampler, graphdef, batch_size=c.train.batch_size, n=n, params=params,
                             reward_funcs=self.reward_funcs, reward_weights=self.reward_weights, length=self.length,
                             seed=c.data.seed, shuffle=c.data.shuffle, reward_timeout_s=p.reward_timeout_s,
                             on_reward_error=p.on_reward_error, prepare=lambda st, b: prepare(st, b, frozen),
                             kl_controller=kl, kl_estimator=p.kl_estimator, gamma=p.gamma, lam=p.lam,
                             whiten=p.whiten_advantages, ppo_epochs=p.ppo_epochs, mini_batch_size=p.mini_batch_size,
                             missing_eos_penalty=p.missing_eos_penalty)
        return dict(graphdef=graphdef, state=state, step=step, frozen=frozen, rollout=rollout, sampler=sampler,
                    prepare=prepare)

    def train(self) -> dict:
        c, p = self.config, self.config.ppo
        n_params, n_train = count_params(self.model), count_params(nnx.state(self.model, self.trainable))
        parts = self.setup()
        summary = (f"[ppo] {len(self.prompts)} prompts ({self.data_stats}), {p.num_generations} samples x "
                   f"{p.max_new_tokens} tokens each, rows of {self.length} tokens, {p.critic} critic, "
                   f"{n_params:,} parameters, trainable {n_train / n_params:.2%}, {p.ppo_epochs} epochs x "
                   f"{parts['rollout'].per_epoch} mini-batches per rollout, kl_coef {p.kl_coef} "
                   f"({'adaptive, target ' + str(p.kl_target) if p.kl_target else 'fixed'}), rewards {dict(p.rewards)}")
        f = model_flops_per_token(self.model.policy.cfg, self.length)  # policy (+ critic) train, + prepare forwards
        flops = f * (1.0 if p.critic == "shared" else 2.0) + f / 3 * (1 + (p.kl_coef > 0)) / parts["rollout"].mu
        state, result = run_trainer(c, parts["state"], parts["step"], parts["rollout"], name="ppo", mesh=self.mesh,
                                    rules=self.rules, summary=summary, progress=self.progress,
                                    flops_per_token=flops, host_metrics=parts["rollout"].metrics)
        self.model = merge(parts["graphdef"], state)
        return result
