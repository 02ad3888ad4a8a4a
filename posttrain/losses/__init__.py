"""Losses: pure functions (model and arrays in, (total, metrics) out).

Convention shared by every loss: `loss_fn(policy, batch, *, frozen, rng) -> (total, metrics)`
where `total` is a SUM over the loss's units (tokens for SFT, pairs for DPO) and
`metrics["denom"]` counts those units. The train step divides by the summed denominator over
all micro-batches, so gradient accumulation is exactly the full-batch gradient. Every other
metric is a sum too and is divided by `denom` in the step.
"""

from posttrain.losses.sft import sft_loss, token_nll

__all__ = ["sft_loss", "token_nll"]
