"""Sharding on 8 CPU devices: every preset computes what one device computes.

Shared helper for later tests (`from test_sharding import assert_sharded_like_single_device`):
it runs a train step built by the caller once unsharded and once per preset on the 8-device
mesh, and checks the losses and parameters agree and stay placed by the preset's rules.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain import sharding as sh
from posttrain.data import Example, to_arrays
from posttrain.errors import PosttrainError
from posttrain.generate.sampler import Sampler
from posttrain.generate.sampling import SamplingParams
from posttrain.losses import sft_loss
from posttrain.models import Transformer, preset
from posttrain.plan import format_plan, plan
from posttrain.train import init_state, make_train_step

ALL_PRESETS = ("dp", "fsdp", "tp", "fsdp_tp")
# Every sharded dimension divisible by 8 (tp puts all 8 devices on `tensor`); GQA with 2 groups.
TINY = dict(vocab_size=128, embed_dim=64, num_layers=2, num_heads=16, num_kv_heads=8, head_dim=8, mlp_dim=128)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    return Transformer(preset("tiny-llama", **{**TINY, **overrides}), rngs=nnx.Rngs(seed))


def sft_batch(n: int = 8, seq: int = 16, seed: int = 0, vocab: int = 128) -> dict:
    rng = np.random.default_rng(seed)
    ex = []
    for i in range(n):
        L = int(rng.integers(4, seq + 1))
        ids = rng.integers(3, vocab, L).astype(np.int32)
        ex.append(Example(ids=ids, loss_mask=(np.arange(L) >= L // 3).astype(np.int32), where=f"row {i}"))
    return to_arrays(ex, seq, 0, packing=False)


def _norm(spec) -> tuple:
    """A spec as a tuple without trailing Nones (P('a', None) == P('a'))."""
    t = list(tuple(spec))
    while t and t[-1] is None:
        t.pop()
    return tuple(t)


def param_specs(state) -> dict:
    """dotted path -> normalised spec of every parameter array in an NNX state."""
    return {".".join(map(str, p)): _norm(v[...].sharding.spec) for p, v in nnx.to_flat_state(state)}


def expected_specs(state, preset_name: str, mesh) -> dict:
    """dotted path -> the spec the preset's rules give each parameter (from its logical names)."""
    rules = sh.preset_rules(preset_name)
    return {".".join(map(str, p)): _norm(sh.param_spec(v.get_metadata()["out_sharding"], v.shape, rules, mesh.shape))
            for p, v in nnx.to_flat_state(state)}


def _host(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float64)


