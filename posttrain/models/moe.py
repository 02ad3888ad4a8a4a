"""Mixture-of-experts MLP block (Qwen3-MoE, Mixtral, Gemma 4), its router losses, and the hook that hands them
to the step.

What it is: the routed replacement for the dense gated MLP on a model's sparse layers
(`ModelConfig.num_experts > 0`, every layer not in `dense_layers`), or, for Gemma 4
(`moe_beside_mlp`), a second branch beside every layer's dense MLP (transformer.Block adds the norms).
Routing follows Hugging Face transformers 5.12 exactly: router logits = x W_r (compute dtype),
probabilities = float32 softmax, the top-k experts per token, their probabilities renormalised to
sum 1 when `norm_topk_prob` (Mixtral, Gemma 4 always), and y = sum_k p_k * down_e(act(gate_e(x)) * up_e(x)).
Gemma 4's router reads the layer input normalised without a scale, times a learned scale [D] and
D^-1/2, and multiplies the renormalised weights by a learned per-expert scale [E]. GPT-OSS adds a router bias,
gate/up and down biases per expert, and its clamped activation (`gpt_oss_glu`); its router's softmax over the
top-k logits is the renormalised top-k of the full softmax.

Dropless and grouped (MegaBlocks, arXiv 2211.15841): the N * k (token, expert) assignments are
sorted by expert, each expert's rows form one contiguous group, and the two expert projections
are grouped matrix products over those groups (`grouped_matmul`: `jax.lax.ragged_dot` on GPU/TPU,
whole-tile groups on CPU, where jax lowers ragged_dot densely), so every assignment is computed
once and none is dropped; no expert runs on tokens it was not chosen for.
Outputs return to token order by the inverse permutation and are summed with their weights.
One exception, on CPU only: a handful of tokens (decode steps) runs every expert on every token,
weighted by the router (zero off the top-k), which is less work there than any grouped form
(`_every_expert_is_cheaper`); the sums are the same up to float rounding.

Router losses (what `train/step.py` adds to every trainer's loss, scaled by the model's
`router_aux_loss_coef` and `router_z_loss_coef`):
  load balance (Switch Transformer, arXiv 2101.03961, eqs. 4-6, as transformers'
    `load_balancing_loss_func` with an attention mask): over all MoE layers and real tokens,
    aux = E * sum_e f_e * P_e, f_e = share of (token, layer) pairs whose top-k holds e,
    P_e = mean router probability of e;
  z-loss (ST-MoE, arXiv 2202.08906): the mean over (token, layer) of logsumexp(logits)^2.
The statistics reach the step as data on the model: the step gives every MoE Transformer inside the
model it trains an empty `RouterStats` variable (`collect_router(model)`), each forward of that
Transformer appends its MoE layers' statistics to it (`sow_router`: hits, probabilities, z, token
count, summed over layers and real tokens), and the step pops them (`router_loss(model)`) into (aux
total, metrics). A Transformer without the variable (a frozen reference, the adapters-off view, any
forward outside a train step) computes and keeps nothing.

Routing replay (RL, R3): `chosen_experts(router_logits, k)` gives the experts of every token ([B, T, M, k]);
the Transformer's `routes=` hands them back to each MoE layer (`route(..., replay=)`), which then uses those
experts with the current router's (renormalised) probabilities, so a policy update can follow the routing its
sample used (`generate.Sampler` records it with `SamplingParams.record_routes`).

What it is not: expert parallelism with token exchange (the `expert` axis of `sharding.py`
splits the expert weights; the grouped products are left to XLA's partitioner), capacity
factors or token dropping, shared experts (Qwen2-MoE, DeepSeek), LoRA on the experts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.models.layers import rms_normalize, split
from posttrain.sharding import constrain, param

# ------------------------------------------------------------------------------------------ block


TILE = 128  # rows per tile of the CPU grouped product (tests may change it)


def grouped_matmul(x, w, group_sizes, impl: str = "auto"):
    """x [A, I] rows sorted by group, w [E, I, O], group_sizes [E] (sum A) -> [A, O]: row r times w[its group].

    impl "ragged": `jax.lax.ragged_dot` (grouped GEMM kernels on GPU and TPU; on CPU, jax 0.10 lowers it
    densely: every group against every row, E times the work). "tiled": each group is padded to
    whole tiles of TILE rows, so each tile belongs to one group, and a loop over the tiles multiplies
    each by its own group's weight, read in place (`_tile_matmul`): at most E tiles of padding, no row
    times a weight it does not use. Measured on 2 CPU cores (AVX2), 4096 rows x 8 groups x 256 -> 512,
    forward + backward: ~75 ms, against ~145 ms for one batched product over per-tile gathered weights
    (this function's previous form), ~1.3 s for ragged_dot, ~46 ms for a plain product of as many rows.
    "auto": ragged off CPU; on CPU whichever does fewer rows of work (E x A for ragged_dot, the tiles).
    """
    A, E, m = x.shape[0], w.shape[0], TILE
    tiles = -(-A // m) + E  # static bound on sum_e ceil(size_e / m)
    if impl == "auto":
        impl = "tiled" if jax.default_backend() == "cpu" and tiles * m < E * A else "ragged"
    sizes = group_sizes.astype(jnp.int32)
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, sizes)
    if impl != "tiled":
        raise ValueError(f"unknown grouped matmul implementation {impl!r}")
    padded = -(-sizes // m) * m
    start = jnp.cumsum(sizes) - sizes  # first sorted row of each group
    pstart = jnp.cumsum(padded) - padded  # first padded row of each group
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(A, dtype=jnp.int32), side="right")  # of each row
    dest = pstart[group] + jnp.arange(A, dtype=jnp.int32) - start[group]  # padded slot of each row
    xp = jnp.zeros((tiles * m, x.shape[1]), x.dtype).at[dest].set(x, unique_indices=True)
    owner = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles, dtype=jnp.int32) * m, side="right")
    owner = jnp.minimum(owner, E - 1)  # trailing empty tiles (all padding) use the last group's weight
    y = _tile_matmul(xp.reshape(tiles, m, -1), w, owner)
    return jnp.take(y.reshape(tiles * m, -1), dest, axis=0, unique_indices=True)


@jax.custom_vjp
def _tile_matmul(xt, w, owner):
    """xt [T, m, I], w [E, I, O], owner [T] int -> [T, m, O]: tile t times w[owner[t]], one tile at a time.

    A loop rather than one batched product over gathered weights: the gather copies a weight per tile
    (T x I x O), and autodiff turns it into a scatter-add of T weight gradients; the loop reads each
    weight in place; its backward sums the tiles' weight gradients per group (the tiles are sorted by group).
    """
    return jax.lax.map(lambda a: a[0] @ w[a[1]], (xt, owner))


def _tile_matmul_fwd(xt, w, owner):
    return _tile_matmul(xt, w, owner), (xt, w, owner)


def _tile_matmul_bwd(res, dy):
    xt, w, owner = res
    dwt = jax.lax.map(lambda a: a[0].T @ a[1], (xt, dy))  # each tile's weight gradient [T, I, O]
    dw = jax.ops.segment_sum(dwt, owner, w.shape[0], indices_are_sorted=True)  # tiles are in group order
    wt = jnp.swapaxes(w, 1, 2)
    dx = jax.lax.map(lambda a: a[0] @ wt[a[1]], (dy, owner))
    return dx.astype(xt.dtype), dw.astype(w.dtype), None


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def _every_expert_is_cheaper(n: int, num_experts: int, k: int) -> bool:
    """On CPU, for a few tokens (decode steps), every expert on every token weighted by the router (zero
    off the top-k) does less work than any grouped product: E x n rows against ragged_dot's CPU
    lowering (E x n k) or the tiles' padding (at least E x TILE), with no sort. Measured on 2 cores,
    the anchors' tiny Qwen3-MoE, 8 tokens: 0.79 ms a layer against 1.35 ms (ragged_dot) and 4.1 ms (tiles).
    Never off CPU, where ragged_dot is a grouped kernel."""
    tiles = -(-n * k // TILE) + num_experts
    return jax.default_backend() == "cpu" and num_experts * n <= tiles * TILE


def gpt_oss_glu(gate, up, alpha: float = 1.702, limit: float = 7.0):
    """GPT-OSS experts' activation (transformers GptOssExperts._apply_gate): gate clamped above at `limit`,
    up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def route(logits, k: int, normalize: bool, replay=None):
    """Router logits [..., E] -> (weights [..., k] float32, expert ids [..., k] int32), as transformers.

    replay [..., k] int (or None): experts chosen elsewhere (the sampler's: routing replay); a token whose
    first entry is -1 keeps its own top-k. The weights are the router's probabilities of the experts used."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    if replay is not None:
        replay = replay.astype(jnp.int32)
        idx = jnp.where(replay[..., :1] >= 0, replay, idx)
        if normalize:  # the renormalised weights straight from the chosen logits: finite however far the
            # router has moved from the choice (p_i / sum p_chosen with every p_chosen rounded to 0 is 0/0)
            return jax.nn.softmax(jnp.take_along_axis(logits.astype(jnp.float32), idx, axis=-1), axis=-1), idx
        top = jnp.take_along_axis(probs, idx, axis=-1)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, idx


class MoE(nnx.Module):
    """Top-k routed gated experts of one layer (einsum letters: E experts, F expert width)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, E, F = cfg.embed_dim, cfg.num_experts, cfg.expert_mlp_dim
        pd = jnp.dtype(cfg.param_dtype)
        init = nnx.initializers.normal(0.02)
        self.router = param(init(rngs.params(), (D, E), pd), ("embed", None))
        self.router_bias = param(jnp.zeros((E,), pd), (None,)) if cfg.router_bias else None
        g4 = cfg.moe_beside_mlp  # Gemma 4's router (HF: router.scale, router.per_expert_scale)
        self.router_scale = param(jnp.ones((D,), pd), ("embed",)) if g4 else None
        self.expert_scale = param(jnp.ones((E,), pd), (None,)) if g4 else None
        self.eps = cfg.norm_eps
        # Not named gate_up / down: LoRA (models/lora.py) targets those names and adapts dense MLPs only.
        self.expert_gate_up = param(init(rngs.params(), (E, D, 2, F), pd), ("expert", "embed", None, "mlp"))
        self.expert_down = param(init(rngs.params(), (E, F, D), pd), ("expert", "mlp", "embed"))
        self.expert_gate_up_bias = param(jnp.zeros((E, 2, F), pd), ("expert", None, "mlp")) if cfg.expert_bias else None
        self.expert_down_bias = param(jnp.zeros((E, D), pd), ("expert", "embed")) if cfg.expert_bias else None
        self.gpt_oss = cfg.expert_act == "gpt_oss"
        self.k = cfg.experts_per_token
        self.normalize = cfg.norm_topk_prob
        self.act = jax.nn.silu if cfg.activation == "silu" else (lambda z: jax.nn.gelu(z, approximate=True))
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x, router_x=None, routes=None):
        """x [B, T, D] -> (y [B, T, D], router logits [B, T, E] float32); router_x: the router's input if not x;
        routes [B, T, k]: replay these experts (`route`)."""
        dt, k = self.dtype, self.k
        B, T, D = x.shape
        E, _, _, F = self.expert_gate_up.shape
        xf = x.astype(dt).reshape(B * T, D)
        rx = xf if router_x is None else router_x.astype(dt).reshape(B * T, D)
        if self.router_scale is not None:
            rx = rms_normalize(rx, self.eps) * self.router_scale[...].astype(dt) * jnp.asarray(D ** -0.5, dt)
        logits = rx @ self.router[...].astype(dt)  # [N, E]
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(dt)
        weights, idx = route(logits, k, self.normalize, None if routes is None else routes.reshape(B * T, k))
        if self.expert_scale is not None:
            weights = weights * jnp.take(self.expert_scale[...].astype(jnp.float32), idx)
        gate_up, down = self.expert_gate_up[...].astype(dt), self.expert_down[...].astype(dt)
        gb = None if self.expert_gate_up_bias is None else self.expert_gate_up_bias[...].astype(dt)
        db = None if self.expert_down_bias is None else self.expert_down_bias[...].astype(dt)
        glu = gpt_oss_glu if self.gpt_oss else (lambda g, u: self.act(g) * u)
        if _every_expert_is_cheaper(B * T, E, k):  # decode steps on CPU: see _every_expert_is_cheaper
            comb = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * weights[..., None], axis=1)  # [N, E]
            # x broadcast over the experts: one batched product that reads each expert's weight in place
            # (with x unbatched, XLA transposed the whole [E, D, 2, F] weight at every decode step)
            h = jnp.einsum("end,edgf->engf", jnp.broadcast_to(xf, (E, B * T, D)), gate_up)
            if gb is not None:
                h = h + gb[:, None]
            h = glu(h[:, :, 0], h[:, :, 1]) * comb.T.astype(dt)[..., None]  # the weight before down: linear
            out = jnp.einsum("enf,efd->nd", h, down)
            if db is not None:
                out = out + comb.astype(dt) @ db
        else:
            flat = idx.reshape(-1)  # assignment a = token * k + slot
            order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
            inverse = jnp.argsort(order)
            sizes = jnp.bincount(flat, length=E)
            xs = jnp.take(xf, order // k, axis=0)  # [N k, D]
            h = grouped_matmul(xs, gate_up.reshape(E, D, 2 * F), sizes)
            if gb is not None:
                h = h + jnp.take(gb.reshape(E, 2 * F), flat[order], axis=0)
            gate, up = split(h.reshape(-1, 2, F), 1, (1, 1))
            h = glu(gate[:, 0], up[:, 0])
            y = grouped_matmul(h, down, sizes)  # [N k, D]
            if db is not None:
                y = y + jnp.take(db, flat[order], axis=0)
            y = jnp.take(y, inverse, axis=0).reshape(B * T, k, D)
            out = jnp.einsum("nkd,nk->nd", y, weights.astype(dt))
        return constrain(out.reshape(B, T, D), ("batch", "seq", "embed")), logits.reshape(B, T, E).astype(jnp.float32)


# ------------------------------------------------------------------------------------------ router losses


def _stats(router_logits: Sequence[jax.Array], valid: jax.Array, k: int) -> dict:
    """Sums over layers and real tokens: expert hits [E], router probabilities [E], lse^2, count."""
    v = valid.astype(jnp.float32)
    hits = probs = z = 0.0
    for lg in router_logits:
        lg = lg.astype(jnp.float32)
        p = jax.nn.softmax(lg, axis=-1)
        _, idx = jax.lax.top_k(p, k)
        onehot = jax.nn.one_hot(idx, lg.shape[-1], dtype=jnp.float32).sum(-2)  # [..., E]: in this token's top-k
        hits = hits + jnp.sum(onehot * v[..., None], axis=tuple(range(v.ndim)))
        probs = probs + jnp.sum(p * v[..., None], axis=tuple(range(v.ndim)))
        z = z + jnp.sum(jnp.square(jax.nn.logsumexp(lg, axis=-1)) * v)
    return {"hits": hits, "probs": probs, "z": z, "n": jnp.sum(v) * len(router_logits)}


def _aux(st: dict, num_experts: int) -> jax.Array:
    n = jnp.maximum(st["n"], 1.0)
    return num_experts * jnp.sum((st["hits"] / n) * (st["probs"] / n))


def load_balancing_loss(router_logits, num_experts: int, top_k: int, mask: Optional[jax.Array] = None):
    """transformers' `load_balancing_loss_func`: router_logits a sequence (one per MoE layer) of
    [B, T, E] (or [N, E]) arrays; mask [B, T] (1 = real token) or None (every token)."""
    router_logits = tuple(router_logits)
    valid = jnp.ones(router_logits[0].shape[:-1]) if mask is None else mask
    return _aux(_stats(router_logits, valid, top_k), num_experts)


def z_loss(router_logits, mask: Optional[jax.Array] = None):
    """Router z-loss: mean over (real token, layer) of logsumexp(logits)^2."""
    router_logits = tuple(router_logits)
    valid = jnp.ones(router_logits[0].shape[:-1]) if mask is None else mask
    st = _stats(router_logits, valid, 1)
    return st["z"] / jnp.maximum(st["n"], 1.0)


# ------------------------------------------------------------------------------------------ step hook


class RouterStats(nnx.Intermediate):
    """The router statistics of one train step's forwards of a Transformer (a tuple, one entry a forward)."""


def collect_router(model) -> None:
    """Give every MoE Transformer inside `model` an empty `RouterStats` (the train step, before its loss)."""
    for _, m in nnx.iter_modules(model):
        if getattr(type(m), "routes_tokens", False) and m.cfg.num_experts:
            m.router_stats = RouterStats(())


def sow_router(owner, router_logits, valid) -> None:
    """Called by `Transformer.__call__` (no cache) with its MoE layers' router logits and real-token mask:
    appends their statistics to the owner's `RouterStats` when the step gave it one; else nothing."""
    stats = getattr(owner, "router_stats", None)
    if router_logits and isinstance(stats, RouterStats):
        stats.set_value(stats.get_value() + (_stats(router_logits, valid, owner.cfg.experts_per_token),))


def router_loss(model):
    """(coef-weighted aux + z losses, metrics) of the `RouterStats` the forwards of `model`'s Transformers
    appended since `collect_router(model)`, which this removes; None when nothing was routed.

    Metrics: router_aux_loss, router_z_loss (unweighted) and expert_load_<e>: expert e's share of
    the (token, slot) assignments times E (1.0 everywhere = perfectly balanced), per model of the sink.
    """
    modules = dict(nnx.iter_modules(model))
    records = []
    for path, var in nnx.to_flat_state(nnx.pop(model, RouterStats)):  # path: the Transformer's, "router_stats"
        records += [(modules[tuple(path[:-1])].cfg, st) for st in var.get_value()]  # one per forward
    if not records:
        return None
    by_cfg: dict = {}
    for cfg, st in records:  # several forwards of one model: pool their tokens (one concatenated batch)
        prev = by_cfg.get(cfg)
        by_cfg[cfg] = st if prev is None else jax.tree.map(jnp.add, prev, st)
    total, metrics = 0.0, {}
    for j, (cfg, st) in enumerate(by_cfg.items()):
        tag = "" if j == 0 else f"_{j}"
        aux = _aux(st, cfg.num_experts)
        z = st["z"] / jnp.maximum(st["n"], 1.0)
        total = total + cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z
        metrics[f"router_aux_loss{tag}"] = aux
        metrics[f"router_z_loss{tag}"] = z
        load = jax.lax.stop_gradient(st["hits"] / jnp.maximum(st["n"] * cfg.experts_per_token, 1.0)) * cfg.num_experts
        for e in range(cfg.num_experts):
            metrics[f"expert_load{tag}_{e}"] = load[e]
    return total, metrics


def chosen_experts(router_logits, k: int):
    """The experts each token was routed to: router logits (a sequence over MoE layers of [B, T, E]) ->
    [B, T, M, k] int32 (what routing replay gives back to the forward as `routes`)."""
    return jnp.stack([route(lg, k, False)[1] for lg in router_logits], axis=2)
