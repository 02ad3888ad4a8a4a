"""Logical axis names, mesh presets, and the one place that maps logical names onto a device mesh.

Model code never names mesh axes: it tags every parameter with logical names (`batch, seq, embed,
heads, kv_heads, head_dim, mlp, vocab, expert`) through `param()`, and key activations through
`constrain()`. Only this module knows the mesh axes (`data, fsdp, tensor`) and the rules that map
logical names onto them. Without an active mesh (`use_mesh`), `constrain` is the identity, so the
same model runs unchanged on one device.

Presets (`PRESETS`, `make_mesh`): a mesh always has the three axes `data, fsdp, tensor` (unused
ones have size 1), and every preset shards the batch over `data` and `fsdp`:
  dp       parameters replicated; batch over `data`.
  fsdp     parameters' `embed` axis over `fsdp` (ZeRO-3 style: gathered per use); batch over `fsdp`.
  tp       Megatron-style: `heads`/`kv_heads`/`mlp`/`vocab` over `tensor`; batch replicated.
  fsdp_tp  both (e.g. 8 devices = fsdp 4 x tensor 2).
Mixture-of-experts weights [E, ...] (models/moe.py) put their `expert` axis on `fsdp` in the fsdp
presets (expert parallelism inside the data-parallel group: each device holds E / fsdp experts
whole instead of a slice of every expert); their tokens are exchanged by XLA's partitioner.
A dimension that a mesh axis does not divide is left unsharded on that axis (replication is always
correct; uneven shards are not worth their padding on tiny dimensions such as 2 kv heads on 8
devices). Under the fsdp presets, a large parameter with no `embed` axis (the `FALLBACK` rule) is
sharded on its largest divisible dimension instead, so nothing big stays replicated.

Placing state: `create_sharded` builds a model directly sharded (`nnx.eval_shape`, then one
`jax.jit` with `out_shardings`, so a big model never lands whole on one device); `shard_state`
places any NNX State / TrainState pytree, the optimizer state following its parameters;
`shard_batch` places a batch (each process passes its own rows in multi-process runs).
`init_distributed` starts `jax.distributed` from the environment (one process per host).

What it is not: pipeline parallelism, or a hand-written all-to-all token exchange for experts (the
grouped products are partitioned by XLA); a memory planner (see `plan.py`).
References: the JAX "Distributed arrays and automatic parallelization" and "Multi-process" guides;
Flax NNX sharding guide (logical axis annotations).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from posttrain.errors import PosttrainError

MESH_AXES = ("data", "fsdp", "tensor")

# Rules key: a parameter left without this mesh axis by its names shards its largest divisible
# dimension on it, when it has at least FALLBACK_MIN_ELEMENTS elements (fsdp presets only).
FALLBACK = "*"
FALLBACK_MIN_ELEMENTS = 1 << 18

_BATCH = ("data", "fsdp")
_TENSOR = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}

# preset -> rules: logical name -> mesh axis (or tuple of axes); names absent here are replicated.
PRESETS: dict[str, dict] = {
    "dp": {"batch": _BATCH},
    "fsdp": {"batch": _BATCH, "expert": "fsdp", "embed": "fsdp", FALLBACK: "fsdp"},
    "tp": {"batch": _BATCH, **_TENSOR},
    "fsdp_tp": {"batch": _BATCH, "expert": "fsdp", "embed": "fsdp", FALLBACK: "fsdp", **_TENSOR},
}
DEFAULT_RULES: dict[str, object] = PRESETS["fsdp_tp"]

# The active (mesh, rules) stack, one per thread: an off-policy sampler traces in its own thread, on its own
# devices, while the trainer's thread has the training mesh active (rl/offpolicy.py).
_LOCAL = threading.local()


def _active() -> list[tuple[Mesh, dict]]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


# ------------------------------------------------------------------------------------------ rules


def preset_rules(preset: str) -> dict:
    """The logical-axis rules of a preset (`dp`, `fsdp`, `tp`, `fsdp_tp`)."""
    if preset not in PRESETS:
        raise PosttrainError(f"unknown sharding preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[preset]


def _axes(rule) -> tuple:
    return (rule,) if isinstance(rule, str) else tuple(rule or ())


def logical_to_spec(names: Sequence[Optional[str]], rules: Optional[dict] = None, *,
                    shape: Optional[Sequence[int]] = None,
                    axis_sizes: Optional[Mapping[str, int]] = None) -> PartitionSpec:
    """PartitionSpec for logical names under `rules`; a mesh axis is used at most once.

    With `shape` and `axis_sizes` (mesh axis -> size; `mesh.shape`), mesh axes the mesh lacks are
    dropped, and so is an axis whose size does not divide the dimension (it stays replicated).
    """
    rules = DEFAULT_RULES if rules is None else rules
    used: set = set()
    out = []
    for i, n in enumerate(names):
        axes = _axes(rules.get(n)) if n is not None else ()
        kept, prod = [], 1
        for a in axes:
            if a in used:
                continue
            if axis_sizes is not None:
                if a not in axis_sizes:
                    continue
                if shape is not None and shape[i] % (prod * axis_sizes[a]):
                    continue
                prod *= axis_sizes[a]
            kept.append(a)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def param_spec(names: Optional[Sequence[Optional[str]]], shape: Sequence[int], rules: Optional[dict],
               axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """The spec of one parameter: its logical names under `rules`, plus the FALLBACK rule."""
    rules = DEFAULT_RULES if rules is None else rules
    shape = tuple(shape)
    names = tuple(names) if names else (None,) * len(shape)
    spec = list(logical_to_spec(names, rules, shape=shape, axis_sizes=axis_sizes))
    spec += [None] * (len(shape) - len(spec))
    fb = rules.get(FALLBACK)
    n = axis_sizes.get(fb, 1) if fb else 1
    used = {a for s in spec for a in _axes(s)}
    if n > 1 and fb not in used and math.prod(shape) >= FALLBACK_MIN_ELEMENTS:
        free = [i for i, s in enumerate(spec) if s is None and shape[i] % n == 0]
        if free:
            spec[max(free, key=lambda i: shape[i])] = fb
    return PartitionSpec(*spec)


def spec_axis_product(spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> int:
    """How many ways a tensor with this spec is split (product of the mesh axes it uses)."""
    return math.prod(axis_sizes[a] for s in spec for a in _axes(s))


# ------------------------------------------------------------------------------------------ mesh


def default_mesh_shape(preset: str, n: int) -> dict:
    if preset == "dp":
        return {"data": n}
    if preset == "fsdp":
        return {"fsdp": n}
    if preset == "tp":
        return {"tensor": n}
    # fsdp_tp: tensor = the largest power of two t with t * t <= n (at most 8: one host's GPUs).
    t = 1
    while t * 2 <= 8 and (t * 2) ** 2 <= n and n % (t * 2) == 0:
        t *= 2
    return {"fsdp": n // t, "tensor": t}


def mesh_dims(preset: str, n: int, shape: Union[Mapping[str, int], Sequence[int], None] = None) -> tuple:
    """(data, fsdp, tensor) sizes of `preset`'s mesh over n devices; `shape` as in `make_mesh`."""
    preset_rules(preset)
    if shape is None:
        sizes = default_mesh_shape(preset, n)
    elif isinstance(shape, Mapping):
        bad = set(shape) - set(MESH_AXES)
        if bad:
            raise PosttrainError(f"mesh shape names unknown axes {sorted(bad)}; the axes are {MESH_AXES}")
        sizes = dict(shape)
    else:
        if len(shape) != 3:
            raise PosttrainError(f"mesh shape {tuple(shape)} must give 3 sizes: {MESH_AXES}")
        sizes = dict(zip(MESH_AXES, shape))
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise PosttrainError(f"mesh shape {sizes}: at most one axis may be -1")
    if free:
        rest = math.prod(s for a, s in sizes.items() if s != -1)
        sizes[free[0]] = n // rest if rest and n % rest == 0 else 0
    dims = tuple(int(sizes.get(a, 1)) for a in MESH_AXES)
    if any(d <= 0 for d in dims) or math.prod(dims) != n:
        raise PosttrainError(f"mesh shape {dict(zip(MESH_AXES, dims))} needs {math.prod(dims)} devices but "
                             f"{n} are given; make the axis sizes multiply to {n}")
    return dims


