"""The training engine: learning, exact gradient accumulation, packing, loss parity, LoRA."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from posttrain.data import Example, to_arrays, tokenize_row
from posttrain.losses import sft_loss
from posttrain.models import Transformer, from_pretrained, preset, save_pretrained
from posttrain.models.lora import LoraParam, apply_lora, merge_lora, trainable_fraction
from posttrain.tokenizer import byte_tokenizer
from posttrain.train import decay_mask, init_state, make_train_step, merge, schedule, train_loop

TINY = dict(vocab_size=97, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)


def _tiny(seed=0):
    return Transformer(preset("tiny-llama", **TINY), rngs=nnx.Rngs(seed))


def _examples(seed=0, n=6, lo=3, hi=12):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(lo, hi))
        ids = rng.integers(3, 97, L).astype(np.int32)
        mask = (np.arange(L) >= L // 3).astype(np.int32)  # prompt part unmasked
        out.append(Example(ids=ids, loss_mask=mask, where=f"row {i}"))
    return out


def _jnp(batch):
    return {k: jnp.asarray(v) for k, v in batch.items()}


def test_loss_halves_on_a_fixed_batch():
    model = _tiny()
    opt = optax.adam(3e-3)
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef)
    batch = _jnp(to_arrays(_examples(1, n=8), 16, 0, packing=False))
    losses = []
    for _ in range(50):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_train_loop_feeds_a_callable_batch_source_the_current_state():
    """The RL hook: a callable batch source is called before each step with the current state."""
    seen = []

    def source(state):
        seen.append(int(state))
        return {"x": np.full((2,), float(state))}

    def step(state, batch):
        return state + 1, {"loss": jnp.mean(batch["x"])}

    state, history = train_loop(step, jnp.int32(0), source, steps=3, log_every=1, progress=False)
    assert seen == [0, 1, 2] and int(state) == 3 and [m["loss"] for m in history] == [0.0, 1.0, 2.0]


def test_gradient_accumulation_equals_full_batch():
    """4 micro-batches of 2 == one batch of 8, with unequal token counts per micro-batch."""
    batch = _jnp(to_arrays(_examples(2, n=8, lo=2, hi=16), 16, 0, packing=False))
    # SGD: the parameter change is proportional to the gradient, so any accumulation error shows
    # (Adam's first step is sign-like and would amplify float noise in near-zero gradients).
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5))
    results = []
    for micro in (1, 4):
        graphdef, state = init_state(_tiny(3), opt)
        step = make_train_step(sft_loss, opt, graphdef, micro_batches=micro)
        state, m = step(state, batch)
        results.append((jax.tree.leaves(state.params), float(m["loss"]), float(m["grad_norm"])))
    (p1, l1, g1), (p4, l4, g4) = results
    assert abs(l1 - l4) <= 1e-5 and abs(g1 - g4) <= 1e-5 * max(1.0, g1)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(p1, p4)) <= 1e-5


def test_packed_and_unpacked_batches_give_the_same_loss():
    model = _tiny(4)
    ex = _examples(5, n=7, lo=3, hi=9)
    loss = {}
    for packing in (False, True):
        arrays = to_arrays(ex, 24, 0, packing=packing)
        total, m = sft_loss(model, _jnp(arrays))
        loss[packing] = float(total / m["denom"])
    assert to_arrays(ex, 24, 0, packing=True)["tokens"].shape[0] < len(ex)  # really packed
    assert abs(loss[True] - loss[False]) <= 1e-5


@pytest.mark.parity
def test_chat_loss_matches_transformers(hf_checkpoints):
    """Assistant-only token cross-entropy equals transformers' loss with the same labels."""
    from transformers import AutoModelForCausalLM

    tok = byte_tokenizer()  # uppercase letters, digits and spaces have ids < 97 (the tiny vocab)
    row = {"messages": [{"role": "user", "content": "HOW MUCH IS 12 AND 30"},
                        {"role": "assistant", "content": "42"},
                        {"role": "user", "content": "AND 1 MORE"},
                        {"role": "assistant", "content": "43 OK"}]}
    ids, mask = tokenize_row(row, "chat:1", tok)
    assert max(ids) < 97 and 0 < sum(mask) < len(ids)
    arrays = to_arrays([Example(np.asarray(ids, np.int32), np.asarray(mask, np.int32), "chat:1")], len(ids), 0,
                       packing=False)
    total, m = nnx.jit(sft_loss)(from_pretrained(hf_checkpoints["qwen3"]), _jnp(arrays))  # one program, not op by op
    labels = torch.tensor([[i if k else -100 for i, k in zip(ids, mask)]])
    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoints["qwen3"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), labels=labels).loss.item()
    assert abs(float(total / m["denom"]) - ref) <= 1e-5


def test_lora_trains_adapters_only_and_merges_exactly(hf_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    model = from_pretrained(hf_checkpoints["llama"])
    apply_lora(model, rank=4, alpha=8.0, targets=("qkv", "o", "gate_up", "down"))
    assert 0 < trainable_fraction(model) < 0.5
    base_before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Not(LoraParam)))]
    opt = optax.adam(1e-2)
    graphdef, state = init_state(model, opt, trainable=LoraParam)
    step = make_train_step(sft_loss, opt, graphdef, trainable=LoraParam)
    batch = _jnp(to_arrays(_examples(6, n=4), 16, 0, packing=False))
    lora_before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    for _ in range(3):
        state, _ = step(state, batch)
    trained = merge(graphdef, state)
    base_after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trained, nnx.Not(LoraParam)))]
    assert all(np.array_equal(a, b) for a, b in zip(base_before, base_after))  # base frozen bitwise
    assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(lora_before, jax.tree.leaves(state.params)))
    toks = jnp.asarray(np.random.default_rng(7).integers(3, 97, (2, 10)))
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    with_adapters = np.asarray(trained(toks, pos).logits)
    merge_lora(trained)
    merged = np.asarray(trained(toks, pos).logits)
    assert np.abs(merged - with_adapters).max() <= 1e-5
    assert not jax.tree.leaves(nnx.state(trained, LoraParam))
    out = save_pretrained(trained, str(tmp_path / "lora-merged"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(np.asarray(toks))).logits.numpy()
    assert np.abs(ref - merged).max() <= 1e-4


def test_weight_decay_skips_norms_and_biases(hf_checkpoints):
    model = from_pretrained(hf_checkpoints["qwen2"])  # has qkv biases
    leaves = jax.tree_util.tree_flatten_with_path(decay_mask(nnx.state(model, nnx.Param)))[0]
    flags = {".".join(str(getattr(k, "key", "")) for k in path if hasattr(k, "key")): v for path, v in leaves}
    assert flags["layers.0.attn.qkv"] and flags["embed"] and flags["layers.1.mlp.down"]
    assert not flags["layers.0.attn.qkv_bias"] and not flags["final_norm.scale"]
    assert not flags["layers.0.attn_norm.scale"]


def test_schedule_warmup_then_cosine():
    from posttrain.config import OptimSection

    cfg = OptimSection(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    s = schedule(cfg, 110)
    assert float(s(0)) == 0.0 and abs(float(s(5)) - 0.5) < 1e-6 and abs(float(s(10)) - 1.0) < 1e-6
    # cosine from 1 to 0.1 over 100 steps: halfway is 0.1 + 0.9 * 0.5
    assert abs(float(s(60)) - 0.55) < 1e-5 and abs(float(s(110)) - 0.1) < 1e-6
