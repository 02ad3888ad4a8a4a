"""Attention: the blockwise path equals the dense reference (outputs and gradients) on every layout;
tile skipping; implementation choice; a branched KV cache decodes like the unshared row (per-token
log-probs and gradients of prefix-shared rows for every family: tests/test_branches.py); memory is linear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import KVCache, from_pretrained
from posttrain.models import attention as A

B, K, G, H = 2, 2, 2, 8
# float32 comparisons: 1e-5 on a CPU; on a TPU, even at HIGHEST matmul precision, exp and division agree to ~1e-4
# (seen on a v5e: blockwise vs dense up to 1.4e-4 on outputs of size ~1), still far below a mask error (~1e-1)
ATOL = 1e-5 if jax.default_backend() == "cpu" else 3e-4


def _qkv(T, S, seed=0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, T, K, G, H)).astype(np.float32)
    k = r.normal(size=(B, K, S, H)).astype(np.float32)
    v = r.normal(size=(B, K, S, H)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _layout(T, *, pad=None, segments=None, branches=None):
    """No-cache layout: pad = real lengths (right padding); segments / branches: [B, T] lists."""
    pos = np.broadcast_to(np.arange(T), (B, T)).copy()
    seg = None
    if pad is not None:
        seg = (np.arange(T)[None] < np.asarray(pad)[:, None]).astype(np.int32)
    if segments is not None:
        seg = np.asarray(segments, np.int32)
        for b in range(B):  # positions restart in each segment
            for s in set(seg[b].tolist()) - {0}:
                idx = np.nonzero(seg[b] == s)[0]
                pos[b, idx] = np.arange(len(idx))
    br = None
    if branches is not None:
        br = np.asarray(branches, np.int32)
        for b in range(B):  # each branch's positions start right after the prefix
            p0 = int((br[b] == 0).sum())
            for k in set(br[b].tolist()) - {0}:
                idx = np.nonzero(br[b] == k)[0]
                pos[b, idx] = p0 + np.arange(len(idx))
    real = pos if seg is None else np.where(seg != 0, pos, -1)
    j = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    slots = jnp.arange(T, dtype=jnp.int32)
    return A.Layout(j(real), j(real), slots, slots, j(seg), j(seg), j(br), j(br), causal_aligned=True)


def _branch_ids(T, prefix, sizes):
    row = [0] * prefix
    for i, n in enumerate(sizes):
        row += [i + 1] * n
    row += [0] * (T - len(row))
    return row


LAYOUTS = {
    "causal": dict(),
    "padded": dict(pad=[37, 21]),
    "packed": dict(segments=[[1] * 15 + [2] * 20 + [3] * 5 + [0] * 5, [1] * 44 + [0]]),
    "branches": dict(branches=[_branch_ids(45, 13, [9, 16, 7]), _branch_ids(45, 20, [25])]),
    "branches_padded": dict(branches=[_branch_ids(45, 13, [9, 16]), _branch_ids(45, 20, [25])], pad=[38, 45]),
}


def _both(q, k, v, lay, window, cap, tile, seed=1):
    """(out, grads) of the dense reference and of blockwise, for a random output cotangent."""
    ct = jnp.asarray(np.random.default_rng(seed).normal(size=q.shape).astype(np.float32))
    kw = dict(scale=H ** -0.5, cap=cap)

    def dense(q, k, v):
        return A.dense(q, k, v, lay.mask(window), **kw)[0]

    def tiled(q, k, v):
        return A.blockwise(q, k, v, lay, window=window, block_q=tile, block_k=tile, **kw)

    res = []
    for f in (dense, tiled):
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        res.append((out, vjp(ct)))
    return res


CASES = [("causal", None, None), ("padded", 6, None), ("packed", None, None), ("packed", 6, 5.0),
         ("branches", None, 5.0), ("branches", 6, None), ("branches_padded", None, None)]


@pytest.mark.parametrize("name,window,cap", CASES)
def test_blockwise_equals_dense(name, window, cap):
    T = 45  # not a multiple of the tile: exercises padded tiles
    q, k, v = _qkv(T, T)
    (o1, g1), (o2, g2) = _both(q, k, v, _layout(T, **LAYOUTS[name]), window, cap, tile=8)
    np.testing.assert_allclose(o2, o1, atol=ATOL, rtol=0)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    assert float(jnp.abs(g1[0]).max()) > 0  # gradients are not trivially zero


@pytest.mark.parametrize("name,window", [("padded", 6), ("packed", None), ("branches_padded", None)])
def test_blockwise_equals_dense_with_sinks(name, window):
    """GPT-OSS attention sinks: outputs and the gradients of q, k, v and the sink logits (the custom VJP's own
    term) of the blockwise path equal autodiff of the dense reference."""
    T = 45
    q, k, v = _qkv(T, T)
    K, G = q.shape[2], q.shape[3]
    sinks = jnp.asarray(np.random.default_rng(4).normal(size=(K, G)).astype(np.float32))
    lay = _layout(T, **LAYOUTS[name])
    ct = jnp.asarray(np.random.default_rng(1).normal(size=q.shape).astype(np.float32))
    kw = dict(scale=H ** -0.5, cap=None, sinks=None)
    res = []
    for f in (lambda q, k, v, s: A.dense(q, k, v, lay.mask(window), **{**kw, "sinks": s})[0],
              lambda q, k, v, s: A.blockwise(q, k, v, lay, window=window, block_q=8, block_k=8, **{**kw, "sinks": s})):
        out, vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
        res.append((out, vjp(ct)))
    (o1, g1), (o2, g2) = res
    np.testing.assert_allclose(o2, o1, atol=ATOL, rtol=0)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    assert float(jnp.abs(g1[3]).max()) > 1e-3  # the sinks' gradient is not trivially zero
    plain = A.dense(q, k, v, lay.mask(window), scale=H ** -0.5, cap=None)[0]
    assert float(jnp.abs(plain - o1).max()) > 1e-2  # and the sinks change the output


def test_empty_rows_output_zero():
    """A query with nothing to attend (padding) outputs 0 on both paths."""
    T = 24
    q, k, v = _qkv(T, T)
    lay = _layout(T, pad=[10, 24])
    (o1, _), (o2, _) = _both(q, k, v, lay, None, None, tile=8)
    assert float(jnp.abs(o1[0, 10:]).max()) == 0.0 and float(jnp.abs(o2[0, 10:]).max()) == 0.0


def test_tiles_skipped_between_branches_and_above_diagonal():
    """The active-tile map: causal triangle, and no tile between two branches."""
    T, bt = 64, 16
    lay = _layout(T, branches=[_branch_ids(T, 16, [16, 32])] * B)
    act = np.asarray(A._active_tiles(lay, None, bt, bt))
    # tiles: 0 prefix, 1 branch 1, 2-3 branch 2
    expect = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    np.testing.assert_array_equal(act, expect)
    win = np.asarray(A._active_tiles(_layout(T), 4, bt, bt))  # window 4 < tile: only the diagonal + one below
    assert win.sum() == 4 + 3 and np.all(np.diag(win))


def test_cached_prefill_blockwise_equals_dense():
    """With a cache (queries at slots write..write+T of a larger cache, empty slots after)."""
    T, S, write = 40, 64, 8
    q, k, v = _qkv(T, S, seed=3)
    pos = np.full((B, S), -1, np.int32)
    pos[:, :write + T] = np.arange(write + T)
    pos[1, :5] = -1  # left padding in row 1
    lay = A.Layout(jnp.asarray(pos[:, write:write + T]), jnp.asarray(pos), write + jnp.arange(T), jnp.arange(S))
    (o1, g1), (o2, g2) = _both(q, k, v, lay, 7, None, tile=16)
    np.testing.assert_allclose(o2, o1, atol=ATOL, rtol=0)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_choose():
    kw = dict(branches=False, softcap=False, cached=False)
    assert A.choose("cpu", T=1, S=4096, **kw) == "dense"
    assert A.choose("cpu", T=64, S=64, **kw) == "dense"
    assert A.choose("cpu", T=256, S=256, **kw) == "blockwise"
    assert A.choose("cpu", T=2048, S=2048, **kw) == "blockwise"
    assert A.choose("cpu", T=2048, S=2048, return_probs=True, **kw) == "dense"
    assert A.choose("gpu", T=2048, S=2048, **kw) == "cudnn"
    assert A.choose("gpu", T=2048, S=2048, branches=True, softcap=False, cached=False) == "blockwise"
    assert A.choose("gpu", T=2048, S=2048, branches=False, softcap=True, cached=False) == "blockwise"
    assert A.choose("gpu", T=2048, S=2048, branches=False, softcap=False, cached=True) == "blockwise"
    assert A.choose("tpu", T=2048, S=2048, **kw) == "splash"  # the rest of the TPU choices: test_attention_tpu.py


# ---------------------------------------------------------------------------------- through the model


@pytest.fixture
def small_tiles(monkeypatch):
    """Force the blockwise path with 8-token tiles on the tiny test rows."""
    monkeypatch.setattr(A, "DENSE_MAX", 4)
    monkeypatch.setattr(A, "BLOCK", 8)


def _shared_and_unshared(prompt, branches):
    """One prefix-shared row and the unshared rows (prompt + each branch), with the slot map."""
    toks = list(prompt) + [t for b in branches for t in b]
    pos = list(range(len(prompt))) + [len(prompt) + i for b in branches for i in range(len(b))]
    bid = [0] * len(prompt) + [i + 1 for i, b in enumerate(branches) for _ in b]
    L = max(len(prompt) + len(b) for b in branches)
    rows = np.zeros((len(branches), L), np.int32)
    seg = np.zeros((len(branches), L), np.int32)
    for i, b in enumerate(branches):
        n = len(prompt) + len(b)
        rows[i, :n] = list(prompt) + list(b)
        seg[i, :n] = 1
    upos = np.broadcast_to(np.arange(L), rows.shape)
    return (np.asarray([toks]), np.asarray([pos]), np.asarray([bid])), (rows, upos, seg)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_branched_cache_decode_equals_unshared(hf_checkpoints, family, small_tiles):
    """Prefill a shared row into a KV cache, then decode the next token of branch 2: same logits as
    decoding after prompt + branch 2 alone."""
    model = from_pretrained(hf_checkpoints[family])
    r = np.random.default_rng(2)
    prompt = r.integers(3, 97, 9).tolist()
    branches = [r.integers(3, 97, n).tolist() for n in (10, 8)]
    (st, sp, sb), (ut, up, us) = _shared_and_unshared(prompt, branches)
    nxt = 5
    n = st.shape[1]
    cache = model(jnp.asarray(st), jnp.asarray(sp), branch_ids=jnp.asarray(sb),
                  cache=KVCache.init(model.cfg, 1, 48)).cache
    pos2 = len(prompt) + len(branches[1])
    got = model(jnp.asarray([[nxt]]), jnp.asarray([[pos2]]), branch_ids=jnp.asarray([[2]]), cache=cache).logits
    row = list(prompt) + branches[1] + [nxt]
    ref = model(jnp.asarray([row]), jnp.asarray([list(range(len(row)))])).logits
    assert n == len(prompt) + 18
    np.testing.assert_allclose(np.asarray(got)[0, 0], np.asarray(ref)[0, -1], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------- memory


def _train_temp_bytes(T, monkeypatch=None):
    """XLA's temporary memory of the compiled full fine-tune step of a small model on 1 x T tokens."""
    import optax
    from flax import nnx

    from posttrain.losses import sft_loss
    from posttrain.models import ModelConfig, Transformer
    from posttrain.train import init_state, make_train_step

    cfg = ModelConfig(vocab_size=97, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=96)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-4)
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef)
    i32 = jax.ShapeDtypeStruct((1, T), jnp.int32)
    batch = dict(tokens=i32, positions=i32, segment_ids=i32, targets=i32,
                 weights=jax.ShapeDtypeStruct((1, T), jnp.float32))
    # LLVM's optimisation level changes the machine code, not XLA's buffer assignment: O0 compiles faster (a CPU
    # option: a TPU's compiler has no such flag and refuses it)
    opts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
    compiled = step.lower(state, batch).compile(compiler_options=opts)
    return compiled.memory_analysis().temp_size_in_bytes


