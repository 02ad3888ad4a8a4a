"""Shared helpers of the benchmarks: the anchors' flags, thread pinning, the anchor checkpoint.

Every benchmark pins itself to N cores BEFORE importing numpy/JAX (XLA sizes its thread pool
from the affinity mask, exactly as ../shared/anchors does), takes the anchors' shape flags,
and writes one JSON file. Never part of the test run.
"""

import argparse
import json
import os
import statistics
import sys


def parse_args(extra=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--ckpt", default="/tmp/tiny-llama")
    ap.add_argument("--json", default=None)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--experts", type=int, default=0, help="> 0: the anchors' tiny Qwen3-MoE (built when absent)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-mlp", type=int, default=256)
    for args, kw in extra or []:
        ap.add_argument(*args, **kw)
    args = ap.parse_args()
    pin_threads(args.threads)
    return args


def pin_threads(n: int) -> None:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    avail = sorted(os.sched_getaffinity(0))
    if n < len(avail):
        os.sched_setaffinity(0, set(avail[:n]))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ensure_checkpoint(args) -> str:
    """The anchors' tiny Llama (or with --experts their tiny Qwen3-MoE) at --ckpt; built with the anchors'
    recipe when absent."""
    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, os.path.join(here, "..", "..", "shared", "anchors"))
        from hf_bench import make_tiny_llama  # the anchors' own builder: same weights, same folder

        make_tiny_llama(args.ckpt, args.vocab, args.layers, args.hidden, args.heads, args.kv_heads, args.mlp,
                        experts=args.experts, top_k=args.top_k, moe_mlp=args.moe_mlp)
    return args.ckpt


def med(ts):
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "runs": [round(t, 5) for t in ts]}


def write(res: dict, path) -> None:
    print("RESULT_JSON " + json.dumps(res))
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=2)
