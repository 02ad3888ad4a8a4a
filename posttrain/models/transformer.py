"""The one decoder-only Transformer (Flax NNX), driven by a ModelConfig; forward only. Its decoder layer,
`Block`, puts together the pieces of `layers.py` (norms, attention, dense MLP) and `moe.py` (the experts).

`Transformer(tokens, positions, *, cache=None, segment_ids=None, branch_ids=None, return_hidden=False,
return_attn=False)` returns a `ModelOutput`. What it is not: a sampler (see `posttrain.generate`)
or a loss (see `posttrain.losses`). Mixture-of-experts layers (`models/moe.py`) return their router
logits (`return_router_logits`) and, without a cache, append their statistics for the train step's router
losses (`moe.RouterStats`, which the step attaches and pops).
Gemma 4: per-layer input embeddings (a token table of L * P plus a projection of the embeddings,
normed, summed, scaled by 2^-1/2, one [P] slice per layer) and KV-shared layers, which attend the
keys and values their source layer just attended (with a cache: that layer's cache after this
call's write), so the cache holds only the first `cfg.cache_layers` layers.

Masking rule, the same with and without a cache (`models/attention.py` holds it and the
implementations): a query attends a key slot when the slot holds a real token (segment id != 0 /
cache position >= 0), the slot is not after the query (causal by slot index), both belong to the
same segment (packing), the key is in the shared prefix (branch 0) or the query's own branch
(prefix-shared rows), and, on sliding-window layers, the key's position is within
`sliding_window` positions of the query's (query included).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models import kv_store, moe, scan
from posttrain.models.attention import Layout, kv_pack, softcap
from posttrain.models.config import ModelConfig
from posttrain.models.deltanet import GatedDeltaNet, LinearState
from posttrain.models.layers import MLP, Attention, Buffer, RMSNorm, project, rope_cos_sin, rope_lookup
from posttrain.models.moe import MoE
from posttrain.sharding import constrain, param


class Block(nnx.Module):
    """One decoder layer: pre-norm attention and MLP residuals (Gemma 2/3/4 add post-norms).

    Gemma 4 adds, per ModelConfig: the routed experts beside the dense MLP (`moe_beside_mlp`: each
    branch post-normed, summed, then the shared post-norm), a per-layer input residual after the MLP
    (`per_layer_dim`: down(act(gate(x)) * per-layer input), normed) and a loaded output scalar."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        norm = dict(eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, param_dtype=pd)
        D, P = cfg.embed_dim, cfg.per_layer_dim
        self.attn_norm = RMSNorm(D, **norm)
        # the token mixer: attention, or a Gated DeltaNet on Qwen3.5's "linear" layers (models/deltanet.py)
        linear = cfg.layer_type(layer) == "linear"
        self.attn = None if linear else Attention(cfg, layer, rngs=rngs)
        self.linear = GatedDeltaNet(
            D, key_heads=cfg.linear_key_heads, value_heads=cfg.linear_value_heads, key_dim=cfg.linear_key_dim,
            value_dim=cfg.linear_value_dim, kernel=cfg.linear_conv_kernel, eps=cfg.norm_eps, param_dtype=pd,
            dtype=cfg.dtype, rngs=rngs) if linear else None
        self.mlp_norm = RMSNorm(D, **norm)
        routed = cfg.is_moe_layer(layer)
        self.routed = routed  # an MoE layer (its own or beside the dense MLP): takes `routes`
        self.mlp = MoE(cfg, rngs=rngs) if routed and not cfg.moe_beside_mlp else MLP(
            cfg, rngs=rngs, width=cfg.layer_mlp_dim(layer))
        # Qwen3.5-MoE: the shared expert beside the routed ones, scaled per token by sigmoid(x shared_gate)
        shared = routed and cfg.shared_expert_dim > 0
        self.shared = MLP(cfg, rngs=rngs, width=cfg.shared_expert_dim) if shared else None
        self.shared_gate = param(nnx.initializers.normal(0.02)(rngs.params(), (D, 1), pd),
                                 ("embed", None)) if shared else None
        # Gemma 4: experts beside the MLP (HF norms: pre_feedforward_layernorm_2, post_feedforward_layernorm_1, _2)
        beside = routed and cfg.moe_beside_mlp
        self.moe = MoE(cfg, rngs=rngs) if beside else None
        self.moe_norm, self.post_dense_norm, self.post_moe_norm = (RMSNorm(D, **norm) if beside else None
                                                                   for _ in range(3))
        if cfg.sandwich_norm:
            self.post_attn_norm, self.post_mlp_norm = RMSNorm(D, **norm), RMSNorm(D, **norm)
        else:
            self.post_attn_norm = self.post_mlp_norm = None
        # Gemma 4 per-layer inputs (HF: per_layer_input_gate, per_layer_projection, post_per_layer_input_norm)
        init = nnx.initializers.normal(0.02)
        self.ple_gate = param(init(rngs.params(), (D, P), pd), ("embed", None)) if P else None
        self.ple_proj = param(init(rngs.params(), (P, D), pd), (None, "embed")) if P else None
        self.ple_norm = RMSNorm(D, **norm) if P else None
        scalar = cfg.layer_scalar  # Gemma 4's layer_scalar: loaded, never trained
        self.layer_scalar = Buffer(jnp.ones((1,), pd), out_sharding=(None,), eager_sharding=False) if scalar else None
        self.act = jax.nn.silu if cfg.activation == "silu" else (lambda z: jax.nn.gelu(z, approximate=True))
        # static: the Transformer passes the (cos, sin) of this (RopeConfig, head size)
        self.rope = (cfg.layer_rope(layer), cfg.layer_head_dim(layer))

    def __call__(self, x, rope, layout, kv=None, write_index=None, return_attn=False, shared_kv=None,
                 per_layer_input=None, routes=None):
        """Returns (x, kv, attention probabilities or None, router logits [B, T, E] or None: dense MLP).

        kv: this layer's cache: (k, v), or a linear layer's `LinearState`; returned updated (without a cache:
        the keys and values attended, or the linear state after the last token).
        shared_kv: the source layer's (k, v) for a KV-shared layer; per_layer_input [B, T, P] (Gemma 4);
        routes [B, T, k]: the experts to replay in this layer's MoE (routing replay)."""
        if self.linear is not None:  # branch ids: prefix-shared rows (without a cache: one sequence per row)
            branches = layout.q_branch if kv is None else None
            h, kv = self.linear(self.attn_norm(x), kv, valid=layout.q_pos >= 0,
                                segments=None if branches is not None else layout.q_seg, branches=branches)
            attn = None
        else:
            h, kv, attn = self.attn(self.attn_norm(x), rope, layout, kv, write_index, return_attn, shared_kv)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        router = None
        if isinstance(self.mlp, moe.MoE):  # mixture of experts (models/moe.py)
            n = self.mlp_norm(x)
            h, router = self.mlp(n, routes=routes)
            if self.shared is not None:
                h = h + jax.nn.sigmoid(n @ self.shared_gate[...].astype(n.dtype)) * self.shared(n)
        else:
            h = self.mlp(self.mlp_norm(x))
        if self.moe is not None:  # Gemma 4: the experts see the layer's input; the router normalises its own
            e, router = self.moe(self.moe_norm(x), router_x=x, routes=routes)
            h = self.post_dense_norm(h) + self.post_moe_norm(e)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        x = x + h
        if self.ple_gate is not None:
            dt = x.dtype
            h = self.act(x @ self.ple_gate[...].astype(dt)) * per_layer_input.astype(dt)
            x = x + self.ple_norm(h @ self.ple_proj[...].astype(dt))
        if self.layer_scalar is not None:
            x = x * self.layer_scalar[...].astype(x.dtype)
        x = constrain(x, ("batch", "seq", "embed"))
        return x, kv, attn, router


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer with its own (`cfg.cache_layers`), [B, K, S, H] each (K and H of
    that layer; empty [B, 0, S, 0] on a Gated DeltaNet layer, whose `LinearState` is in `linear`), plus slot
    bookkeeping. On a TPU, heads narrower than its 128 lanes are stored P to a row, [B, K/P, S, P*H]
    (attention.pack_heads: one token's write then stays in place); attention reads either form.

    pos [B, S] int32: the position of the token in each slot, -1 for an empty or padding slot.
    index: scalar int32, the next slot to write (the same for every row: prompts are left-padded).
    branch [B, S] int32 or None: the branch id of each slot, kept once a call passes branch_ids.
    k, v: a tuple with one array a layer, or one stacked [L, B, K, S, H] array for scanned layers (models/scan.py).
    """

    k: tuple | jax.Array
    v: tuple | jax.Array
    pos: jax.Array
    index: jax.Array
    branch: Optional[jax.Array] = None
    linear: tuple = ()  # per cache layer: its LinearState (conv inputs, delta-rule state) or None (attention)

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, size: int, dtype=None, pack: Optional[int] = None,
             stacked: bool = False, kv_dtype=None) -> "KVCache":
        """pack: heads a row holds (attention.pack_heads); None: attention.kv_pack's choice for the backend (2
        for 64-wide heads on a TPU, else 1). stacked: k and v as [L, ...] arrays (uniform layers: scan.uniform).
        kv_dtype: the keys' and values' storage dtype (e.g. float8_e4m3fn: 1 byte an element; int8: a kv_store.QuantKV
        of values and scales), converted as models/kv_store.py says; None: `dtype`."""
        dtype = jnp.dtype(dtype or cfg.dtype)
        kv_dt = jnp.dtype(kv_dtype or dtype)
        lin = [cfg.layer_type(i) == "linear" for i in range(cfg.cache_layers)]

        def shape(i):
            if lin[i]:
                return (batch, 0, size, 0)
            K, H = cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
            p = pack or kv_pack(H, K)
            if K % p:
                raise ValueError(f"a cache row cannot hold {p} of layer {i}'s {K} key/value heads")
            return (batch, K // p, size, p * H)

        shapes = [shape(i) for i in range(cfg.cache_layers)]
        conv = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim
        states = tuple(LinearState(jnp.zeros((batch, cfg.linear_conv_kernel - 1, conv), dtype), jnp.zeros(
            (batch, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim), jnp.float32)) if x else None
            for x in lin) if any(lin) else ()
        if stacked:
            assert scan.uniform(cfg), "a stacked cache is for uniform layers (models/scan.py)"
            k, v = (kv_store.empty((len(shapes), *shapes[0]), kv_dt) for _ in range(2))
        else:
            k, v = (tuple(kv_store.empty(s, kv_dt) for s in shapes) for _ in range(2))
        return cls(k, v, jnp.full((batch, size), -1, jnp.int32), jnp.zeros((), jnp.int32), linear=states)

    def map_kv(self, fn) -> "KVCache":
        """The cache with k and v replaced by fn(x, a) of each layer's keys or values, a = x's batch axis (1 for a
        stacked [L, B, ...] cache, else 0); an int8 cache's values and scales alike (their first axes agree)."""
        def each(x, a):
            return jax.tree.map(lambda y: fn(y, a), x)

        if isinstance(self.k, tuple):
            return dataclasses.replace(self, k=tuple(each(x, 0) for x in self.k), v=tuple(each(x, 0) for x in self.v))
        return dataclasses.replace(self, k=each(self.k, 1), v=each(self.v, 1))

    @property
    def size(self) -> int:
        return self.pos.shape[1]


