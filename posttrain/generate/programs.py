"""`Sampler.generate`'s programs for a new shape, compiled concurrently (the first call's compile time, #56).

What: the prefill, then the decode as one program a cache phase. The first decode program does the n-fold repeat of
the prefill's cache, the first sampled token, the loops' carry and the first phase's `lax.while_loop`; each later
phase's program grows the cache to its size and runs that phase's while_loop. The carry but the cache is donated (the
loop's outputs reuse its buffers); the smaller cache, which no output can reuse, lives until that program ends, as in
the one-program decode (`Sampler._decode`), where old and new caches are alive together at each grow too.
The ops are that decode's (`Sampler._decode_init`, `_decode_phase`); only the program boundaries move, so the
tokens and log-probs are the same. (The grow was a program of its own until the ninth stop: 8 programs a call for 4
phases, where now 5; each program is a dispatch and a host round of its own.)
Why: the one-program decode holds every phase's loop body, each with its own copy of the layers (llama3-1b: 4 phases
x 16 unrolled layers, most of a 45-51 s first call on a TPU v5e), compiled as one program; XLA's compile releases
the GIL, so programs compiled in threads use more of a TPU host's cores (13 on a v5e one-chip host).
How: each program's input shapes are the previous program's traced outputs (nothing runs). Each is traced and
lowered in the calling thread (tracing holds the GIL) and handed at once to a thread pool to compile, so the
compiles overlap each other and the tracing of the next programs; the first call runs each program as soon as its
own compile ends (the prefill and the first phase run while later phases still compile). The `Compiled` programs
are kept by key (the arguments' shapes, dtypes and shardings, the SamplingParams, max_new_tokens, record); a later
call with the key runs them directly. The persistent compilation cache still applies (`.compile()` goes through it).
What it is not: multi-turn (`begin` / `extend`), image prompts or a mesh: those keep one prefill and one decode
program, and so does `generate` on a CPU unless `Sampler.concurrent_compile` is True (`Programs.applies`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import time

import jax

from posttrain.generate.shapes import grow, phase_sizes, repeat_rows
from posttrain.models import scan

# A quick first call's prefill (`Sampler.quick_first_prefill`): XLA's lowest compile effort. The prefill is a new
# shape's longest compile (llama3-1b, 64 x 128 prompt tokens, v5e: ~18 s of a first call's ~21 s; effort -1.0: ~5 s),
# and at that effort it runs without XLA's prefetching (that prefill 0.124 -> 0.298 s): later calls run the default
# compile (`Upgrade`).
QUICK_PREFILL = {"exec_time_optimization_effort": -1.0}


def compile_lowered(lowered, options=None):
    """XLA's compile of one lowered program (run in a pool thread; tests patch this to watch the threads).
    options: XLA build options (`Sampler.prefill_compile_options`), None for the defaults."""
    return lowered.compile(compiler_options=options)


def _first(s, weights, logits, cache, next_pos, key, stop, max_new_row, *, params, max_new):
    """The n-fold repeat of the prefill's cache, the first token, the carry and the first phase's loop. Returns
    (carry, the slot decode step 1 writes, the stacked layer weights of a scanned model or None)."""
    s.traces["decode"] += 1
    model, head = s._merge(weights)
    logits, cache, next_pos = repeat_rows(logits, cache, next_pos, params.n)
    P, start = cache.size, cache.index
    stack = scan.stack(model) if s._scan else None  # the weights stacked once for every phase (scan.py)
    carry = s._decode_init(logits, cache, next_pos, key, stop, max_new_row, params, max_new, None)
    if max_new > 1:  # one new token is the prefill's: no decode step
        size = phase_sizes(P, max_new)[0]
        carry = carry[:3] + (grow(carry[3], size),) + carry[4:]
        carry = s._decode_phase(model, head, stack, carry, start, size, P, key, stop, max_new_row, params, max_new,
                                None)
    return carry, start, None if stack is None else stack.leaves


def _phase(s, weights, rest, cache, start, leaves, key, stop, max_new_row, *, params, max_new, prompt, size):
    """A later phase: the cache grown to the phase's `size` slots, then that phase's while_loop. `rest` is the carry
    without its cache (donated: its buffers are the outputs'); the smaller cache is an argument of its own, not
    donated (no output can reuse it), freed when the caller drops it."""
    s.traces["decode_phase"] += 1
    model, head = s._merge(weights)
    stack = None if leaves is None else scan.stack(model)._replace(leaves=leaves)  # (the unused stacking is dropped)
    carry = rest[:3] + (grow(cache, size),) + rest[3:]
    return s._decode_phase(model, head, stack, carry, start, size, prompt, key, stop, max_new_row, params, max_new,
                           None)


def _signature(tree):
    """What selects a compiled program among arguments: the tree's structure and each leaf's shape, dtype, sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


class Programs:
    """A Sampler's compiled `generate` programs by key; `run` compiles a new key's concurrently."""

    def __init__(self, sampler):
        s = self.sampler = sampler
        self.first = jax.jit(functools.partial(_first, s), static_argnames=("params", "max_new"))
        self.phase = jax.jit(functools.partial(_phase, s), static_argnames=("params", "max_new", "prompt", "size"),
                             donate_argnums=(1,))
        self.compiled = {}
        self.counts = collections.Counter()  # programs lowered / compiled so far
        self.last_build = None  # the last new shape's timeline (benchmarks): per program, s since the build began
        self.last_prefill_args = None

    def settle(self) -> list:
        """Compile every quick first prefill's default program (`Upgrade`) now: benchmarks time the steady state
        after it. Returns the (quick, default) compiled pairs."""
        return [(progs[0].quick, progs[0]()) for progs in self.compiled.values()
                if not isinstance(progs, _Pending) and isinstance(progs[0], Upgrade)]

    @staticmethod
    def applies(flag, weights) -> bool:
        """flag: `Sampler.concurrent_compile`; None = on any backend but the CPU, whose XLA already spreads one
        program's compile over the cores (measured: the split no faster on 2 cores, 45 % slower on one: each program
        compiles its own kernels). And one device must hold the weights (a Compiled takes arguments only where it was
        compiled for them; weights sharded over a mesh's devices keep the one-program path)."""
        on = jax.default_backend() != "cpu" if flag is None else flag
        return on and len({d for x in jax.tree.leaves(weights) for d in x.sharding.device_set}) == 1

    def run(self, weights, toks, pos, segs, next_pos, key, stop, max_new_row, params, max_new, record):
        """generate's prefill and decode: ((None, None[, the prompts' routes]), (tokens, logprobs, lengths, routes)).
        A new key's programs run each as soon as its own compile ends (`_build`), not after the last one's."""
        args = (weights, toks, pos, segs, next_pos, key, stop, max_new_row)
        sig = (_signature(args), params, max_new, record)
        if sig not in self.compiled:
            self.compiled[sig] = self._build(args, params, max_new, record)
        progs = self.compiled[sig]
        self.last_prefill_args = (toks, pos, segs)  # (benchmarks/tpu.py runs both prefills of an Upgrade on them)
        try:
            pre = _program(progs[0])(weights, toks, pos, segs)
            carry, start, leaves = _program(progs[1])(weights, pre[0], pre[1], next_pos, key, stop, max_new_row)
            pre = (None, None) + tuple(pre[2:])  # the prefill's cache is freed once the first program has it
            for phase in progs[2:]:  # the carry but its cache is donated; the smaller cache is freed once replaced
                carry = _program(phase)(weights, carry[:3] + carry[4:], carry[3], start, leaves, key, stop,
                                        max_new_row)
            if isinstance(progs, _Pending):
                self.compiled[sig] = progs.done()
        except BaseException:
            if isinstance(progs, _Pending) or (isinstance(progs[0], Upgrade) and progs[0].default is None):
                # a failed compile is not kept: the next call builds again
                self.compiled.pop(sig, None)
            raise
        return pre, (carry[5], carry[6], carry[7], carry[9])

    def _build(self, args, params, max_new, record):
        """Trace and lower every program here, each compiled in a pool thread as soon as it is lowered."""
        weights, toks, pos, segs, next_pos, key, stop, max_new_row = args
        P = toks.shape[1]
        later = phase_sizes(P, max_new)[1:] if max_new > 1 else []
        futures, t0, lowered_at = [], time.perf_counter(), []

        def timed_compile(lowered, options):
            start = time.perf_counter()
            out = compile_lowered(lowered, options)
            return out, (round(start - t0, 3), round(time.perf_counter() - t0, 3))

        s = self.sampler
        quick = s.quick_first_prefill and s.prefill_compile_options is None
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 + len(later))
        lowereds = []

        def submit(traced, options=None):
            lowered = traced.lower()
            lowereds.append(lowered)
            self.counts["lowered"] += 1
            lowered_at.append(round(time.perf_counter() - t0, 3))
            futures.append(pool.submit(timed_compile, lowered, options))
            return traced.out_info

        try:
            pre = submit(s._prefill.trace(weights, toks, pos, segs, record=record),
                         QUICK_PREFILL if quick else s.prefill_compile_options)
            carry, start, leaves = submit(self.first.trace(weights, pre[0], pre[1], next_pos, key, stop, max_new_row,
                                                           params=params, max_new=max_new))
            for size in later:
                carry = submit(self.phase.trace(weights, carry[:3] + carry[4:], carry[3], start, leaves, key, stop,
                                                max_new_row, params=params, max_new=max_new, prompt=P, size=size))
        finally:
            pool.shutdown(wait=False)  # the submitted compiles go on; the pool's threads end with them

        def finished(spans):
            self.counts["compiled"] += len(spans)
            self.last_build = {"lowered_at": lowered_at, "compile_spans": list(spans),
                               "build_s": round(max(end for _, end in spans), 3)}

        return _Pending(futures, finished, lowereds[0] if quick else None)


