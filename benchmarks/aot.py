"""Shared by the benchmarks that compile for a TPU ahead of time (compile_time.py --target, plan_tpu.py) and by
tpu.py: a topology's device, abstract arguments placed on it, XLA's memory account of a compiled program.

Compiling for a TPU without one needs libtpu importable (docs/tpu.md, "Compiling for a TPU without one")."""

import jax
import numpy as np


def tpu_device(target: str):
    """The first device of a TPU topology, e.g. "v5e:1x1": programs compile for it, nothing runs on it."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=target, platform="tpu",
                                        chips_per_host_bounds=(1, 1, 1)).devices[0]


def placed(tree, device):
    """Every leaf (array or ShapeDtypeStruct) as a ShapeDtypeStruct on `device`; None leaves stay None."""
    where = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=where), tree)


def memory(compiled) -> dict:
    """XLA's account of a compiled program: argument, output, alias and temp bytes, and the peak it needs on the
    device (argument + output - alias + temp); {"error": ...} on a backend without the analysis."""
    try:
        ma = compiled.memory_analysis()
        out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    except Exception as e:
        return {"error": repr(e)[:200]}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out