class ModelOutput(NamedTuple):
    logits: Optional[jax.Array]  # [B, T, V] (None when return_logits=False)
    cache: Optional[KVCache]  # updated cache when one was passed
    hidden: Optional[tuple]  # L + 1 states [B, T, D]: embeddings, then each layer; the last after the final norm
    attn: Optional[tuple]  # L attention probabilities [B, N, T, S] (None for a layer not asked for)
    router_logits: Optional[tuple] = None  # per MoE layer [B, T, E] float32, when return_router_logits


class Transformer(nnx.Module):
    routes_tokens = True  # its MoE layers' statistics go to the train step (moe.collect_router / sow_router)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.embed_dim), pd),
                           ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset,
                                  param_dtype=pd)
        self.lm_head = None if cfg.tie_embeddings else param(
            nnx.initializers.normal(0.02)(rngs.params(), (cfg.embed_dim, cfg.vocab_size), pd),
            ("embed", "vocab"))
        # Gemma 4 per-layer inputs (HF: embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm)
        LP, init = cfg.num_layers * cfg.per_layer_dim, nnx.initializers.normal(0.02)
        self.ple_embed = param(init(rngs.params(), (cfg.per_layer_vocab or cfg.vocab_size, LP), pd),
                               ("vocab", None)) if LP else None
        self.ple_model_proj = param(init(rngs.params(), (cfg.embed_dim, LP), pd), ("embed", None)) if LP else None
        self.ple_norm = RMSNorm(cfg.per_layer_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset,
                                param_dtype=pd, names=(None,)) if LP else None
        if cfg.vision is not None:  # a vision-language model's tower (Qwen3-VL), run by vision/qwen_vl.py
            from posttrain.vision.qwen_vl import VisionTower
            self.vision = VisionTower(cfg.vision, param_dtype=pd, rngs=rngs)

    def embed_tokens(self, tokens):
        dt = jnp.dtype(self.cfg.dtype)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        if self.cfg.embed_scale:
            # HF Gemma rounds the normaliser to the compute dtype before multiplying.
            x = x * jnp.asarray(self.cfg.embed_dim ** 0.5, dt)
        return constrain(x, ("batch", "seq", "embed"))

    def per_layer_inputs(self, tokens, x):
        """Gemma 4: [B, T, L, P] per-layer inputs from tokens [B, T] and their scaled embeddings x [B, T, D]."""
        cfg, dt = self.cfg, x.dtype
        B, T, L, P = *tokens.shape, cfg.num_layers, cfg.per_layer_dim
        ids = jnp.take(self.ple_embed[...], tokens, axis=0).astype(dt) * jnp.asarray(P ** 0.5, dt)
        proj = (x @ self.ple_model_proj[...].astype(dt)) * jnp.asarray(cfg.embed_dim ** -0.5, dt)
        proj = self.ple_norm(proj.reshape(B, T, L, P))
        return (proj + ids.reshape(B, T, L, P)) * jnp.asarray(2.0 ** -0.5, dt)

    def unembed(self, h, head=None):
        """Final hidden states [B, T, D] (after the final norm) -> logits [B, T, V]. head: the tied embedding
        transposed [D, V] when the caller keeps one (the sampler, on CPU), else read from the weights."""
        dt = jnp.dtype(self.cfg.dtype)
        if head is not None:
            logits = jnp.einsum("btd,dv->btv", h.astype(dt), head.astype(dt))
        elif self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", h.astype(dt), self.embed[...].astype(dt))
        else:  # weight gradient as one plain product on a CPU (layers.project)
            logits = project(h.astype(dt), self.lm_head[...].astype(dt))
        logits = softcap(logits, self.cfg.final_softcap)
        return constrain(logits, ("batch", "seq", "vocab"))

    def rope_tables(self, length: int) -> dict:
        """RoPE (cos, sin) tables [length, H] for positions 0 .. length - 1, per (RopeConfig, H) in use.

        A decode loop computes these once and passes them to every step (`rope_tables=`): XLA
        would otherwise fuse a fresh sin/cos into each layer's q and k fusions at every step
        (profiled: ~40 us a layer per step on CPU). Values equal the direct computation.
        """
        return {r: (c[0], s[0]) for r, (c, s) in self._ropes(jnp.arange(length, dtype=jnp.int32)[None]).items()}

    def _ropes(self, positions) -> dict:
        """(cos, sin) [B, T, H] for `positions` [B, T], per (RopeConfig, head size) the layers use."""
        return {r: rope_cos_sin(positions, *r) for r in {b.rope for b in self.layers}}

    def __call__(self, tokens, positions, **kw) -> ModelOutput:
        """See `forward`; run under the config's matmul precision when it sets one (`ModelConfig.matmul_precision`:
        "highest" makes float32 matmuls exact on a TPU, whose default passes float32 operands through bfloat16)."""
        if self.cfg.matmul_precision is None:
            return self.forward(tokens, positions, **kw)
        with jax.default_matmul_precision(self.cfg.matmul_precision):
            return self.forward(tokens, positions, **kw)

    def forward(self, tokens, positions, *, cache: Optional[KVCache] = None, segment_ids=None, branch_ids=None,
                return_hidden=False, return_attn=False, return_logits=True, rope_tables=None,
                return_router_logits=False, routes=None, embeds=None, deepstack=None, image_ids=None,
                layer_stack=None) -> ModelOutput:
        """tokens, positions: [B, T] int; segment_ids: [B, T] int (0 = padding) or None;
        branch_ids: [B, T] int (0 = shared prefix, b > 0 = continuation b of a prefix-shared row) or None.

        rope_tables: from `rope_tables(n)` with every position < n, or None to compute RoPE here.
        return_attn: True for every layer's attention probabilities, or a collection of layer indices.
        return_router_logits: the router logits of every MoE layer (models/moe.py); without a cache they
        are also appended to the train step's router statistics (`moe.sow_router`).
        routes: [B, T, M, k] int, the experts each token used in each of the M MoE layers elsewhere (the
        sampler's: `moe.chosen_experts`), replayed instead of this forward's top-k (-1: a token's own).
        Vision-language inputs (vision/qwen_vl.py): embeds [B, T, D] instead of embed_tokens(tokens); positions
        [3, B, T]: M-RoPE (the first axis orders masks and cache); deepstack: [B, T, D] arrays added to the first
        layers' outputs; image_ids: [B, T] int, 0 = text, b > 0 = image block b, whose
        tokens also attend each other in both directions (Gemma 3: vision/gemma3.py, models/attention.py; with a
        cache, within this call's tokens).
        layer_stack: the layers' weights stacked once by `scan.stack(model)` for calls that scan (models/scan.py)."""
        B, T = tokens.shape
        rope_pos = positions = positions.astype(jnp.int32)
        positions = positions[0] if positions.ndim == 3 else positions  # M-RoPE [3, B, T]: the text axis
        real_pos = positions if segment_ids is None else jnp.where(segment_ids != 0, positions, -1)
        slots = jnp.arange(T, dtype=jnp.int32)
        new_branch = None if branch_ids is None else branch_ids.astype(jnp.int32)
        q_image = None if image_ids is None else image_ids.astype(jnp.int32)
        if cache is None:
            layout = Layout(real_pos, real_pos, slots, slots, segment_ids, segment_ids, new_branch, new_branch,
                            q_image=q_image, k_image=q_image, causal_aligned=True)
            k_pos = k_branch = None
        else:
            write = cache.index
            k_pos = jax.lax.dynamic_update_slice(cache.pos, real_pos, (0, write))
            k_branch = cache.branch
            if new_branch is not None:  # a cache holds one sequence per row (no segments), maybe branched
                k_branch = jnp.zeros_like(cache.pos) if k_branch is None else k_branch
                k_branch = jax.lax.dynamic_update_slice(k_branch, new_branch, (0, write))
            elif k_branch is not None:  # new tokens without ids continue the shared prefix's view
                new_branch = jnp.zeros((B, T), jnp.int32)
                k_branch = jax.lax.dynamic_update_slice(k_branch, new_branch, (0, write))
            # an image's block lies within one call (its prefill): earlier slots are text to it
            k_image = None if q_image is None else jax.lax.dynamic_update_slice(jnp.zeros_like(cache.pos), q_image,
                                                                                (0, write))
            layout = Layout(real_pos, k_pos, slots + write, jnp.arange(cache.size, dtype=jnp.int32),
                            q_branch=new_branch, k_branch=k_branch, q_image=q_image, k_image=k_image)
        if rope_tables is None:
            ropes = self._ropes(rope_pos)
        else:
            ropes = {r: rope_lookup(r[0], c, s, rope_pos) for r, (c, s) in rope_tables.items()}

        # return_attn: True (every layer) or the layers whose probabilities are wanted (distillation
        # maps a few); the others keep the blockwise attention, which never forms [T, S] probabilities.
        want = set(range(len(self.layers))) if return_attn is True else set(return_attn or ())
        x = self.embed_tokens(tokens) if embeds is None else constrain(embeds.astype(jnp.dtype(self.cfg.dtype)),
                                                                        ("batch", "seq", "embed"))
        per_layer = None if self.ple_embed is None else self.per_layer_inputs(tokens, x)
        hidden, attns, kvs, routers = [x], [], [], []
        layers = self.layers
        if (stack := scan.plan(self, cache, want, routes, layer_stack, deepstack)) is not None:  # one lax.scan
            x, kvs, hidden = scan.forward(self, stack, x, ropes, layout, cache, return_hidden,
                                            REMAT_POLICIES)
            layers = ()
        for i, blk in enumerate(layers):
            rt = None if routes is None or not blk.routed else routes[:, :, len(routers)]
            src = self.cfg.kv_source(i)
            shared = None if src is None else kvs[src]  # a KV-shared layer attends its source's keys and values
            ple = None if per_layer is None else per_layer[:, :, i]
            if cache is None or src is not None:
                kv = None
            else:
                kv = cache.linear[i] if blk.linear is not None else (cache.k[i], cache.v[i])
            if self.cfg.remat and cache is None and i not in want:  # recompute the layer in the backward pass
                x, kv, attn, router = remat_block(blk, self.cfg.remat_policy, x, ropes[blk.rope], layout, shared, ple,
                                                  rt)
            else:
                x, kv, attn, router = blk(x, ropes[blk.rope], layout, kv, None if cache is None else cache.index,
                                          i in want, shared, ple, rt)
            if deepstack is not None and i < len(deepstack):
                x = x + deepstack[i].astype(x.dtype)
            if router is not None:
                routers.append(router)
            kvs.append(kv)
            hidden.append(x)
            attns.append(attn)
        if cache is None:
            moe.sow_router(self, routers, real_pos >= 0)
        x = self.final_norm(x)
        hidden[-1] = x
        new_cache = None
        if cache is not None and stack is not None:
            new_cache = KVCache(*kvs, k_pos, cache.index + T, k_branch)
        elif cache is not None:
            n = self.cfg.cache_layers
            own = [(cache.k[i], cache.v[i]) if isinstance(kv, LinearState) else kv for i, kv in enumerate(kvs[:n])]
            linear = tuple(kv if isinstance(kv, LinearState) else None for kv in kvs[:n]) if cache.linear else ()
            new_cache = KVCache(tuple(k for k, _ in own), tuple(v for _, v in own), k_pos, cache.index + T,
                                k_branch, linear)
        return ModelOutput(
            logits=self.unembed(x) if return_logits else None,
            cache=new_cache,
            hidden=tuple(hidden) if return_hidden else None,
            attn=tuple(attns) if want else None,
            router_logits=tuple(routers) if return_router_logits else None,
        )