def _max_diff(a, b) -> float:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(float(np.max(np.abs(_host(x) - _host(y)), initial=0.0))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run_steps(build, batch, steps: int, mesh=None, rules=None):
    """(losses, final state) of `steps` steps; sharded by the preset when a mesh is given."""
    state, step = build()
    if mesh is None:
        batch = jax.tree.map(jnp.asarray, batch)
        losses = []
        for _ in range(steps):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return losses, state
    with sh.use_mesh(mesh, rules):
        state = sh.shard_state(state, mesh, rules)
        batch = sh.shard_batch(batch, mesh, rules)
        losses = []
        for _ in range(steps):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    return losses, state


def assert_sharded_like_single_device(step_builder, batch, presets=ALL_PRESETS, *, steps: int = 2,
                                      atol: float = 1e-5, check_specs: bool = True) -> dict:
    """`step_builder() -> (TrainState, step)` (fresh, unsharded); `batch` a dict of [B, ...] arrays.

    Runs `steps` steps on one device, then for each preset on all devices (state placed with
    `shard_state`, batch with `shard_batch`, step traced under `use_mesh`), and asserts equal
    losses and parameters (<= atol) and, with check_specs, that every parameter is still placed
    by the preset's rules. Returns {preset: (losses, state)} with "single" the reference.
    """
    ref_losses, ref_state = run_steps(step_builder, batch, steps)
    out = {"single": (ref_losses, ref_state)}
    for name in presets:
        mesh, rules = sh.make_mesh(name), sh.preset_rules(name)
        losses, state = run_steps(step_builder, batch, steps, mesh, rules)
        assert np.allclose(losses, ref_losses, rtol=0, atol=atol), (name, losses, ref_losses)
        diff = _max_diff(state.params, ref_state.params)
        assert diff <= atol, (name, diff)
        if check_specs:
            assert param_specs(state.params) == expected_specs(state.params, name, mesh), name
        out[name] = (losses, state)
    return out


def _sft_builder(seed: int = 0, lr: float = 1e-3):
    # AdamW's first update is lr * g / (|g| + eps): for the few gradients of ~1e-8 in the tiny model
    # it amplifies float32 reduction-order noise (sharded sums add in another order) by lr / eps.
    # Measured max parameter difference after 2 steps: 1e-5 with eps 1e-8, 3e-6 with 1e-6 and
    # 6e-7 with 1e-5, so eps 1e-5 keeps this comparison about sharding, not about Adam.
    def build():
        opt = optax.adamw(lr, eps=1e-5)
        graphdef, state = init_state(tiny_model(seed), opt)
        return state, make_train_step(sft_loss, opt, graphdef)

    return build


# ---------------------------------------------------------------------------------------- mesh & rules


def test_make_mesh_presets_and_explicit_shapes():
    assert jax.device_count() == 8
    shapes = {p: dict(sh.make_mesh(p).shape) for p in ALL_PRESETS}
    assert shapes == {"dp": {"data": 8, "fsdp": 1, "tensor": 1}, "fsdp": {"data": 1, "fsdp": 8, "tensor": 1},
                      "tp": {"data": 1, "fsdp": 1, "tensor": 8}, "fsdp_tp": {"data": 1, "fsdp": 4, "tensor": 2}}
    assert dict(sh.make_mesh("fsdp_tp", shape={"data": 2, "fsdp": 2, "tensor": 2}).shape) == {
        "data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sh.make_mesh("tp", shape={"tensor": 4, "data": -1}).shape)["data"] == 2
    assert dict(sh.make_mesh("dp", devices=jax.devices()[:2]).shape)["data"] == 2
    with pytest.raises(PosttrainError, match="needs 6 devices"):
        sh.make_mesh("tp", shape=(1, 3, 2))
    with pytest.raises(PosttrainError, match="unknown sharding preset"):
        sh.make_mesh("zero3")


def test_rules_use_each_mesh_axis_once_and_skip_indivisible_dims():
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    rules = sh.preset_rules("fsdp_tp")
    # activations [B, T, D]: batch takes data and fsdp, so embed may not reuse fsdp
    assert _norm(sh.logical_to_spec(("batch", "seq", "embed"), rules)) == (("data", "fsdp"),)
    # 3 rows cannot be split over data x fsdp = 4: replicated instead of padded
    assert _norm(sh.logical_to_spec(("batch", "seq"), rules, shape=(3, 5), axis_sizes=sizes)) == ()
    assert _norm(sh.logical_to_spec(("batch", "seq"), rules, shape=(6, 5), axis_sizes=sizes)) == ("data",)
    # fallback: a large parameter with no embed axis goes to fsdp on its largest divisible dim
    big = (2, sh.FALLBACK_MIN_ELEMENTS // 2)
    assert _norm(sh.param_spec(None, big, rules, sizes)) == (None, "fsdp")
    assert _norm(sh.param_spec(None, (4, 4), rules, sizes)) == ()
    assert _norm(sh.param_spec(None, big, sh.preset_rules("tp"), sizes)) == ()


def test_constrain_is_identity_without_mesh_and_places_with_one():
    x = jnp.ones((8, 4, 64))
    assert sh.constrain(x, ("batch", "seq", "embed")) is x
    mesh = sh.make_mesh("fsdp_tp")
    with sh.use_mesh(mesh, sh.preset_rules("fsdp_tp")):
        y = jax.jit(lambda a: sh.constrain(a * 2, ("batch", "seq", "embed")))(x)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))), 3)
    assert _norm(y.sharding.spec) == ("fsdp",)  # (jit reports the size-1 data axis dropped)


