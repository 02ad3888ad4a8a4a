"""Logical axis names for parameters and activations, and the one place that maps them to a mesh.

Model code never names mesh axes: it tags every parameter with logical names (`batch, seq, embed,
heads, kv_heads, head_dim, mlp, vocab`) through `param()`, and key activations through
`constrain()`. Only this module knows the mesh axes (`data, fsdp, tensor`) and the rules that map
logical names onto them. Without an active mesh (`use_mesh`), `constrain` is the identity, so the
same model runs unchanged on one device.

What it is not (yet): mesh presets, multi-host initialisation and memory planning arrive with the
[scale] issue; the rules table below is their starting point.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")

# logical name -> mesh axis (or tuple of axes); names absent here are replicated.
DEFAULT_RULES: dict[str, object] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
}

_ACTIVE: list[tuple[Mesh, dict]] = []


def param(value: jax.Array, names: Sequence[Optional[str]]) -> nnx.Param:
    """A parameter tagged with one logical axis name (or None) per dimension."""
    names = tuple(names)
    assert len(names) == value.ndim, (names, value.shape)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def logical_to_spec(names: Sequence[Optional[str]], rules: Optional[dict] = None) -> PartitionSpec:
    """PartitionSpec for logical names under `rules`; a mesh axis is used at most once."""
    rules = DEFAULT_RULES if rules is None else rules
    used: set = set()
    out = []
    for n in names:
        axis = rules.get(n) if n is not None else None
        axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Optional[dict] = None):
    """Make `mesh` (with logical `rules`) active for `constrain` inside this block."""
    _ACTIVE.append((mesh, DEFAULT_RULES if rules is None else rules))
    try:
        yield mesh
    finally:
        _ACTIVE.pop()


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """Sharding constraint by logical names under the active mesh; identity without one."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))


def state_shardings(abstract_state, mesh: Mesh, rules: Optional[dict] = None):
    """NamedSharding for every parameter of an (abstract) NNX state, from its logical names."""

    def one(v):
        names = v.get_metadata().get("out_sharding")
        spec = logical_to_spec(names, rules) if names else PartitionSpec()
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, abstract_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