def test_train_step_memory_grows_linearly(monkeypatch):
    """2048 -> 8192 tokens: temporaries grow ~4x (linear), where dense attention grows ~16x; the plan's
    activation estimate follows the blockwise path.

    On a TPU, XLA keeps up to ~117 MB of a program's temporaries in the chip's 128 MiB VMEM (memory space S(1)),
    which `memory_analysis`' temporary bytes (HBM) leave out: this model's steps fit there whole up to 1 x 4096
    (6.57 MB of HBM temporaries at 1,024, 2,048 and 4,096 tokens; 105.5 MB at 8,192, 333 MB at 16,384: TPU v5e,
    benchmarks/tpu_memory.py, whose buffer-assignment dump shows the 117 MB VMEM allocation). So on a TPU the test
    compares what each added token costs above that: (temp(32768) - temp(16384)) / (temp(16384) - temp(8192)) is
    2 for memory linear in the row and 4 for quadratic."""
    from posttrain.models import ModelConfig
    from posttrain.plan import plan

    if jax.default_backend() == "tpu":
        t8, t16, t32 = (_train_temp_bytes(T) for T in (8192, 16384, 32768))
        assert 0 < t32 - t16 < 2.5 * (t16 - t8), (t8, t16, t32)
    else:
        small, big = _train_temp_bytes(2048), _train_temp_bytes(8192)
        assert big / small < 5.0, (small, big)
    cfg = ModelConfig(vocab_size=97, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=96)
    act = [plan(cfg, batch=1, seq_len=T, mesh_shape={}, preset="dp")["activations"] for T in (2048, 8192)]
    assert act[1] == 4 * act[0]
    monkeypatch.setattr(A, "DENSE_MAX", 1 << 20)  # the dense path, for contrast: quadratic
    if jax.default_backend() == "tpu":  # small rows' temporaries sit in VMEM (1 x 1024 dense: 0 bytes of HBM, TPU
        # eighth session): the same per-added-token measure as above, 4 for quadratic growth (passed on a v5e, ninth)
        d2, d4, d8 = (_train_temp_bytes(T) for T in (2048, 4096, 8192))
        assert d8 - d4 > 2.5 * (d4 - d2) > 0, (d2, d4, d8)
    else:
        dense_small, dense_big = _train_temp_bytes(1024), _train_temp_bytes(4096)
        assert dense_big / dense_small > 8.0, (dense_small, dense_big)