# ---------------------------------------------------------------------------------------- placement


def sharded_model(name: str, seed: int = 0):
    """(tiny model placed by preset `name` on all 8 devices, mesh, rules)."""
    mesh, rules = sh.make_mesh(name), sh.preset_rules(name)
    model = tiny_model(seed)
    nnx.update(model, sh.shard_state(nnx.state(model), mesh, rules))
    return model, mesh, rules


# the rules spelled out for the tiny model (D=64, K=8, G+2=4, H=8, F=128, V=128): normalised specs
WANT = {
    "dp": dict(qkv=(), o=(), gate_up=(), down=(), embed=(), lm_head=(), norm=()),
    "fsdp": dict(qkv=("fsdp",), o=(None, None, None, "fsdp"), gate_up=("fsdp",), down=(None, "fsdp"),
                 embed=(None, "fsdp"), lm_head=("fsdp",), norm=("fsdp",)),
    "tp": dict(qkv=(None, "tensor"), o=("tensor",), gate_up=(None, None, "tensor"), down=("tensor",),
               embed=("tensor",), lm_head=(None, "tensor"), norm=()),
    "fsdp_tp": dict(qkv=("fsdp", "tensor"), o=("tensor", None, None, "fsdp"), gate_up=("fsdp", None, "tensor"),
                    down=("tensor", "fsdp"), embed=("tensor", "fsdp"), lm_head=("fsdp", "tensor"), norm=("fsdp",)),
}


def _check_rules(specs: dict, name: str):
    want = WANT[name]
    layers = {int(k.split(".")[1]) for k in specs if k.startswith("layers.")}
    assert layers
    for layer in layers:
        assert specs[f"layers.{layer}.attn.qkv"] == want["qkv"]
        assert specs[f"layers.{layer}.attn.o"] == want["o"]
        assert specs[f"layers.{layer}.mlp.gate_up"] == want["gate_up"]
        assert specs[f"layers.{layer}.mlp.down"] == want["down"]
        assert specs[f"layers.{layer}.attn_norm.scale"] == want["norm"]
    assert specs["embed"] == want["embed"]
    assert specs["lm_head"] == want["lm_head"]
    assert specs["final_norm.scale"] == want["norm"]


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_every_parameter_is_placed_by_its_preset_rule(name):
    model, mesh, _ = sharded_model(name)
    state = nnx.state(model, nnx.Param)
    specs = param_specs(state)
    assert specs == expected_specs(state, name, mesh)
    _check_rules(specs, name)
    # each device holds only its shard
    qkv = model.layers[0].attn.qkv[...]
    split = math.prod(mesh.shape[a] for a in WANT[name]["qkv"] if a)
    assert {s.data.size for s in qkv.addressable_shards} == {qkv.size // split}
    assert _max_diff(state, nnx.state(tiny_model(0), nnx.Param)) == 0.0


def test_create_sharded_builds_each_shard_on_its_device():
    mesh, rules = sh.make_mesh("fsdp_tp"), sh.preset_rules("fsdp_tp")
    # one layer: compiling the initialiser takes ~0.3 s per parameter on the 2-core CPU
    model = sh.create_sharded(lambda: tiny_model(0, num_layers=1), mesh, rules)
    state = nnx.state(model, nnx.Param)
    specs = param_specs(state)
    assert specs == expected_specs(state, "fsdp_tp", mesh)
    _check_rules(specs, "fsdp_tp")
    emb = model.embed[...]
    assert {s.data.shape for s in emb.addressable_shards} == {(128 // 2, 64 // 4)}
    # the eager constructor's values, up to XLA fusing the initialiser's scaling differently
    assert _max_diff(state, nnx.state(tiny_model(0, num_layers=1), nnx.Param)) <= 1e-7


def test_shard_state_optimizer_moments_follow_their_parameters():
    mesh, rules = sh.make_mesh("fsdp_tp"), sh.preset_rules("fsdp_tp")
    _, state = init_state(tiny_model(0), optax.adamw(1e-3))
    placed = sh.shard_state(state, mesh, rules)
    mu = placed.opt_state[0].mu
    assert param_specs(mu) == param_specs(placed.params) == expected_specs(state.params, "fsdp_tp", mesh)
    _check_rules(param_specs(mu), "fsdp_tp")  # the preset's rules, written out independently
    assert _norm(placed.opt_state[0].count.sharding.spec) == ()
    assert _norm(placed.step.sharding.spec) == ()
    # plain arrays (no NNX metadata) are matched to the parameter by tree path and shape
    plain = {"params": state.params, "moments": {"mu": jax.tree.map(lambda v: v[...], state.params,
                                                                     is_leaf=lambda v: isinstance(v, nnx.Variable))}}
    shardings = sh.tree_shardings(plain, mesh, rules)
    assert _norm(shardings["moments"]["mu"]["layers"][0]["attn"]["qkv"].spec) == ("fsdp", "tensor")
    assert _max_diff(placed, state) == 0.0


# ---------------------------------------------------------------------------------------- equivalence


def test_sft_steps_match_single_device_for_every_preset():
    batch = sft_batch()
    out = assert_sharded_like_single_device(_sft_builder(), batch, ALL_PRESETS, steps=2)
    ref = out["single"][0]
    assert ref[1] < ref[0]  # it trains
    # optimizer state stays with its parameters after the steps
    for name in ALL_PRESETS:
        state = out[name][1]
        assert param_specs(state.opt_state[0].mu) == param_specs(state.params), name


def test_greedy_generation_matches_unsharded():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 128, int(rng.integers(2, 9))).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    ref = Sampler(tiny_model(0), max_len=32).generate(prompts, params)
    for name in ALL_PRESETS:
        model, mesh, rules = sharded_model(name)
        with sh.use_mesh(mesh, rules):
            out = Sampler(model, max_len=32).generate(prompts, params)
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=name)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, err_msg=name)


