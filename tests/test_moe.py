"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against Hugging Face transformers; the router losses.

Tiny random checkpoints are built locally with transformers' `save_pretrained` (what it writes on
disk: one Linear per expert), with routers scaled up so routing is decisive and differs per token.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from hf_models import COMMON

from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.models import Transformer, count_params, from_pretrained, moe, preset, save_pretrained
from posttrain.models.config import ModelConfig

MOE = {
    # one dense layer (mlp_only_layers), un-normalised top-k weights (transformers' Qwen3-MoE default)
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False, rms_norm_eps=1e-6,
                      rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    # every layer slides over 5 tokens, shorter than the 11-token rows
    "mixtral": dict(model_type="mixtral", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=48, sliding_window=5,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6)),
}
B, T = 3, 11
LENS = np.array([11, 7, 4])


def _make(family: str, path: str, seed: int = 0) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**COMMON, **MOE[family]}
    mt = kw.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **kw), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # the router: decisive, token-dependent routing
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.mul_(5.0)
    model.save_pretrained(path)
    return os.fspath(path)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {fam: _make(fam, root / fam) for fam in MOE}


def _batch(seed=0):
    toks = np.random.default_rng(seed).integers(3, 97, (B, T))
    mask = (np.arange(T)[None] < LENS[:, None]).astype(np.int64)
    return toks, mask, np.broadcast_to(np.arange(T), (B, T)).copy()


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_out(path, toks, mask, pos):
    with torch.no_grad():
        return _hf(path)(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask),
                         position_ids=torch.tensor(pos), output_router_logits=True)


_fwd = jax.jit(lambda m, x, p, s: m(x, p, segment_ids=s, return_router_logits=True))


def _ours(model, toks, mask, pos):
    return _fwd(model, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask))


def _max_valid_diff(a, b):
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(LENS))


@pytest.mark.parity
@pytest.mark.parametrize("family", list(MOE))
def test_logits_and_router_logits_match_transformers(moe_checkpoints, family):
    toks, mask, pos = _batch()
    ref = _hf_out(moe_checkpoints[family], toks, mask, pos)
    model = from_pretrained(moe_checkpoints[family])
    assert model.cfg.moe_layers == ((0, 2) if family == "qwen3_moe" else (0, 1, 2))
    out = _ours(model, toks, mask, pos)
    assert _max_valid_diff(np.asarray(out.logits), ref.logits.numpy()) <= 1e-4
    assert len(out.router_logits) == len(ref.router_logits)
    for ours, theirs in zip(out.router_logits, ref.router_logits):
        assert _max_valid_diff(np.asarray(ours), theirs.numpy().reshape(B, T, -1)) <= 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("family", list(MOE))
def test_greedy_generation_matches_transformers(moe_checkpoints, family):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 97, n).tolist() for n in (9, 4, 13)]
    new = 16
    hf = _hf(moe_checkpoints[family])
    hf.generation_config.eos_token_id = None  # no stop and no EOS suppression (min_new_tokens would mask it)
    out = Sampler(from_pretrained(moe_checkpoints[family]), max_len=64).generate(
        prompts, SamplingParams(max_new_tokens=new, temperature=0.0))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, pad_token_id=0)
        np.testing.assert_array_equal(out.tokens[i], ref[0, len(p):].numpy())


@pytest.mark.parity
@pytest.mark.parametrize("family", list(MOE))
def test_export_round_trip_loads_in_transformers(moe_checkpoints, family, tmp_path):
    toks, mask, pos = _batch(2)
    model = from_pretrained(moe_checkpoints[family])
    path = save_pretrained(model, str(tmp_path / "export"))
    ref = _hf_out(path, toks, mask, pos).logits.numpy()
    assert _max_valid_diff(np.asarray(_ours(model, toks, mask, pos).logits), ref) <= 1e-4
    assert _max_valid_diff(ref, _hf_out(moe_checkpoints[family], toks, mask, pos).logits.numpy()) <= 1e-6