def make_mesh(preset: str = "fsdp", devices: Optional[Sequence] = None,
              shape: Union[Mapping[str, int], Sequence[int], None] = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor) for `preset` over `devices` (default: all devices).

    `shape`: explicit axis sizes, as {"fsdp": 4, "tensor": 2} (missing axes are 1; one axis may be
    -1 = the remaining devices) or a (data, fsdp, tensor) tuple. Default: all devices on the
    preset's axis; fsdp_tp splits n devices into fsdp n/t x tensor t (8 -> 4 x 2).
    """
    devices = list(jax.devices() if devices is None else devices)
    dims = mesh_dims(preset, len(devices), shape)
    return jax.make_mesh(dims, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


@contextlib.contextmanager
def use_mesh(mesh: Optional[Mesh], rules: Optional[dict] = None):
    """Make `mesh` (with logical `rules`) active for `constrain` inside this block; None = no mesh.

    Constraints apply when a function is traced: call (first) jitted functions inside the block.
    """
    if mesh is None:
        yield None
        return
    stack = _active()
    stack.append((mesh, DEFAULT_RULES if rules is None else rules))
    try:
        yield mesh
    finally:
        stack.pop()


def active_mesh():
    """(mesh, rules) of the innermost `use_mesh` block, or None outside one."""
    stack = _active()
    return stack[-1] if stack else None


# ------------------------------------------------------------------------------------------ model code


def param(value: jax.Array, names: Sequence[Optional[str]]) -> nnx.Param:
    """A parameter tagged with one logical axis name (or None) per dimension."""
    names = tuple(names)
    assert len(names) == value.ndim, (names, value.shape)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """Sharding constraint by logical names under the active mesh; identity without one."""
    stack = _active()
    if not stack:
        return x
    mesh, rules = stack[-1]
    spec = logical_to_spec(names, rules, shape=x.shape, axis_sizes=mesh.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ------------------------------------------------------------------------------------------ state


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _shape(x) -> tuple:
    leaves = jax.tree.leaves(x)
    return tuple(np.shape(leaves[0])) if len(leaves) == 1 else ()


def _names(v) -> Optional[tuple]:
    if not _is_var(v):
        return None
    names = v.get_metadata().get("out_sharding")
    return tuple(names) if names else None


def state_shardings(abstract_state, mesh: Mesh, rules: Optional[dict] = None):
    """NamedSharding for every variable of an (abstract) NNX state, from its logical names."""

    def one(v):
        shape = _shape(v)
        return NamedSharding(mesh, param_spec(_names(v), shape, rules, mesh.shape) if shape else PartitionSpec())

    return jax.tree.map(one, abstract_state, is_leaf=_is_var)


def tree_shardings(tree, mesh: Mesh, rules: Optional[dict] = None):
    """A NamedSharding for every variable / array of any pytree (NNX State, TrainState, optax state).

    Parameters get `param_spec` of their logical names, exactly as `state_shardings` gives them
    (an untagged parameter, e.g. a LoRA adapter, gets the FALLBACK rule). Any other leaf (plain
    array: e.g. an optimizer moment) takes the sharding of the parameter sharing the longest tail
    of its tree path and its shape (so Adam's mu / nu follow their parameter); everything else
    (step counters, RNG keys, scalars) is replicated. The result is a pytree
    prefix of `tree` (one sharding per variable), usable as jit `out_shardings`.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)
    index: dict = {}  # path tail -> (shape, spec)
    specs: list = [None] * len(flat)
    for i, (path, leaf) in enumerate(flat):
        names = _names(leaf)
        if names or isinstance(leaf, nnx.Param):
            shape = _shape(leaf)
            spec = param_spec(names, shape, rules, mesh.shape)
            specs[i] = spec
            for k in range(len(path)):
                index.setdefault(path[k:], []).append((shape, spec))
    for i, (path, leaf) in enumerate(flat):
        if specs[i] is not None:
            continue
        shape, spec = _shape(leaf), PartitionSpec()
        if shape:
            for k in range(len(path)):
                hits = [s for sh, s in index.get(path[k:], ()) if sh == shape]
                if hits:
                    spec = hits[0]
                    break
        specs[i] = spec
    return jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, s) for s in specs])