def test_checkpoint_saved_under_fsdp_restores_under_tp(tmp_path):
    import orbax.checkpoint as ocp

    fsdp, tp = sh.make_mesh("fsdp"), sh.make_mesh("tp")
    _, state = init_state(tiny_model(1), optax.adamw(1e-3))
    saved = sh.shard_state(state, fsdp, sh.preset_rules("fsdp"))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", saved)
    ckpt.wait_until_finished()
    target = sh.sharded_shapes(state, tp, sh.preset_rules("tp"))
    restored = ckpt.restore(tmp_path / "ckpt", target)
    assert _max_diff(restored, state) == 0.0
    assert int(restored.step) == 0 and jax.tree.structure(restored) == jax.tree.structure(state)
    assert param_specs(restored.params) == expected_specs(state.params, "tp", tp)
    _check_rules(param_specs(restored.params), "tp")
    assert param_specs(restored.opt_state[0].nu) == param_specs(restored.params)
    assert param_specs(restored.params)["layers.0.attn.qkv"] == (None, "tensor")


# ---------------------------------------------------------------------------------------- memory plan


def test_plan_parameter_bytes_per_device_tp_vs_dp():
    cfg = preset("tiny-llama", **TINY)
    D, V, F, K, G, H, L = 64, 128, 128, 8, 2, 8, 2
    norms = D + L * 2 * D  # final norm + two per layer: never split (no kv/mlp/vocab axis)
    per_layer = D * K * (G + 2) * H + K * G * H * D + D * 2 * F + F * D  # qkv, o, gate_up, down
    total = 4 * (V * D + D * V + norms + L * per_layer)  # float32, untied lm_head
    dp = plan(cfg, batch=8, seq_len=16, mesh_shape={"data": 8}, preset="dp")
    tp = plan(cfg, batch=8, seq_len=16, mesh_shape={"tensor": 8}, preset="tp")
    assert dp["parameters"] == total == 4 * 115_008
    assert tp["parameters"] == 4 * ((V * D + D * V + L * per_layer) // 8 + norms)
    assert dp["gradients"] == dp["parameters"] and dp["optimizer"] == 2 * dp["parameters"]
    assert tp["optimizer"] == 2 * tp["parameters"]
    # the plan is what the devices really hold
    for name, shape in (("tp", {"tensor": 8}), ("fsdp_tp", {"fsdp": 4, "tensor": 2}), ("fsdp", {"fsdp": 8})):
        model, _, _ = sharded_model(name)
        held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert plan(cfg, batch=8, seq_len=16, mesh_shape=shape, preset=name)["parameters"] == held, name
    # activations: dp splits the rows 8 ways, tp splits heads / mlp / vocab; remat keeps less
    assert dp["rows_per_device"] == 1 and tp["rows_per_device"] == 8
    one = plan(cfg, batch=8, seq_len=16, mesh_shape={}, preset="dp")
    assert one["activations"] == 8 * dp["activations"]
    assert plan(cfg, batch=8, seq_len=16, mesh_shape={}, preset="dp", remat=True)["activations"] < one["activations"]


def test_plan_lora_kv_cache_and_warning():
    cfg = preset("tiny-llama", **TINY)
    full = plan(cfg, batch=8, seq_len=16, mesh_shape={"fsdp": 8}, preset="fsdp")
    lora = plan(cfg, batch=8, seq_len=16, mesh_shape={"fsdp": 8}, preset="fsdp", trainable="lora", lora_rank=4)
    # adapters (replicated, float32): per layer qkv (64 + 4*8*8... ) = rank * (d_in + d_out) each
    adapters = 2 * 4 * ((64 + 8 * 4 * 8) + (8 * 2 * 8 + 64) + (64 + 2 * 128) + (128 + 64))
    assert lora["gradients"] == 4 * adapters and lora["optimizer"] == 2 * 4 * adapters
    assert lora["parameters"] == full["parameters"] + 4 * adapters
    kv = plan(cfg, batch=8, seq_len=16, mesh_shape={"tensor": 8}, preset="tp", kv_cache_tokens=8 * 32)
    assert kv["kv_cache"] == 2 * 2 * 8 * 8 * 4 * (8 * 32) // 8  # k and v, L, K, H, float32; K over 8
    text = format_plan(full, device_bytes=1 << 30)
    assert "WARNING" not in text and "parameters" in text and "fsdp 8" in text
    warn = format_plan(full, device_bytes=1000)
    assert warn.splitlines()[-1].startswith("WARNING: the plan needs")
    with pytest.raises(PosttrainError, match="unknown axes"):
        plan(cfg, batch=8, seq_len=16, mesh_shape={"model": 8}, preset="tp")


def test_from_pretrained_places_indivisible_checkpoints(hf_checkpoints):
    """HF tiny llama (vocab 97, 2 kv heads) on fsdp 4 x tensor 2: indivisible dims stay whole."""
    from posttrain.models import from_pretrained

    mesh = sh.make_mesh("fsdp_tp")
    model = from_pretrained(hf_checkpoints["llama"], mesh=mesh)
    specs = param_specs(nnx.state(model, nnx.Param))
    assert specs["embed"] == (None, "fsdp")  # 97 rows cannot split over tensor=2
    assert specs["layers.0.attn.qkv"] == ("fsdp", "tensor")  # 2 kv heads over tensor=2
    ref = from_pretrained(hf_checkpoints["llama"])
    assert _max_diff(nnx.state(model), nnx.state(ref)) == 0.0
    tokens = jnp.asarray(np.arange(32, dtype=np.int32).reshape(4, 8) % 97)
    pos = jnp.broadcast_to(jnp.arange(8), (4, 8))
    with sh.use_mesh(mesh, sh.DEFAULT_RULES):
        out = nnx.jit(lambda m, t, p: m(t, p).logits)(model, tokens, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(tokens, pos).logits), atol=1e-5)


