"""Layers scanned: the Transformer's identical decoder layers run as ONE `jax.lax.scan` over their stacked weights.

What it is for: compile time. A Python loop over L layers hands XLA L copies of the layer to trace, lower and
compile (llama3-1b on a TPU v5e: 37-57 s before the first train step, 45-51 s before the first sample, #51/#56);
a scan hands it one (MaxText's and Tunix's `scan_layers`). What it is not: a second model. The layer function is
the Block itself, rebuilt from its stacked state with NNX's functional API (`nnx.merge` of one slice, as
`transformer.remat_block` does), so the numbers are the unscanned forward's.

When (`ModelConfig.scan_layers`): True = scan wherever the layers allow it, False (the default, on every backend)
= never (docs/tpu.md has the TPU measurements: a shorter compile, a slower decode step). The layers allow it
when the config makes them identical (`uniform`: one attention kind, one RoPE and window, no Gated DeltaNet layers,
no experts, no KV-shared layers, no per-layer inputs) and the built blocks are too (`stackable`: the same NNX
graph, e.g. LoRA on every layer or on none, and no state but weights: LoRA dropout's shared RNG counts turn it
off). A call that asks for a layer's attention probabilities (`return_attn`) or replays expert routes runs the
loop.

Where the stacking happens (the cost of the copy): the forward stacks the layers' weights (`jnp.stack`, one copy
of them per call; gradients flow back through it to each layer's own weights), unless the caller passes a stack it
made once (`layer_stack=stack(model)`: the sampler's decode loop, so no decode step copies the model). A cache
made for scanning (`KVCache.init(..., stacked=True)`) holds the keys and values as [L, B, K, S, H] and is the
scan's carry, written in place (`layers.stacked_cache_write`); a per-layer cache is stacked on the way in and split
on the way out.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models import kv_store
from posttrain.models.config import ModelConfig
from posttrain.models.layers import Buffer


class LayerStack(NamedTuple):
    """The layers' state as one [L, ...] array a leaf, and how to rebuild one layer from a slice of it."""

    graphdef: object  # nnx.GraphDef of one Block (the same for every layer)
    treedef: object  # the pytree structure of one layer's state (its Variables and their metadata)
    leaves: list  # [L, ...] arrays


def uniform(cfg: ModelConfig) -> bool:
    """Whether the config makes every decoder layer the same function of its own weights."""
    kinds = {cfg.layer_type(i) for i in range(cfg.num_layers)}
    return (cfg.num_layers > 1 and len(kinds) == 1 and "linear" not in kinds and cfg.num_experts == 0
            and cfg.kv_shared_layers == 0 and cfg.per_layer_dim == 0)


def enabled(cfg: ModelConfig) -> bool:
    """The config's choice (`scan_layers`; off by default until the scan is measured on a TPU) and `uniform`."""
    return bool(cfg.scan_layers) and uniform(cfg)


def _split(blk):
    graphdef, state, other = nnx.split(blk, nnx.Any(nnx.Param, Buffer), ...)
    leaves, treedef = jax.tree.flatten(state)
    return graphdef, treedef, leaves, other


def stackable(layers) -> bool:
    """Whether the built layers are one NNX graph with weights (Params, Buffers) only."""
    first = None
    for blk in layers:
        graphdef, treedef, _, other = _split(blk)
        if jax.tree.leaves(other) or (first is not None and (graphdef, treedef) != first):
            return False
        first = (graphdef, treedef)
    return first is not None


def applies(model) -> bool:
    """Whether `model`'s forward scans its layers (calls that need the loop aside: see the module docstring). A model
    with a vision tower inside (Qwen3-VL: DeepStack adds features to the first layers' outputs) keeps the loop."""
    return enabled(model.cfg) and model.cfg.vision is None and stackable(model.layers)


def stack(model) -> LayerStack:
    """The model's layers stacked (one copy of their weights): pass it as `layer_stack=` to calls that reuse it."""
    parts = [_split(blk) for blk in model.layers]
    leaves = [jnp.stack(xs) for xs in zip(*(p[2] for p in parts))]
    return LayerStack(parts[0][0], parts[0][1], leaves)


def run(layers: LayerStack, x, rope, layout, kv=None, write_index=None, *, remat=None, hidden: bool = False):
    """x [B, T, D] through every layer: one scan. kv: (k, v) each [L, B, K, S, H], or None without a cache.
    remat: recompute each layer in the backward pass under this `jax.checkpoint` policy, or None.

    The caches are the scan's carry: layer i writes its new keys and values into them in place and attends its
    slice (`layers.stacked_cache_write`); as the scan's inputs and outputs they would be copied whole every call.
    Returns (x, the updated (k, v) [L, ...] or None, each layer's output [L, B, T, D] when `hidden`, else None)."""

    def layer(carry, xs):
        x, kv = carry
        leaves, i = xs
        blk = nnx.merge(layers.graphdef, jax.tree.unflatten(layers.treedef, leaves))
        y, new_kv, _, _ = blk(x, rope, layout, None if kv is None else (*kv, i), write_index)
        return (y, None if kv is None else new_kv), y if hidden else None

    if remat is not None:
        layer = jax.checkpoint(layer, policy=remat, prevent_cse=False)
    n = layers.leaves[0].shape[0]
    (x, kv), ys = jax.lax.scan(layer, (x, kv), (layers.leaves, jnp.arange(n, dtype=jnp.int32)))
    return x, kv, ys


def plan(model, cache, want, routes, layer_stack, deepstack=None) -> Optional[LayerStack]:
    """The stacked layers when this forward call scans them, else None (the loop). want: the layers whose
    attention probabilities the call returns; routes: expert routes to replay; deepstack: Qwen3-VL's features
    added to the first layers' outputs (the loop adds them)."""
    if want or routes is not None or deepstack is not None or (layer_stack is None and not applies(model)):
        if cache is not None and not isinstance(cache.k, tuple):
            raise ValueError("a stacked KV cache (KVCache.init(stacked=True)) needs the scanned layers; this call "
                             "runs them one by one (return_attn, routes, deepstack, or a model whose layers differ)")
        return None
    return stack(model) if layer_stack is None else layer_stack


def forward(model, stacked: LayerStack, x, ropes, layout, cache, return_hidden, policies):
    """The Transformer's layers as one scan (`Transformer.forward` calls this): (x, (k, v) in the cache's own
    form or None, hidden states: [x, each layer's output] with `return_hidden`, else [x]). policies: the remat
    policies by name (transformer.REMAT_POLICIES)."""
    kv, write = None, None
    if cache is not None:  # a per-layer cache is stacked for the scan and split after it
        kv, write = (cache.k, cache.v), cache.index
        if isinstance(cache.k, tuple):
            kv = (kv_store.stack(cache.k), kv_store.stack(cache.v))
    cfg = model.cfg
    remat = policies[cfg.remat_policy] if cfg.remat and cache is None else None
    y, kv, ys = run(stacked, x, ropes[model.layers[0].rope], layout, kv, write, remat=remat, hidden=return_hidden)
    if cache is not None and isinstance(cache.k, tuple):
        kv = (kv_store.unstack(kv[0]), kv_store.unstack(kv[1]))
    return y, kv, [x, *ys] if return_hidden else [x]
