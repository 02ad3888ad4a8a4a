"""PPO's critic from a config: how the recipe builds it, its optimizer and the checks on its folders.

What it is: `build_critic(config, tok, policy)` (a copy of the policy's start, or `ppo.critic_path`: a
causal LM or a reward model whose score head starts the value head; LoRA when enabled),
`ppo_model(config, tok, policy) -> (PolicyCritic, trainable filter)` (the PPO recipe's model, and a
PPO run's when loaded), `ppo_optimizer(config)` (the two AdamW chains), the checks on the critic's and
the reward model's folders. The module itself is `rl/critic.py`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import optax
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.models import from_pretrained, load_config
from posttrain.models.heads import TRAINABLE_WITH_LORA, attach_score_head
from posttrain.models.hf import tensor_files
from posttrain.models.lora import apply_lora
from posttrain.recipes.build import build_model, is_classifier, numerics
from posttrain.rl.critic import PolicyCritic
from posttrain.tokenizer import Tokenizer, check_same_tokenizer
from posttrain.train.optim import Optimizer, adamw_chain, schedule


def build_critic(c, tok: Tokenizer, policy, mesh=None, rules=None):
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
        head = "score" if is_classifier(path) else None  # a reward model's head is the value head's start
        critic = from_pretrained(path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules,
                                 head=head)
        if head is None:
            attach_score_head(critic, seed=mc.seed + 1)
        elif critic.score[...].shape[-1] != 1:
            raise PosttrainError(f"ppo.critic_path: {path} has {critic.score[...].shape[-1]} labels; need 1")
        critic.cfg = critic.cfg.replace(**numerics(mc))
    if c.lora.enabled:
        apply_lora(critic, rank=c.lora.rank, alpha=c.lora.alpha, dropout=c.lora.dropout, targets=c.lora.targets,
                   seed=mc.seed + 1)
    return critic


def ppo_model(c, tok: Tokenizer, policy, mesh=None, rules=None):
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
    if path and (not is_classifier(path) or "score.weight" not in tensor_files(path)):
        raise PosttrainError(f"ppo.reward_model: {path} has no score head (not a *ForSequenceClassification "
                             "folder with score.weight); train one with `posttrain rm`, export it with "
                             "`posttrain export`, and point ppo.reward_model at the export")


def ppo_optimizer(c):
    """multi_transform of the policy's AdamW chain (config.optim) and the critic's (lr ppo.critic_lr)."""
    critic_optim = dataclasses.replace(c.optim, lr=c.ppo.critic_lr or c.optim.lr)

    def labels(params):
        def which(path, _):
            names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            return "critic" if names[0] == "critic" or "score" in names else "policy"
        return jax.tree_util.tree_map_with_path(which, params)

    def build(s):  # from the two schedules' numbers, arguments of the train step (optim.Optimizer)
        return optax.multi_transform({"policy": adamw_chain(c.optim, s["policy"]),
                                      "critic": adamw_chain(critic_optim, s["critic"])}, labels)

    return Optimizer(build, {"policy": schedule(c.optim, c.train.steps),
                             "critic": schedule(critic_optim, c.train.steps)})