def to_host(x) -> np.ndarray:
    """The whole value of `x` as numpy; an array spanning processes is gathered (a collective),
    except a replicated one (e.g. a metric), which every process already holds whole."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def put(x, sharding: NamedSharding):
    """device_put that also works in multi-process runs for arrays every process holds whole."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # global already: reshard
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = put(jax.random.key_data(x), NamedSharding(sharding.mesh, PartitionSpec()))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_state(state, mesh: Mesh, rules: Optional[dict] = None):
    """`state` (any pytree of NNX variables / arrays) placed with `tree_shardings`."""
    shardings = tree_shardings(state, mesh, rules)
    return jax.tree.map(lambda s, v: jax.tree.map(lambda a: put(a, s), v), shardings, state)


def sharded_shapes(state, mesh: Mesh, rules: Optional[dict] = None):
    """ShapeDtypeStructs carrying the sharding each leaf would get on `mesh` (an Orbax restore target)."""
    shardings = tree_shardings(state, mesh, rules)
    return jax.tree.map(lambda s, v: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), v),
                        shardings, state)


def create_sharded(model_fn: Callable[[], nnx.Module], mesh: Mesh, rules: Optional[dict] = None) -> nnx.Module:
    """`model_fn()` built directly sharded: shapes from `nnx.eval_shape`, values from one jit whose
    `out_shardings` place each parameter (every device computes only its own shard)."""
    abstract = nnx.eval_shape(model_fn)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.split(model_fn())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