# Remat policies by name (`ModelConfig.remat_policy`): what a rematerialised layer keeps from its forward pass.
#   full: nothing but the layer's input; the backward pass reruns the whole layer (least memory).
#   dots: the outputs of the weight matmuls (projections, MLP; dots without batch dimensions), so the backward
#         pass recomputes only the element-wise parts and the attention (whose scores are what memory cannot keep).
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat_block(blk: Block, policy: str, x, rope, layout, shared, ple, routes):
    """`blk(x, rope, layout, ...)` under `jax.checkpoint` with the named policy, through NNX's functional API: the
    block's weights go in as arguments (LoRA's adapters and the frozen base alike) and its other state (RNG counts
    of LoRA dropout) comes back out, so no Variable is mutated from inside the checkpoint's trace."""
    graphdef, params, other = nnx.split(blk, nnx.Param, ...)

    def pure(params, other, x, rope, layout, shared, ple, routes):
        b = nnx.merge(graphdef, params, other)
        out = b(x, rope, layout, shared_kv=shared, per_layer_input=ple, routes=routes)
        return out, nnx.state(b, nnx.Not(nnx.Param))

    out, other = jax.checkpoint(pure, policy=REMAT_POLICIES[policy])(params, other, x, rope, layout, shared, ple,
                                                                      routes)
    nnx.update(blk, other)
    return out


def count_params(model_or_state) -> int:
    """Number of parameters (works on abstract `eval_shape` models too)."""
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    return int(sum(x.size for x in jax.tree.leaves(state)))


def with_compute_dtype(model: nnx.Module, dtype: str) -> nnx.Module:
    """A module over the same arrays as `model` (no copy) whose activations and KV cache are in `dtype`: its
    config's `dtype` and every layer's compute dtype replaced (a bfloat16 sampler over float32 weights casts
    them itself; see `generate.Sampler(dtype=...)`)."""
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)
    dt = jnp.dtype(dtype)
    for _, m in nnx.iter_modules(view):
        if isinstance(getattr(m, "cfg", None), ModelConfig):
            m.cfg = m.cfg.replace(dtype=dt.name)
        if isinstance(getattr(m, "dtype", None), jnp.dtype):
            m.dtype = dt
    return view
