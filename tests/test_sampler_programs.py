"""generate/programs.py: a new shape's prefill and decode phases compiled as separate programs, concurrently.

The reference is the one-program decode (`Sampler.concurrent_compile = False`, what begin/extend, image prompts and,
by default, a CPU run): the split moves program boundaries only, so tokens, log-probs, lengths and routes are bitwise
equal. The tests set `concurrent_compile = True` (the default, None, keeps a CPU on one program)."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.generate import Sampler, SamplingParams, programs
from posttrain.generate.shapes import phase_sizes
from posttrain.models import Transformer, preset

TINY = dict(vocab_size=97, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
NEW = 130  # 4 cache phases after a 16-token bucket: the first program and 3 later ones
LIMITS = [60, 40, NEW]  # per-row max_new_tokens


def _model(kind):
    if kind == "moe":
        cfg = preset("demo-tiny", vocab_size=97, num_experts=4, experts_per_token=2, expert_mlp_dim=16)
    else:
        cfg = preset("tiny-llama", **TINY, scan_layers=kind == "scan")
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _prompts(seed=0, lengths=(9, 5, 13)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 97, n).tolist() for n in lengths]


def _generate(s, split, prompts, params, **kw):
    s.concurrent_compile = split
    return s.generate(prompts, params, key=jax.random.key(4), max_new_tokens=LIMITS, **kw)


def _equal(got, ref):
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.logprobs, ref.logprobs)  # bitwise: the same ops
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    assert got.finish_reasons == ref.finish_reasons
    for a, b in ((got.routes, ref.routes), (got.prompt_routes, ref.prompt_routes)):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "scan", "moe"])
def test_split_programs_equal_the_one_program_decode(kind):
    s = Sampler(_model(kind), max_len=16 + NEW)
    assert len(phase_sizes(16, NEW)) == 4 and s._scan == (kind == "scan")
    prompts, record = _prompts(), kind == "moe"
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0, record_routes=record)
    probe = _generate(s, False, prompts, greedy, stop_ids=[[], [], []])
    stops = [[int(probe.tokens[0, 10])], [], []]  # row 0 stops at a token it samples greedily
    ref = _generate(s, False, prompts, greedy, stop_ids=stops)
    assert ref.finish_reasons == ["stop", "length", "length"] and ref.lengths[0] <= 11
    assert list(ref.lengths[1:]) == [40, NEW]  # row 2 runs through the 4 phases
    lowered = s._programs.counts["lowered"]
    _equal(_generate(s, True, prompts, greedy, stop_ids=stops), ref)
    assert s._programs.counts["lowered"] == lowered + 5  # prefill, first, 3 later phases: the split ran
    sampled = SamplingParams(max_new_tokens=NEW, temperature=1.0, n=2, stop_ids=(5, 17, 33), record_routes=record)
    ref = _generate(s, False, prompts, sampled)
    assert "stop" in ref.finish_reasons and (ref.lengths <= np.repeat(LIMITS, 2)).all()
    _equal(_generate(s, True, prompts, sampled), ref)
    if record:
        assert (ref.routes[:, 0] >= 0).all()


def test_programs_compile_at_the_same_time_and_once(monkeypatch):
    """Each compile waits at a barrier for all 3 programs (70 new tokens: 2 cache phases, so prefill, first, and the
    second phase): compiled one after another, the first would wait alone and the barrier would break
    (BrokenBarrierError) after its timeout. A second call of the same shapes compiles nothing."""
    new = 70
    assert len(phase_sizes(16, new)) == 2
    barrier, threads = threading.Barrier(3, timeout=60), []
    real = programs.compile_lowered

    def compile_together(lowered, options=None):
        threads.append(threading.get_ident())
        barrier.wait()
        return real(lowered, options)

    monkeypatch.setattr(programs, "compile_lowered", compile_together)
    s = Sampler(_model("llama"), max_len=16 + new)
    s.concurrent_compile = True  # (None, the default, is False on a CPU)
    params = SamplingParams(max_new_tokens=new, temperature=1.0, n=2)
    s.generate(_prompts(0), params)
    assert len(threads) == len(set(threads)) == 3 and threading.get_ident() not in threads
    assert s.traces["prefill"] == 1 and s.traces["decode"] == 1 and s.traces["decode_phase"] == 1
    before, counts = dict(s.traces), dict(s._programs.counts)
    out = s.generate(_prompts(1, (16, 3, 7)), params, key=jax.random.key(9))  # other prompts, the same bucket
    assert len(threads) == 3 and dict(s.traces) == before and dict(s._programs.counts) == counts
    assert out.tokens.shape == (6, new) and counts == {"lowered": 3, "compiled": 3}


def test_prefill_compile_options_reach_the_prefill_alone(monkeypatch):
    """`Sampler.prefill_compile_options` are XLA build options for the prefill program only; the decode programs
    compile with the defaults, and the tokens do not depend on them on a CPU here (greedy, effort only)."""
    seen = []
    real = programs.compile_lowered

    def record(lowered, options=None):
        seen.append((lowered.as_text().split("\n", 1)[0], options))
        return real(lowered, options)

    monkeypatch.setattr(programs, "compile_lowered", record)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    s = Sampler(_model("llama"), max_len=16 + 40)
    s.concurrent_compile = True
    s.prefill_compile_options = {"exec_time_optimization_effort": -1.0}
    out = s.generate(_prompts(0), params)
    assert len(seen) == 1 + len(phase_sizes(16, 40))
    assert [o for _, o in seen] == [{"exec_time_optimization_effort": -1.0}] + [None] * (len(seen) - 1)
    assert "prefill" in seen[0][0]
    ref = Sampler(_model("llama"), max_len=16 + 40)
    ref.concurrent_compile = True
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.generate(_prompts(0), params).tokens))


def test_first_call_runs_each_program_once_its_compile_ends(monkeypatch):
    """The later phase's compile is held (up to 60 s) until the prefill has run, and the prefill until the first
    decode program has compiled: a first call that waited for every compile before running anything would time out
    here. The tokens equal the one-program decode's, and the second call reuses the programs."""
    prefill_ran, first_compiled = threading.Event(), threading.Event()
    real = programs.compile_lowered

    def compile_in_order(lowered, options=None):
        name = lowered.as_text().split("\n", 1)[0]
        if "_phase" in name:
            assert prefill_ran.wait(60), "a later phase compiled only after the prefill ran: the prefill never ran"
        out = real(lowered, options)
        if "_first" in name:
            first_compiled.set()
        if "_prefill" not in name:
            return out

        def prefill(*args):
            prefill_ran.set()
            assert first_compiled.wait(60)
            return out(*args)

        return prefill

    monkeypatch.setattr(programs, "compile_lowered", compile_in_order)
    new = 70
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    s = Sampler(_model("llama"), max_len=16 + new)

    def run(split):
        s.concurrent_compile = split
        return s.generate(_prompts(0), params, key=jax.random.key(4))

    got = run(True)
    assert prefill_ran.is_set() and s._programs.counts == {"lowered": 3, "compiled": 3}
    assert s._programs.last_build["build_s"] >= max(e for _, e in s._programs.last_build["compile_spans"][:2])
    _equal(run(True), got)
    assert s._programs.counts == {"lowered": 3, "compiled": 3}
    _equal(got, run(False))