def test_fused_expert_layout_loads(moe_checkpoints, tmp_path):
    """A folder holding transformers' in-memory fused experts ([E, 2F, D] gate_up_proj) reads the same."""
    from safetensors.numpy import load_file, save_file

    src = moe_checkpoints["mixtral"]
    flat = load_file(os.path.join(src, "model.safetensors"))
    E = MOE["mixtral"]["num_local_experts"]
    out = {}
    for i in range(COMMON["num_hidden_layers"]):
        b = f"model.layers.{i}.block_sparse_moe."
        ex = [flat.pop(b + f"experts.{e}.{w}.weight") for w in ("w1", "w3", "w2") for e in range(E)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(
            [np.stack(ex[:E]), np.stack(ex[E:2 * E])], axis=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(ex[2 * E:])
        out[f"model.layers.{i}.mlp.gate.weight"] = flat.pop(b + "gate.weight")
    os.makedirs(tmp_path / "fused")
    save_file({**flat, **out}, str(tmp_path / "fused" / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh, open(tmp_path / "fused" / "config.json", "w") as g:
        g.write(fh.read())
    toks, mask, pos = _batch(3)
    a = np.asarray(_ours(from_pretrained(src), toks, mask, pos).logits)
    fused = _ours(from_pretrained(str(tmp_path / "fused")), toks, mask, pos)
    np.testing.assert_array_equal(np.asarray(fused.logits), a)


@pytest.mark.parity
def test_load_balancing_loss_equals_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.default_rng(0)
    E, k, L = 8, 2, 3
    logits = [rng.normal(size=(B, T, E)).astype(np.float32) * 2 for _ in range(L)]
    _, mask, _ = _batch()
    ref = load_balancing_loss_func(tuple(torch.tensor(x.reshape(-1, E)) for x in logits), E, k,
                                   torch.tensor(mask)).item()
    ours = float(moe.load_balancing_loss([jnp.asarray(x) for x in logits], E, k, jnp.asarray(mask)))
    assert abs(ours - ref) <= 1e-6
    ref = load_balancing_loss_func(tuple(torch.tensor(x.reshape(-1, E)) for x in logits), E, k).item()
    assert abs(float(moe.load_balancing_loss(logits, E, k)) - ref) <= 1e-6


@pytest.mark.slow
@pytest.mark.parity
def test_train_step_adds_transformers_aux_loss(moe_checkpoints):
    """The shared train step adds coef x HF's aux loss (padding masked), reports the router z-loss of a NumPy
    reference on transformers' router logits, and per-expert load."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from posttrain.losses import sft_loss
    from posttrain.train import init_state, make_train_step

    path = moe_checkpoints["qwen3_moe"]
    toks, mask, pos = _batch(4)
    hf = _hf_out(path, toks, mask, pos)
    ref = load_balancing_loss_func(hf.router_logits, 4, 2, torch.tensor(mask)).item()
    targets = np.roll(toks, -1, 1)
    batch = dict(tokens=toks, positions=pos, segment_ids=mask, targets=targets, weights=mask * 1.0)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    opt = optax.sgd(0.0)

    # ST-MoE z-loss in NumPy from transformers' router logits: mean over (real token, sparse layer) of
    # logsumexp(router logits)^2, in float64
    real = mask.reshape(-1).astype(bool)
    lse = [np.logaddexp.reduce(x.numpy().astype(np.float64)[real], axis=-1) for x in hf.router_logits]
    z = float(np.mean(np.concatenate(lse) ** 2))
    base = from_pretrained(path)
    graphdef0, state0 = nnx.split(base)

    def step_metrics(aux_coef, z_coef):
        model = nnx.merge(graphdef0, jax.tree.map(jnp.copy, state0))  # the step donates its state
        model.cfg = model.cfg.replace(router_aux_loss_coef=aux_coef, router_z_loss_coef=z_coef)  # read by the step
        graphdef, state = init_state(model, opt)
        return make_train_step(sft_loss, opt, graphdef)(state, batch)[1]

    m = step_metrics(0.5, 0.1)
    assert abs(float(m["router_aux_loss"]) - ref) <= 1e-6
    assert abs(float(m["router_z_loss"]) - z) <= 1e-5 * abs(z)  # z ~ 19: relative (float32 step vs float64 NumPy)
    load = np.array([float(m[f"expert_load_{e}"]) for e in range(4)])
    assert abs(load.mean() - 1.0) <= 1e-6  # shares x E: mean 1
    m0 = step_metrics(0.0, 0.0)  # "loss" stays the task's loss; the router losses only add gradient
    assert float(m0["loss"]) == pytest.approx(float(m["loss"]), abs=1e-6)
    assert abs(float(m0["grad_norm"]) - float(m["grad_norm"])) > 1e-4


@pytest.mark.slow
def test_dense_step_unchanged_and_lora_on_moe(moe_checkpoints):
    """A dense model's step is the plain one (the MoE hooks add nothing: SGD(1) moves the weights by exactly
    -grad(loss) / tokens of a hand-written jax.grad, and no router metric appears). LoRA on an MoE model adapts
    attention and the dense MLP only (experts and routers stay frozen); training moves the loss, and merging gives
    the adapted model."""
    from posttrain.losses import sft_loss
    from posttrain.models.lora import LoraParam, apply_lora, merge_lora
    from posttrain.train import init_state, make_train_step, merge

    toks, mask, pos = _batch(5)
    batch = {k: jnp.asarray(v) for k, v in dict(tokens=toks, positions=pos, segment_ids=mask,
                                                 targets=np.roll(toks, -1, 1), weights=mask * 1.0).items()}
    dense = Transformer(ModelConfig(vocab_size=97, embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    head_dim=16, mlp_dim=48), rngs=nnx.Rngs(0))
    gd, params, rest = nnx.split(dense, nnx.Param, ...)
    want = jax.grad(lambda p: sft_loss(nnx.merge(gd, p, rest), batch)[0])(params)
    want = jax.tree.map(lambda p, g: p - g / float(mask.sum()), params, want)
    graphdef, state = init_state(dense, optax.sgd(1.0))
    state, m = make_train_step(sft_loss, optax.sgd(1.0), graphdef)(state, batch)
    assert not [k for k in m if "router" in k or "expert" in k]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), state.params, want)

    model = apply_lora(from_pretrained(moe_checkpoints["qwen3_moe"]), rank=4)
    adapted = {".".join(map(str, p[:-1])) for p, _ in nnx.to_flat_state(nnx.state(model, LoraParam))}
    assert "layers.1.mlp.gate_up_lora" in adapted and "layers.0.attn.qkv_lora" in adapted
    assert not any("layers.0.mlp" in a or "layers.2.mlp" in a for a in adapted)
    opt = optax.adam(1e-2)
    graphdef, state = init_state(model, opt, trainable=LoraParam)
    step = make_train_step(sft_loss, opt, graphdef, trainable=LoraParam)
    losses = []
    for _ in range(5):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    trained = merge(graphdef, state)
    before = np.asarray(_ours(trained, toks, mask, pos).logits)
    after = np.asarray(_ours(merge_lora(trained), toks, mask, pos).logits)
    np.testing.assert_allclose(after, before, atol=1e-5)


def test_remat_gradients_equal(moe_checkpoints):
    graphdef, state = nnx.split(from_pretrained(moe_checkpoints["mixtral"]))
    toks, _, pos = _batch(6)

    @jax.jit
    def grads(st):
        def loss(st, remat):
            m = nnx.merge(graphdef, st)
            m.cfg = m.cfg.replace(remat=remat)
            return jnp.sum(m(jnp.asarray(toks), jnp.asarray(pos)).logits ** 2)

        return jax.grad(loss)(st, False), jax.grad(loss)(st, True)

    g1, g2 = grads(state)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):  # remat refuses XLA's fusions: round-off only
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * float(np.abs(b).max()) + 1e-6, rtol=0)


# transformers' own model of the same config on the meta device (nothing allocated)
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b"])
def test_moe_presets_count_like_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.hf import config_to_hf

    abstract = nnx.eval_shape(lambda: Transformer(preset(name), rngs=nnx.Rngs(0)))
    n = count_params(abstract)
    hf_cfg = config_to_hf(preset(name))
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg))
    assert n == sum(p.numel() for p in ref.parameters())
    assert n == {"qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704,  # their model cards' totals
                 "gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672}[name]


def test_plan_counts_experts():
    from posttrain.plan import plan

    cfg = preset("qwen3-30b-a3b")
    p = plan(cfg, batch=8, seq_len=1024, mesh_shape={"fsdp": 8}, preset="fsdp")
    n = count_params(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    assert p["parameters"] == pytest.approx(n * 4 / 8, rel=1e-3)  # float32, every expert, split 8 ways


def test_bad_moe_options_name_the_key(tmp_path):
    from transformers import AutoConfig

    from posttrain.models.hf import config_from_hf, config_to_hf

    kw = {**COMMON, **MOE["mixtral"], "router_jitter_noise": 0.1}
    kw.pop("model_type")
    with pytest.raises(PosttrainError, match="router_jitter_noise"):
        config_from_hf(AutoConfig.for_model("mixtral", **kw))
    with pytest.raises(PosttrainError, match="experts_per_token"):
        ModelConfig(vocab_size=8, embed_dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8,
                    num_experts=4, experts_per_token=5, expert_mlp_dim=8)
    with pytest.raises(PosttrainError, match="mixtral"):
        config_to_hf(preset("qwen3-30b-a3b", family="mixtral", dense_layers=(0,)))


@pytest.mark.parametrize("tile", [4, 64])
def test_grouped_matmul_tiled_equals_ragged_dot(monkeypatch, tile):
    """The CPU tiled grouped product equals jax.lax.ragged_dot, values and gradients (empty groups too)."""
    monkeypatch.setattr(moe, "TILE", tile)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(37, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 6, 3)), jnp.float32)
    sizes = jnp.asarray([9, 0, 20, 8, 0])

    def f(x, w, impl):
        return jnp.sum(jnp.sin(moe.grouped_matmul(x, w, sizes, impl)))

    ref = jax.value_and_grad(f, argnums=(0, 1))(x, w, "ragged")
    out = jax.value_and_grad(f, argnums=(0, 1))(x, w, "tiled")
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_experts_split_over_devices_equal_one_device(moe_checkpoints):
    """8 CPU devices, experts split over fsdp (fsdp_tp: 4 experts over fsdp 4), equal 1 device for two
    train steps (router losses included) and for greedy generation."""
    from test_sharding import assert_sharded_like_single_device

    import posttrain.sharding as sh
    from posttrain.losses import sft_loss
    from posttrain.train import init_state, make_train_step

    path = moe_checkpoints["qwen3_moe"]
    rng = np.random.default_rng(7)
    toks = rng.integers(3, 97, (8, T))
    mask = (np.arange(T)[None] < rng.integers(4, T + 1, 8)[:, None]).astype(np.int32)
    batch = dict(tokens=toks, positions=np.broadcast_to(np.arange(T), (8, T)).copy(), segment_ids=mask,
                 targets=np.roll(toks, -1, 1), weights=mask.astype(np.float32))

    def build():
        opt = optax.adamw(1e-3, eps=1e-5)  # eps: see test_sharding._sft_builder
        graphdef, state = init_state(from_pretrained(path), opt)
        return state, make_train_step(sft_loss, opt, graphdef)

    out = assert_sharded_like_single_device(build, batch, ("fsdp_tp",), steps=2)
    state = out["fsdp_tp"][1]
    w = state.params["layers"][0]["mlp"]["expert_gate_up"][...]
    assert {s.data.shape[0] for s in w.addressable_shards} == {1}  # one expert per fsdp device
    prompts = [rng.integers(3, 97, n).tolist() for n in (5, 9, 3, 7)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    ref = Sampler(from_pretrained(path), max_len=32).generate(prompts, params)
    mesh, rules = sh.make_mesh("fsdp_tp"), sh.preset_rules("fsdp_tp")
    with sh.use_mesh(mesh, rules):
        got = Sampler(from_pretrained(path, mesh=mesh, rules=rules), max_len=32, mesh=mesh,
                      rules=rules).generate(prompts, params)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)
