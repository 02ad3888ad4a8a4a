"""LoRA: low-rank adapters on chosen projections; adapter-only training state; merge for export.

What it is: `apply_lora(model, rank=..., alpha=..., dropout=..., targets=(...))` attaches a
`Lora` adapter beside each projection whose name matches a target pattern (`qkv`, `o`,
`gate_up`, `down`, and on Gated DeltaNet layers `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
`out_proj`: a name matches that projection only; anything else is a regex searched in the dotted path, e.g.
`layers\\.0\\.attn\\.qkv`). The
projection then computes x W + (alpha / rank) * dropout(x) A B (Hu et al., 2021), with B = 0
at start so the adapted model equals the base. Adapter weights are `LoraParam`s, a Param
subtype: the trainer trains `LoraParam` only and the base stays frozen; `merge_lora(model)`
folds W + scale * A B into the base weights and removes the adapters (for export);
`adapters_off(model)` is the base model without a copy (the DPO reference under LoRA).

What it is not: QLoRA (no quantised base) or DoRA.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.errors import PosttrainError
from posttrain.models.transformer import count_params

# attention and MLP, then the Gated DeltaNet layers' (Qwen3.5: models/deltanet.py)
PROJECTIONS = ("qkv", "o", "gate_up", "down", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


class LoraParam(nnx.Param):
    """A trainable adapter weight (the base parameters are plain Params)."""


class Lora(nnx.Module):
    """Adapter for a projection whose weight has shape in_shape + out_shape."""

    def __init__(self, in_shape, out_shape, *, rank: int, alpha: float, dropout: float, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        d_in, d_out = math.prod(in_shape), math.prod(out_shape)
        # A ~ Kaiming-uniform as in PEFT; B = 0 so training starts from the base model.
        bound = 1.0 / math.sqrt(d_in)
        self.a = LoraParam(jax.random.uniform(rngs.params(), (d_in, rank), param_dtype, -bound, bound))
        self.b = LoraParam(jnp.zeros((rank, d_out), param_dtype))
        self.scale = alpha / rank
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None

    def __call__(self, x):
        """x [..., *in_shape] -> [..., *out_shape] low-rank update."""
        lead = x.shape[: x.ndim - len(self.in_shape)]
        h = x.reshape(lead + (-1,))
        if self.dropout is not None:
            h = self.dropout(h)
        h = (h @ self.a[...].astype(x.dtype)) @ self.b[...].astype(x.dtype)
        return (h * self.scale).reshape(lead + self.out_shape)

    def delta(self):
        """scale * A B shaped like the base weight."""
        return (self.a[...] @ self.b[...] * self.scale).reshape(self.in_shape + self.out_shape)


def _projection_owners(model):
    """(dotted path, owner module, attribute name) of every projection weight."""
    for path, mod in nnx.iter_graph(model):
        if not isinstance(mod, nnx.Module):
            continue
        for name in PROJECTIONS:
            w = getattr(mod, name, None)
            if isinstance(w, nnx.Param) and not isinstance(w, LoraParam):
                yield ".".join(map(str, path + (name,))), mod, name


def _in_axes(name: str) -> int:
    return 3 if name == "o" else 1  # o contracts (K, G, H); the others contract one axis


def apply_lora(model, *, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: Sequence[str] = PROJECTIONS, seed: int = 0):
    """Attach adapters in place to projections matching any pattern in `targets`; returns model."""
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    # a projection's own name matches that projection only ('o' is not a pattern found in 'down' or
    # 'out_proj'); anything else is a regex searched in the dotted path
    pats = [re.compile(rf"(^|\.){t}$" if t in PROJECTIONS else t) for t in targets]
    hits = 0
    for path, mod, name in list(_projection_owners(model)):
        if not any(p.search(path) for p in pats):
            continue
        w = getattr(mod, name)
        k = _in_axes(name)
        setattr(mod, name + "_lora", Lora(w.shape[:k], w.shape[k:], rank=rank, alpha=alpha, dropout=dropout,
                                          rngs=rngs, param_dtype=w[...].dtype))
        hits += 1
    if hits == 0:
        raise PosttrainError(f"lora.targets {list(targets)} matched no projection; projections are named "
                             f"{', '.join(PROJECTIONS)} (e.g. 'qkv', 'layers\\.0\\.attn\\.o')")
    return model


def merge_lora(model):
    """Fold every adapter into its base weight and remove it (in place); returns model."""
    for _, mod, name in list(_projection_owners(model)):
        lo = getattr(mod, name + "_lora", None)
        if lo is None:
            continue
        w = getattr(mod, name)
        w[...] = (w[...] + lo.delta().astype(w[...].dtype))
        setattr(mod, name + "_lora", nnx.data(None))
    return model


def adapters_off(model):
    """The same model with every adapter zeroed: the base model (a DPO reference under LoRA), sharing
    the base weights (no copy); only the small adapter tensors are new (zeros)."""
    graphdef, lora, rest = nnx.split(model, LoraParam, ...)
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, lora), rest)


def trainable_fraction(model) -> float:
    return count_params(nnx.state(model, LoraParam)) / count_params(model)