def test_untagged_lora_adapters_get_the_same_sharding_from_every_path():
    """shard_state (trainer), state_shardings (loading) and the plan agree on LoRA adapters, which
    carry no logical names: a large one takes the FALLBACK fsdp split everywhere."""
    from posttrain.models.lora import LoraParam, apply_lora

    mesh, rules = sh.make_mesh("fsdp"), sh.preset_rules("fsdp")
    model = apply_lora(tiny_model(0, mlp_dim=4096), rank=32, targets=("gate_up",))
    state = nnx.state(model, LoraParam)
    b = state["layers"][0]["mlp"]["gate_up_lora"]["b"]
    assert b.size >= sh.FALLBACK_MIN_ELEMENTS  # large enough for the fallback rule
    via_trainer = param_specs(sh.shard_state(state, mesh, rules))
    via_loader = {".".join(map(str, p)): _norm(v.spec)
                  for p, v in nnx.to_flat_state(sh.state_shardings(state, mesh, rules))}
    assert via_trainer == via_loader
    assert via_trainer["layers.0.mlp.gate_up_lora.b"] == (None, "fsdp")


def test_a_hybrid_model_trains_and_samples_like_one_device():
    """Qwen3.5-shaped (a Gated DeltaNet layer, then gated full attention): SFT steps under every preset equal one
    device's, and greedy decoding (the linear layers' states in the cache) under tp and fsdp_tp equals it."""
    hybrid = dict(TINY, embed_dim=64, layer_types=("linear", "full"), linear_key_heads=8, linear_value_heads=16,
                  linear_key_dim=8, linear_value_dim=8)

    def model(seed=0):
        return Transformer(preset("demo-tiny-hybrid", **hybrid), rngs=nnx.Rngs(seed))

    def build():
        opt = optax.adamw(1e-3, eps=1e-5)
        graphdef, state = init_state(model(), opt)
        return state, make_train_step(sft_loss, opt, graphdef)

    out = assert_sharded_like_single_device(build, sft_batch(), ALL_PRESETS, steps=2)
    assert out["single"][0][1] < out["single"][0][0]
    lin = out["tp"][1].params["layers"][0]["linear"]
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b"):  # key-head groups and value heads over the model axis
        assert _norm(lin[name].sharding.spec) == (None, "tensor"), name
    assert _norm(lin["conv"].sharding.spec) == ("tensor",)
    # so a linear layer's forward under tp is local to each device's heads but for the output projection's sum
    # (before, with HF's [all q | all k | all v] channel order and in_proj_qkv replicated: 8 collective-permutes)
    m = model()
    mesh, rules = sh.make_mesh("tp"), sh.preset_rules("tp")
    nnx.update(m, sh.shard_state(nnx.state(m), mesh, rules))
    graphdef, state = nnx.split(m.layers[0].linear)
    with sh.use_mesh(mesh, rules):
        hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0]).lower(state, jnp.ones((2, 32, 64))).compile()
    collectives = re.findall(r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)[-a-z]*\(",
                             hlo.as_text())
    assert collectives == ["all-reduce"], collectives
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 128, int(rng.integers(2, 9))).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    ref = Sampler(model(), max_len=32).generate(prompts, params)
    for name in ("tp", "fsdp_tp"):
        mesh, rules = sh.make_mesh(name), sh.preset_rules(name)
        m = model()
        nnx.update(m, sh.shard_state(nnx.state(m), mesh, rules))
        with sh.use_mesh(mesh, rules):
            got = Sampler(m, max_len=32).generate(prompts, params)
        np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=name)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5, err_msg=name)


def test_plan_total_shares_gradients_with_activations_in_one_micro_batch():
    """One micro-batch: the backward pass frees each layer's activations as it writes that layer's gradients,
    so the larger of the two counts; micro-batches carry an accumulator beside the micro-batch's own gradients
    (XLA's memory_analysis on a TPU v5e, llama3-1b: docs/benchmarks.md)."""
    cfg = preset("tiny-llama", **TINY)
    one = plan(cfg, batch=2, seq_len=16, mesh_shape={}, preset="dp")
    four = plan(cfg, batch=2, seq_len=16, mesh_shape={}, preset="dp", micro_batches=4)
    fixed = one["parameters"] + one["optimizer"] + one["kv_cache"]
    assert one["total"] == fixed + max(one["gradients"], one["activations"])
    assert four["gradients"] == 2 * one["gradients"] and four["activations"] == one["activations"]
    assert four["total"] == fixed + four["gradients"] + four["activations"] > one["total"]
