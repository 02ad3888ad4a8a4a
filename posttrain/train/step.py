"""Train state and the one jitted train step built from a loss function.

`make_train_step(loss_fn, optimizer, graphdef)` returns `step(state, batch) -> (state, metrics)`:
one `jax.jit` with the state donated, no host sync and no Python branching on data. The model is
split once into (graphdef, trainable params, rest): `rest` holds frozen weights (the LoRA base)
and RNG counters; the optimizer touches only the trainable params.

Gradient accumulation: with `micro_batches = M` the batch [B, ...] is viewed as [M, B/M, ...]
and a `lax.scan` sums each micro-batch's loss total and gradient; both are divided by the summed
denominator at the end (losses return sums; see `posttrain.losses`), so M micro-batches give the
full-batch gradient exactly (token-weighted), whatever the padding in each micro-batch.

Mixture-of-experts models: the router losses of `models/moe.py` (load balancing x the model's
`router_aux_loss_coef`, z-loss x `router_z_loss_coef`) are added to every loss here, once per
unit of `denom` (so the step's mean gets coef x aux), with `router_aux_loss`, `router_z_loss` and
`expert_load_<e>` in the metrics; a dense model's step is unchanged.

Schedule numbers: an `optim.Optimizer` (what `make_optimizer` builds from a `Schedule`) and a `Schedule` as
`schedule` pass their numbers (peak / floor LR, warm-up and decay steps) as arguments of the jitted step, which
builds the optax chain from them inside its trace: runs that differ only in their length or LR share one
compiled program (JAX's persistent cache). A plain optax optimizer or schedule is closed over as a constant.

Non-finite guard: when the loss or the gradient norm is NaN/Inf the step keeps the previous
parameters and optimizer state (the update is skipped), reports `skipped = 1`, and counts
consecutive such steps in `state.nonfinite`; the loop halts the run after too many in a row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.models import moe
from posttrain.sharding import active_mesh, tree_shardings, use_mesh
from posttrain.train.optim import Optimizer, Schedule


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: updates applied so far
    params: nnx.State  # trainable parameters
    rest: nnx.State  # everything else of the model (frozen weights, RNG counters)
    opt_state: optax.OptState
    rng: jax.Array  # PRNG key for dropout / sampling inside the loss
    nonfinite: jax.Array  # int32: consecutive steps whose loss or gradient was NaN/Inf (update skipped)


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation, *, trainable=nnx.Param,
               seed: int = 0):
    """(graphdef, TrainState) for `model`; `trainable` is an NNX filter (nnx.Param, LoraParam, ...)."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                       opt_state=optimizer.init(params), rng=jax.random.key(seed),
                       nonfinite=jnp.zeros((), jnp.int32))
    return graphdef, state


def merge(graphdef, state: TrainState) -> nnx.Module:
    """The model with the state's current weights."""
    return nnx.merge(graphdef, state.params, state.rest)


def merged_state(state: TrainState) -> nnx.State:
    """`nnx.state(merge(graphdef, state))` without building the module: the same leaves (what a Sampler's `update`
    takes), ~20x less host time; every RL rollout (GRPO, online DPO, on-policy distillation, agentic) calls it once."""
    return nnx.merge_state(state.params, state.rest)


class TrainStep:
    """The jitted step with its schedule numbers bound: `step(state, batch, frozen=None)`. `lower` / `trace` take
    the same arguments and give JAX's stages, whose `lower()` / `compile()` keep the numbers bound (a compiled step
    is called as `compiled(state, batch, frozen)`)."""

    def __init__(self, stage, numbers):
        self.stage, self.numbers = stage, numbers

    def __call__(self, state, batch, frozen=None):
        return self.stage(state, batch, frozen, self.numbers)

    def lower(self, *args, **kwargs):
        return TrainStep(self.stage.lower(*self._args(args), **kwargs), self.numbers)

    def trace(self, *args):
        return TrainStep(self.stage.trace(*self._args(args)), self.numbers)

    def compile(self, *args, **kwargs):
        return TrainStep(self.stage.compile(*args, **kwargs), self.numbers)

    def _args(self, args):  # (state, batch[, frozen]) of the jitted function, the numbers appended; none: a stage
        return (*args, *(None,) * (3 - len(args)), self.numbers) if args else ()

    def __getattr__(self, name):  # as_text, memory_analysis, cost_analysis, ... of a JAX stage
        return getattr(self.stage, name)


