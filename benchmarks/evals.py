#!/usr/bin/env python
"""The cost of the sampled evaluation (`posttrain.evals.SampledEval`, what `eval.k` runs in the loop and
`posttrain eval` runs) against the sampler call alone on the same prompts (issue #38: <= 1.2x).

Both sides use one compiled sampler (compiled before timing); each round times the bare generate calls
(the same prompts per call, the same k samples, the same keys) and then the whole evaluation (the same
calls, decoding to text, the reward function, pass@k / maj@k and the bootstrap intervals), interleaved;
the medians and their ratio are printed as JSON. Model: demo-tiny with random weights (no early stops:
every sample is max_new_tokens long) or --model HF_DIR.

Usage: .venv/bin/python benchmarks/evals.py [--prompts 200] [--k 8] [--max-new-tokens 8] [--rounds 5]
       [--model HF_DIR] [--json out.json]
"""

import argparse
import json
import platform
import statistics
import time

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=200)
ap.add_argument("--k", type=int, default=8)
ap.add_argument("--max-new-tokens", type=int, default=8)
ap.add_argument("--prompts-per-call", type=int, default=64)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--model", default=None)
ap.add_argument("--json", default=None)
args = ap.parse_args()

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain.data.prompts import Prompt  # noqa: E402
from posttrain.evals import SampledEval  # noqa: E402
from posttrain.rewards import functions as F  # noqa: E402
from posttrain.rewards.functions import math_answer_reward  # noqa: E402
from posttrain.tasks import addition  # noqa: E402

if args.model:
    from posttrain.models import from_pretrained
    from posttrain.tokenizer import Tokenizer

    tok, model = Tokenizer.from_pretrained(args.model), from_pretrained(args.model)
else:
    from posttrain.models import Transformer, preset
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    model = Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0))
_, held = addition.make_pairs(digits=2, seed=0, n_eval=args.prompts)
import numpy as np  # noqa: E402

prompts = [Prompt(np.asarray(tok.encode(r["prompt"]), np.int32), r["prompt"], {"answer": r["completion"]})
           for r in held]
ev = SampledEval(prompts, tok, [math_answer_reward(last_number=True)], [1.0], k=args.k,
                 max_new_tokens=args.max_new_tokens, prompts_per_call=args.prompts_per_call)
ev.run(model)  # compiles the sampler


def generate_alone():
    """The sampler calls of one evaluation and nothing else (the last call padded as the evaluation pads it)."""
    n = args.prompts_per_call
    for c, i in enumerate(range(0, len(prompts), n)):
        chunk = prompts[i:i + n]
        if len(chunk) < n and i:
            chunk = chunk + [chunk[0]] * (n - len(chunk))
        out = ev.sampler.generate([p.ids for p in chunk], ev.params, key=jax.random.fold_in(jax.random.key(0), c))
        jax.block_until_ready(out.tokens)


times = {"generate": [], "evaluation": []}
for _ in range(args.rounds):
    t0 = time.perf_counter()
    generate_alone()
    times["generate"].append(time.perf_counter() - t0)
    for cached in (F.extract_answer, F.normalize_answer, F._as_fraction, F._answer_key):
        cached.cache_clear()  # each evaluation starts cold, as one with new weights (new answers) would
    t0 = time.perf_counter()
    summary, _ = ev.run(model)
    times["evaluation"].append(time.perf_counter() - t0)
med = {k: statistics.median(v) for k, v in times.items()}
result = {"bench": "evals", "prompts": args.prompts, "k": args.k, "max_new_tokens": args.max_new_tokens,
          "model": args.model or "demo-tiny (random)", "rounds": args.rounds,
          "generate_s": round(med["generate"], 4), "evaluation_s": round(med["evaluation"], 4),
          "ratio": round(med["evaluation"] / med["generate"], 3), "all": times,
          "pass@1": summary["pass@1"][0], "cpu": platform.processor() or platform.machine(), "jax": jax.__version__}
print(json.dumps(result))
if args.json:
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
