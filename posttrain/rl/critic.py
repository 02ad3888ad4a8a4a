"""PPO's critic at the model level: the policy and its critic as one module, and the critic's values.

What it is: `PolicyCritic(policy, critic)` (one train state; critic None = a value head on the
policy, `ppo.critic: shared`) and `critic_values(model, batch)`: V(s_t) of every scored token of a
prefix-shared row batch.

What it is not: how the critic is built from a config (`recipes/critic.py`), the loss
(`rl/ppo.make_ppo_loss`) or the recipe (`trainers/ppo.py`).
"""

from __future__ import annotations

from flax import nnx

from posttrain.models.heads import last_token_scores


class PolicyCritic(nnx.Module):
    """The policy and its critic as one module (one train state); critic None = value head on the policy."""

    def __init__(self, policy, critic=None):
        self.policy, self.critic = policy, critic

    @property
    def cfg(self):
        """The policy's ModelConfig (what the memory plan and MFU count)."""
        return self.policy.cfg


def critic_values(model, batch, hidden=None):
    """V(s_t) [B, M] for every scored token: the value head on the state that predicts the token
    (verl / TRL: values[:, t] read at the slot before completion token t)."""
    critic = model.policy if model.critic is None else model.critic
    if hidden is None or model.critic is not None:
        out = critic(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                     branch_ids=batch["branch_ids"], return_hidden=True, return_logits=False)
        hidden = out.hidden[-1]
    return last_token_scores(critic, hidden, batch["score_src"])[..., 0]
