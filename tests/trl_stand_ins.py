"""Stand-ins around TRL 1.16's trainer code for the float64 parity tests (tests/test_policy_losses.py,
tests/test_advantages_trl.py, tests/test_advantages.py; the `trl` fixture, TRL's trainer classes and torch, is
conftest's): an accelerator that is one CPU process, the metrics store TRL's methods write to, and the comparison
at TOL."""

from __future__ import annotations

import types
from collections import defaultdict

import numpy as np

TOL = 1e-6


def _metrics():
    return defaultdict(lambda: defaultdict(list))


def _accelerator(torch):
    return types.SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                 gather=lambda x: x, gather_for_metrics=lambda x: x,
                                 reduce=lambda x, reduction="sum": x)


def _close(ours, ref, what):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
    assert err <= TOL, f"{what}: max |Δ| = {err:.3g}\nours {ours}\nTRL  {ref}"
    return err


# the generation side (`_generate_and_score_completions`), shared by the advantage and sampler-correction tests

G, NG = 4, 4  # groups x samples per group for the reward tables (N = 16)


def _reward_table(with_nans, seed=0):
    """[16, 2] rewards: a random group, a tied group (std 0), and, with NaNs, a group with an unscorable
    row and a half-scored row, and a group with a single scorable row."""
    rng = np.random.default_rng(seed)
    r = np.round(rng.normal(0.0, 1.0, size=(G * NG, 2)), 3)
    r[NG:2 * NG] = [0.5, -1.0]  # every sample of group 1 scores the same
    if with_nans:
        r[2 * NG + 1] = np.nan  # unscorable: every function returned None
        r[2 * NG + 2, 1] = np.nan  # one function failed
        r[3 * NG + 1:] = np.nan  # group 3: a single scorable row
    return r


WEIGHTS = np.array([1.0, 0.5])


def _completion_lists(n_rows, seed=1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, size=n_rows)
    return [[7, 8]] * n_rows, [list(range(2, 2 + int(k))) for k in lengths], lengths


def _generation_self(trl, rewards, group_size, **attrs):
    """What `_generate_and_score_completions` of GRPOTrainer / RLOOTrainer reads, and nothing more."""
    torch = trl.torch
    n_rows = rewards.shape[0]
    return types.SimpleNamespace(
        accelerator=_accelerator(torch), model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        eos_token_ids=[1], processing_class=None, chat_template_kwargs={},
        args=types.SimpleNamespace(per_device_train_batch_size=n_rows, per_device_eval_batch_size=n_rows,
                                   gradient_checkpointing_kwargs=None, steps_per_generation=1,
                                   gradient_accumulation_steps=1),
        _calculate_rewards=lambda inputs, prompts, completions, ids: torch.from_numpy(rewards.copy()),
        num_generations=group_size, num_generations_eval=group_size,
        reward_weights=torch.from_numpy(WEIGHTS.copy()), reward_func_names=["f0", "f1"], reward_funcs=[None, None],
        _metrics=_metrics(), _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
                                    "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False, **attrs)
