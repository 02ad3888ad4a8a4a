"""MoE routing replay (issue #37): the sampler records the experts every token was routed to, and the update's
forward can replay them. On a tiny Qwen3-MoE (top-2 of 6 experts, top-k weights renormalised as Qwen3-30B-A3B
does) one expert's router column then moves so that it wins most tokens: without replay the update's log-probs
of the sampled tokens leave the sampler's, with replay they equal them (the chosen experts and their
renormalised gate weights are unchanged)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.data.branches import group_row
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.logps import branch_logps
from posttrain.models import Transformer, moe, preset
from posttrain.rl.rollout import group_routes

N_GEN, WIDTH, OFF = 4, 6, 5  # samples per prompt, tokens per sample, the expert switched off and on


def tiny_moe(seed=0):
    """Embedding dimension 0 is a large constant, so every router input has a large positive first entry;
    expert OFF's router column reads only that entry, negatively: it is never chosen."""
    cfg = preset("demo-tiny", vocab_size=64, num_experts=6, experts_per_token=2, expert_mlp_dim=32,
                 norm_topk_prob=True, family="qwen3_moe")
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    model.embed[...] = model.embed[...].at[:, 0].set(3.0)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, moe.MoE):
            w = (m.router[...] * 40.0).at[0, :].set(0.0)  # decisive, token-dependent routing among the others
            m.router[...] = w.at[:, OFF].set(0.0).at[0, OFF].set(-200.0)
            m.expert_gate_up[...] = m.expert_gate_up[...] * 10.0  # experts that matter to the output
            m.expert_down[...] = m.expert_down[...] * 10.0
    return model


def move_router(model):
    """Expert OFF's router column flips sign: it now wins every token."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, moe.MoE):
            m.router[...] = m.router[...].at[0, OFF].set(200.0)


def sample(model, prompts):
    params = SamplingParams(max_new_tokens=WIDTH, temperature=1.0, n=N_GEN, record_routes=True)
    return Sampler(model, max_len=16).generate(prompts, params, key=jax.random.key(3))


def rows(prompts, out):
    group = [type("P", (), {"ids": np.asarray(p)})() for p in prompts]
    built = [group_row(p, [out.tokens[r, :out.lengths[r]] for r in range(i * N_GEN, (i + 1) * N_GEN)], WIDTH)
             for i, p in enumerate(prompts)]
    length = max(len(b["tokens"]) for b in built)
    batch = {f: np.stack([np.pad(b[f], (0, (length if f in ("tokens", "positions", "segment_ids", "branch_ids")
                                            else N_GEN * WIDTH) - len(b[f]))) for b in built]) for f in built[0]}
    return batch, group_routes(group, out, N_GEN, length)


def logps(model, batch, routes=None):
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    if routes is not None:
        b["routes"] = jnp.asarray(routes)
    tok = branch_logps(model, b, N_GEN)[0]
    return np.asarray(tok).reshape(-1, N_GEN, WIDTH)


def test_routing_replay_keeps_the_samplers_log_probs_after_the_router_moved(tmp_path):
    model = tiny_moe()
    prompts = [[1, 5, 9, 12], [2, 7, 30], [3, 3, 40, 41, 42]]
    out = sample(model, prompts)
    batch, routes = rows(prompts, out)
    mask = batch["score_w"].reshape(-1, N_GEN, WIDTH) > 0
    sampler = out.logprobs.reshape(-1, N_GEN, WIDTH)
    recorded = routes[routes[..., 0] >= 0]
    assert len(recorded) > 0 and not (recorded == OFF).any()  # the switched-off expert was never chosen

    # The recorded experts are the ones a full forward of the same weights picks (the decode path's routing).
    full = model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                 segment_ids=jnp.asarray(batch["segment_ids"]), branch_ids=jnp.asarray(batch["branch_ids"]),
                 return_router_logits=True)
    own = np.asarray(moe.chosen_experts(full.router_logits, 2))
    seen = routes[..., 0] >= 0
    assert np.mean(np.sort(own, -1)[seen] == np.sort(routes, -1)[seen]) >= 0.99
    same = np.abs(logps(model, batch) - sampler)[mask].max()
    assert same <= 1e-5  # on-policy, same router: equal with or without replay

    move_router(model)
    moved = np.asarray(moe.chosen_experts(model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                                                segment_ids=jnp.asarray(batch["segment_ids"]),
                                                branch_ids=jnp.asarray(batch["branch_ids"]),
                                                return_router_logits=True).router_logits, 2))
    flipped = float(np.mean((moved == OFF).any(-1)[batch["segment_ids"] > 0]))
    assert flipped > 0.5  # the moved expert now wins most (token, layer) choices
    without = np.abs(logps(model, batch) - sampler)[mask]
    replayed = np.abs(logps(model, batch, routes) - sampler)[mask]
    print(json.dumps({"flipped_choices": flipped, "without_replay_mean": float(without.mean()),
                      "without_replay_max": float(without.max()), "with_replay_max": float(replayed.max())}))
    assert replayed.max() <= 1e-5
    assert without.mean() > 1e-2


def parity_reward(prompts, completions, **_):
    return [float(len(c) % 2 == 0) for c in completions]


def test_grpo_with_routing_replay_trains_on_the_recorded_experts(tmp_path):
    """moe.routing_replay: the rollout rows carry the sampler's experts, the first update is on-policy to
    1e-5 through them, and two steps train; the setting is refused for a dense model."""
    import pytest

    from posttrain import config as C
    from posttrain.errors import PosttrainError
    from posttrain.models import save_pretrained
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.train.step import merge
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    tok = byte_tokenizer()
    cfg = preset("demo-tiny", vocab_size=tok.vocab_size, num_experts=4, experts_per_token=2, expert_mlp_dim=32,
                 norm_topk_prob=True, family="qwen3_moe", qk_norm=True)
    hf = save_pretrained(Transformer(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "moe"), tokenizer=tok)
    d = {"model": {"path": hf}, "data": {"train": "tests/data/grpo_addition.jsonl", "max_prompt_length": 8},
         "grpo": {"num_generations": 4, "max_new_tokens": 4, "rewards": {"test_routing_replay:parity_reward": 1.0}},
         "lora": {"enabled": True, "rank": 4}, "train": {"steps": 2, "batch_size": 4, "log_every": 1},
         "moe": {"routing_replay": True}, "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "run")}
    trainer = GRPOTrainer(C.from_dict(GRPOConfig, d), progress=False)
    parts = trainer.setup()
    batch = parts.batches(parts.state)
    routes = batch["routes"]
    assert routes.shape[:2] == batch["tokens"].shape and routes.shape[2:] == (3, 2)  # 3 MoE layers, top-2
    assert (routes[batch["segment_ids"] > 0][..., 0] >= 0).mean() > 0.8  # every fed token has its experts
    loss, metrics = trainer.loss_fn(merge(parts.graphdef, parts.state), {k: jnp.asarray(v) for k, v in batch.items()})
    assert float(metrics["logp_mismatch_max"]) <= 1e-5
    trainer.train()
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(logged) == 2 and all(np.isfinite(m["loss"]) for m in logged)
    dense = {**d, "model": {"preset": "demo-tiny"}, "run_dir": str(tmp_path / "dense")}
    with pytest.raises(PosttrainError, match="moe.routing_replay needs a mixture-of-experts model"):
        GRPOTrainer(C.from_dict(GRPOConfig, dense), progress=False)