# ------------------------------------------------------------------------------------------ batches


def batch_sharding(mesh: Mesh, rules: Optional[dict] = None) -> NamedSharding:
    """Sharding of a [B, ...] batch: rows over the rules' `batch` axes (data and fsdp)."""
    rules = DEFAULT_RULES if rules is None else rules
    axes = tuple(a for a in _axes(rules.get("batch")) if a in mesh.shape)
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))


def shard_batch(batch, mesh: Mesh, rules: Optional[dict] = None, *, process_local: Optional[bool] = None):
    """Place a pytree of [B, ...] arrays with `batch_sharding`.

    process_local (default: more than one process): each process passes only its own rows and
    the global batch is their concatenation in process order (`make_array_from_process_local_data`).
    """
    s = batch_sharding(mesh, rules)
    n = spec_axis_product(s.spec, mesh.shape)
    local = jax.process_count() > 1 if process_local is None else process_local

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        rows = x.shape[0] * (jax.process_count() if local else 1)
        if rows % n:
            raise PosttrainError(f"batch of {rows} rows cannot be split over {n} devices (mesh {dict(mesh.shape)}); "
                                 f"make the global batch size a multiple of {n}")
        if local:
            return jax.make_array_from_process_local_data(s, np.asarray(x))
        return jax.device_put(x, s)

    return jax.tree.map(one, batch)


# ------------------------------------------------------------------------------------------ multi-process


def init_distributed(*, auto: bool = False, **kwargs) -> bool:
    """Start `jax.distributed` from the environment; returns whether it is (now) initialised.

    Reads JAX_COORDINATOR_ADDRESS ("host:port" of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID
    (and JAX's own JAX_LOCAL_DEVICE_IDS), or detects a Slurm job with several tasks (SLURM_JOB_ID,
    SLURM_NTASKS > 1; JAX reads the rest). With none of them set it does nothing, unless `auto`
    (the CLI's --distributed), which lets JAX auto-detect the cluster (TPU pods, Open MPI).
    Call it first thing: before any JAX computation or `jax.devices()`.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    given = [k for k in keys if env.get(k)]
    if given:
        missing = [k for k in keys if k not in given]
        if missing:
            raise PosttrainError(f"multi-process run: {', '.join(given)} set but {', '.join(missing)} missing; "
                                 "set all three (every process: the same address and count, its own id)")
        try:
            kwargs.setdefault("num_processes", int(env["JAX_NUM_PROCESSES"]))
            kwargs.setdefault("process_id", int(env["JAX_PROCESS_ID"]))
        except ValueError:
            raise PosttrainError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers") from None
        kwargs.setdefault("coordinator_address", env["JAX_COORDINATOR_ADDRESS"])
        host = kwargs["coordinator_address"].rpartition(":")[0].strip("[]")
        if host in ("127.0.0.1", "localhost", "::1") and not env.get("JAX_COORDINATOR_BIND_ADDRESS"):
            # one machine: process 0's coordinator listens on loopback only (JAX's default is every interface)
            kwargs.setdefault("coordinator_bind_address", kwargs["coordinator_address"])
    elif env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        kwargs.setdefault("cluster_detection_method", "slurm")
    elif not (auto or kwargs):
        return False
    # CPU processes need a cross-process collective implementation (harmless on GPU/TPU).
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True


def is_main_process() -> bool:
    """True on process 0: the one that logs, writes reports and prints."""
    return jax.process_index() == 0
