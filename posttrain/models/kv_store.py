"""How a KV cache stores keys and values when its storage dtype is not the compute dtype (`KVCache.init(kv_dtype=)`,
`Sampler(kv_dtype=)`): storage only. A write converts (`store`); attention reads the cache converted back to the
compute dtype (`load`), right where it reads it, so the cache's memory holds the narrow form.

  - a float dtype: a cast; float8 (e4m3fn, e5m2) saturates at the format's largest finite value first, as vLLM's
    fp8 cache does (XLA's convert makes NaN of what overflows float8_e4m3fn, which has no inf);
  - int8: `QuantKV`, int8 values and a float32 scale per (row, cache row, slot): each slot of a cache row (a head,
    or the P heads a TPU row packs side by side: attention.pack_heads) is rounded to amax / 127 steps;
    read back as value * scale.
What it is not: quantized weights or a quantized attention product (the product runs in the compute dtype).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantKV:
    """An int8 cache of one layer (or stacked layers): data [.., B, K', S, W] int8, scale [.., B, K', S] float32."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def empty(shape, dtype):
    """A zero cache array of `shape` ([.., B, K', S, W]) stored as `dtype` (int8: a QuantKV)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return QuantKV(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def store(x, dtype):
    """x cast to a float storage dtype; a float8 one saturates first (see the module docstring)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating) and x.dtype != dtype:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def quantize(x):
    """x [.., W] -> (int8 [.., W], float32 scale [..]): round(x / s) with s = max|x| * float32(1 / 127) (0 for an
    all-zero x; a product, as XLA computes a division by a constant anyway)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) * jnp.float32(1 / 127)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def load(x, dtype):
    """An int8 cache read in the compute dtype (values times their scale); any other array as it is (attention casts
    it where it reads it: models/attention.py)."""
    if isinstance(x, QuantKV):
        return x.data.astype(dtype) * x.scale[..., None].astype(dtype)
    return x


def stack(xs):
    """Per-layer cache arrays (QuantKV or not) as one [L, ...] array; `unstack` is the inverse."""
    return jax.tree.map(lambda *a: jnp.stack(a), *xs)


def unstack(x):
    return tuple(jax.tree.map(lambda a, i=i: a[i], x) for i in range(x.shape[0]))


def write(cache, x, index):
    """x (already the cache's row layout, [.., B, K', T, W]) written at `index` (one start per axis) of `cache`."""
    if isinstance(cache, QuantKV):
        q, s = quantize(x)
        return QuantKV(jax.lax.dynamic_update_slice(cache.data, q, index),
                       jax.lax.dynamic_update_slice(cache.scale, s, index[:-1]))
    return jax.lax.dynamic_update_slice(cache, store(x, cache.dtype), index)