def test_quick_first_prefill_then_the_default_compile(monkeypatch):
    """`Sampler.quick_first_prefill`: the first call's prefill compiles with programs.QUICK_PREFILL, the decode
    programs with the defaults; the second call compiles the same prefill with the defaults and runs it, as every
    later call does. Tokens and log-probs equal the one-program decode's (a CPU: the two compiles give the same
    bits). Off by default."""
    seen = []
    real = programs.compile_lowered

    def record(lowered, options=None):
        seen.append(("prefill" in lowered.as_text().split("\n", 1)[0], options))
        return real(lowered, options)

    monkeypatch.setattr(programs, "compile_lowered", record)
    new = 40
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    s = Sampler(_model("llama"), max_len=16 + new)
    assert s.quick_first_prefill is False
    s.concurrent_compile, s.quick_first_prefill = True, True

    def run():
        return s.generate(_prompts(0), params, key=jax.random.key(4))

    first = run()
    n = 1 + len(phase_sizes(16, new))
    assert seen[0] == (True, programs.QUICK_PREFILL) and seen[1:] == [(False, None)] * (n - 1)
    up = next(iter(s._programs.compiled.values()))[0]
    assert isinstance(up, programs.Upgrade) and up.default is None
    _equal(run(), first)  # compiles the default prefill, then runs it
    assert seen[n:] == [(True, None)] and up.default is not None
    _equal(run(), first)
    (quick, default), = s._programs.settle()
    assert len(seen) == n + 1 and quick is not default and up() is default
    a, b = (jax.tree.leaves(p(s._weights, *s._programs.last_prefill_args)) for p in (quick, default))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    s.concurrent_compile = False
    _equal(first, run())  # the one-program decode
    assert s._programs.counts == {"lowered": n, "compiled": n}
