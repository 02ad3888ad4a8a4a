"""Losses: pure functions (model and arrays in, (loss, metrics) out).

Convention shared by every loss: `loss_fn(policy, batch, *, frozen, rng) -> (total, metrics)`
where `total` is a SUM over the loss's units (tokens for SFT, pairs for DPO) and
`metrics["denom"]` counts those units. The train step divides by the summed denominator over
all micro-batches, so gradient accumulation is exactly the full-batch gradient. Every other
metric is a sum too and is divided by `denom` in the step.

`preference` holds the per-pair building blocks of the preference trainers (sequence
log-probabilities or scalar rewards in, per-pair losses and rewards out).
"""

from posttrain.losses.advantages import (
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    weighted_rewards,
)
from posttrain.losses.distill import (
    attention_transfer_loss,
    check_layer_map,
    check_pool_size,
    feature_pool_loss,
    generalized_jsd,
    logit_distill_loss,
    pool_features,
)
from posttrain.losses.policy import (
    IS_MODES,
    POLICY_LOSS_TYPES,
    POLICY_LOSSES,
    policy_loss,
    register_policy_loss,
    sampler_correction,
    token_kl,
)
from posttrain.losses.ppo import gae, masked_whiten, token_rewards, value_loss
from posttrain.losses.preference import (
    DPO_LOSS_TYPES,
    bco_update_running_mean,
    dpo_loss,
    orpo_loss,
    reward_loss,
    simpo_loss,
)
from posttrain.losses.sft import sft_loss, token_nll

__all__ = [
    "sft_loss",
    "token_nll",
    # preference
    "DPO_LOSS_TYPES",
    "bco_update_running_mean",
    "dpo_loss",
    "orpo_loss",
    "reward_loss",
    "simpo_loss",
    # RL: advantages and the GRPO-family policy loss
    "group_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "weighted_rewards",
    "POLICY_LOSS_TYPES",
    "POLICY_LOSSES",
    "policy_loss",
    "register_policy_loss",
    "IS_MODES",
    "sampler_correction",
    "token_kl",
    # RL: PPO with a critic
    "gae",
    "masked_whiten",
    "value_loss",
    "token_rewards",
    # distillation
    "attention_transfer_loss",
    "check_layer_map",
    "check_pool_size",
    "feature_pool_loss",
    "generalized_jsd",
    "logit_distill_loss",
    "pool_features",
]