class _Pending(tuple):
    """A new key's programs while they compile: their compiles' futures, so the first call runs each program as soon
    as its compile ends (the prefill and the first phase while the later phases still compile). `done()` waits for
    all, records the timeline and returns the programs (the prefill as an `Upgrade` after a quick one)."""

    def __new__(cls, futures, finished, upgrade=None):
        out = super().__new__(cls, futures)
        out.finished, out.upgrade = finished, upgrade
        return out

    def done(self):
        programs, spans = zip(*[f.result() for f in self])
        self.finished(list(spans))
        return (programs[0] if self.upgrade is None else Upgrade(self.upgrade, programs[0]),) + programs[1:]


class Upgrade:
    """The prefill after a quick first call (`Sampler.quick_first_prefill`): the first call ran the prefill compiled
    at QUICK_PREFILL's effort; the second call compiles the same lowered program with XLA's defaults (that call
    waits for the compile) and it and every later call run that one, so which program a call runs never depends on
    timing. The two are not bitwise equal on a TPU (llama3-1b, random weights: logits within 0.126, greedy argmax
    equal in 61 of 64 rows). Called: the default program (compiled on the first such call)."""

    def __init__(self, lowered, quick):
        self.lowered, self.quick, self.default = lowered, quick, None

    def __call__(self):
        if self.default is None:
            self.default = compile_lowered(self.lowered)
            self.lowered = None
        return self.default


def _program(p):
    """The program to run from what `Programs.compiled` holds: a compile's future (the first call), an Upgrade, or
    the compiled program itself."""
    if isinstance(p, concurrent.futures.Future):
        return p.result()[0]
    return p() if isinstance(p, Upgrade) else p