def make_train_step(loss_fn: Callable, optimizer, graphdef, *,
                    micro_batches: int = 1, schedule=None,
                    frozen_graphdef=None, trainable=nnx.Param, mesh=None, rules=None,
                    nonfinite_guard: bool = True) -> TrainStep:
    """Build the jitted `step(state, batch, frozen=None) -> (state, metrics)`.

    `optimizer`: an optax GradientTransformation or an `optim.Optimizer` (its numbers are arguments of the step);
    `schedule` (optional): the learning rate logged as "lr", a `Schedule` (an argument) or an optax schedule.

    `frozen` (optional) is the state of a frozen model (reference / teacher) rebuilt with
    `frozen_graphdef` and handed to `loss_fn(policy, batch, frozen=..., rng=...)`.
    With a `mesh`, the step is traced inside `use_mesh(mesh, rules)`, so the model's logical
    sharding constraints apply; the state keeps the shardings it was given (`shard_state`).
    `nonfinite_guard=False` drops the guard that keeps the old state after a NaN/Inf step (such a step then writes
    NaNs into the weights): for checking that the guard leaves a finite run's bits alone (tests/test_nonfinite.py).
    """

    def grads_of(params, rest, batch, frozen_model, rng):
        def f(p):
            # `rest` rebuilt inside this trace (tree.map makes new Variables): its RNG counts (LoRA dropout) are then
            # mutable here; merged as they are, they belong to the outer trace (TraceContextError)
            model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
            moe.collect_router(model)  # MoE: the model's forwards append their router statistics
            total, metrics = loss_fn(model, batch, frozen=frozen_model, rng=rng)
            if (routed := moe.router_loss(model)) is not None:  # MoE only: per denom unit, like the loss
                aux, extra = routed
                total = total + aux * jax.lax.stop_gradient(metrics["denom"])
                metrics = {**metrics, **{k: v * metrics["denom"] for k, v in extra.items()}}
            _, _, new_rest = nnx.split(model, trainable, ...)
            return total, (metrics, new_rest)

        (total, (metrics, new_rest)), grads = jax.value_and_grad(f, has_aux=True)(params)
        return grads, metrics, new_rest

    numbers = {"optimizer": optimizer.numbers if isinstance(optimizer, Optimizer) else None,
               "lr": schedule if isinstance(schedule, Schedule) else None}
    # host scalars -> arrays once (not a transfer per step); on a mesh replicated over it, as every process holds them
    where = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    numbers = jax.tree.map(lambda x: jax.device_put(np.asarray(x), where), numbers)

    def step(state: TrainState, batch, frozen, numbers):
        with use_mesh(mesh, rules):
            opt = optimizer.build(numbers["optimizer"]) if isinstance(optimizer, Optimizer) else optimizer
            lr = numbers["lr"] if isinstance(schedule, Schedule) else schedule
            return step_body(state, batch, frozen, opt, lr)

    def step_body(state: TrainState, batch, frozen, optimizer, schedule):
        frozen_model = None if frozen is None else nnx.merge(frozen_graphdef, frozen)
        rng, sub = jax.random.split(state.rng)
        if micro_batches == 1:
            grads, metrics, rest = grads_of(state.params, state.rest, batch, frozen_model, sub)
        else:
            mbs = jax.tree.map(lambda x: x.reshape((micro_batches, -1) + x.shape[1:]), batch)

            def body(carry, xs):
                g_acc, m_acc, rest = carry
                mb, i = xs
                g, m, rest = grads_of(state.params, rest, mb, frozen_model, jax.random.fold_in(sub, i))
                return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, m_acc, m), rest), None

            first = jax.tree.map(lambda x: x[0], mbs)
            m_shape = jax.eval_shape(lambda: grads_of(state.params, state.rest, first, frozen_model, sub)[1])
            zeros_g = jax.tree.map(jnp.zeros_like, state.params)
            zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape)
            (grads, metrics, rest), _ = jax.lax.scan(
                body, (zeros_g, zeros_m, state.rest), (mbs, jnp.arange(micro_batches)))
        denom = jnp.maximum(metrics["denom"], 1e-9)
        # in each parameter's own dtype: a float32 denom would promote bfloat16 gradients, the optimizer's moments
        # would turn float32 after the first update, and the step would compile a second time for the new state
        grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
        out = {k: v / denom for k, v in metrics.items() if k != "denom"}
        out["denom"] = metrics["denom"]
        out["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            out["lr"] = schedule(state.step)
        # Non-finite guard: a NaN/Inf loss or gradient keeps the old weights and optimizer state, through
        # `where(ok, new, old)` after the update. A `lax.cond` branch around the update (the tenth stop's CPU form)
        # saved XLA:CPU a copy of every AdamW moment (the tiny Qwen3-VL step at 2 threads: 0.738 -> 0.700 s), but it
        # changed the last bits of training runs (the demo's SFT logs a grad_norm that differs in its last digit from
        # step 3, and the losses part by step 40), and `posttrain demo` on an AVX-512 CPU went from its documented
        # 43.5 / 62.5 / 63.5 / 69.0 % to 28.5 / 49.0 / 54.0 / 57.5 %; on a TPU the branch's outputs could not alias
        # the donated state (llama3-1b 1 x 2048: 5.58 against 3.59 GB of temporaries). tests/test_nonfinite.py checks
        # that the guard leaves a finite run's bits alone (the branch fails it).
        ok = jnp.isfinite(out["grad_norm"]) & jnp.isfinite(metrics["loss"] if "loss" in metrics else denom)
        keep = functools.partial(jax.tree.map, lambda new, old: new if jnp.issubdtype(
            new.dtype, jax.dtypes.prng_key) else jnp.where(ok, new, old))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if nonfinite_guard:
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        nonfinite = jnp.where(ok, 0, state.nonfinite + 1).astype(jnp.int32)
        out["skipped"] = 1.0 - ok.astype(jnp.float32)
        out["nonfinite_run"] = nonfinite
        new = TrainState(step=state.step + 1, params=params, rest=keep(rest, state.rest),
                         opt_state=opt_state, rng=rng, nonfinite=nonfinite)
        if (placed := active_mesh()) is not None:  # the new state placed by the rules, as `shard_state` placed
            new = jax.lax.with_sharding_constraint(new, tree_shardings(new, *placed))  # the old one
        return new, out

    return TrainStep(jax.jit(step, donate_argnums=0), numbers)
