#!/usr/bin/env python
"""Speed on a hybrid model: posttrain against transformers + PyTorch on a tiny Qwen3.5 (issue #36), same run.

The checkpoint has the anchors' width (vocab 2048, hidden 256, MLP 1024, 4 heads of 64) and 4 layers: 3 Gated
DeltaNet layers (2 key / 4 value heads of 64) then 1 gated full-attention layer; random weights, built by
transformers (`save_pretrained`) with the anchors' word-level tokenizer. transformers runs the delta rule in its
torch fallback (`torch_chunk_gated_delta_rule`, no flash-linear-attention kernels on a CPU). Each round runs,
one process after another through `with_rss.py`:
  posttrain train      benchmarks/train.py, full fine-tune, AdamW, batch 1 x 2048 tokens;
  transformers train   the anchors' hf_bench.py --existing, the same step;
  posttrain generate   benchmarks/generate.py, greedy, batch 8, 64-token prompts, exactly 128 new tokens;
  transformers generate  hf_bench.py --existing, `generate` with the same shapes.
The job order alternates between rounds; figures are medians over rounds of each process's own median. Both sides
run in this project's venv (torch and transformers are its test dependencies). Writes one JSON (medians, ratios,
peak RSS, raw rounds, `lscpu`'s model name) and prints a table.

Usage: .venv/bin/python benchmarks/hybrid.py [--rounds 3] [--threads 2] [--ckpt /tmp/tiny-qwen3_5]
                                            [--out runs/bench-hybrid]
"""

import argparse
import json
import os
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ANCHORS = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "anchors"))
sys.path.insert(0, HERE)
from real import cpu_model, job  # noqa: E402

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
             layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=4096,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def build(path: str) -> None:
    """The tiny Qwen3.5 at `path` (random weights, seed 0) with the anchors' tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, ANCHORS)
    from hf_bench import make_tiny_llama

    tmp = path + ".llama"
    make_tiny_llama(tmp)  # for its tokenizer files
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **SHAPE), dtype=torch.float32)
    model.save_pretrained(path)
    for name in os.listdir(tmp):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tmp, name), path)
    shutil.rmtree(tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--ckpt", default="/tmp/tiny-qwen3_5")
    ap.add_argument("--out", default="runs/bench-hybrid")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.ckpt, "config.json")):
        build(a.ckpt)
    os.environ["ANCHOR_VENV"] = sys.prefix  # hf_bench.py runs with this venv's torch + transformers
    hf = os.path.join(ANCHORS, "hf_bench.py")
    train = ["--batch", "1", "--seq", "2048", "--steps", "3", "--reps", "3"]
    gen = ["--batch", "8", "--prompt", "64", "--new", "128", "--reps", "3"]
    jobs = [("posttrain_train", os.path.join(HERE, "train.py"), ["--ckpt", a.ckpt, *train]),
            ("hf_train", hf, ["--existing", "--ckpt", a.ckpt, *train, "--prompt", "8", "--new", "8"]),
            ("posttrain_generate", os.path.join(HERE, "generate.py"), ["--ckpt", a.ckpt, "--only-batch", *gen]),
            ("hf_generate", hf, ["--existing", "--ckpt", a.ckpt, *gen, "--seq", "64", "--steps", "2"])]
    rounds = []
    for r in range(a.rounds):
        out = os.path.join(a.out, f"round{r}")
        os.makedirs(out, exist_ok=True)
        rounds.append({name: job(name, script, argv, out, a.threads)
                       for name, script, argv in (jobs if r % 2 else jobs[::-1])})

    def med(name, key):
        return statistics.median(r[name][key] for r in rounds)

    s = {"posttrain_train_tok_s": med("posttrain_train", "train_tok_s"),
         "hf_train_tok_s": med("hf_train", "train_tok_s"),
         "posttrain_gen_tok_s": med("posttrain_generate", "gen_tok_s"), "hf_gen_tok_s": med("hf_generate", "gen_tok_s")}
    ratios = {"train_speedup_vs_transformers": s["posttrain_train_tok_s"] / s["hf_train_tok_s"],
              "generate_speedup_vs_transformers": s["posttrain_gen_tok_s"] / s["hf_gen_tok_s"]}
    summary = {"cpu": cpu_model(), "threads": a.threads, "rounds": a.rounds, "ckpt": a.ckpt, "shape": SHAPE,
               "medians": s, "ratios": ratios,
               "peak_rss_gib": {n: statistics.median(r[n].get("peak_rss_bytes", 0) for r in rounds) / 2 ** 30
                                for n in rounds[0]},
               "raw": rounds}
    path = os.path.join(a.out, "hybrid.json")
    with open(path, "w") as fh:
        json.dump(summary, fh, indent=2)
    print(f"\ntiny Qwen3.5 (3 linear + 1 full layer, hidden 256), {a.threads} threads, {summary['cpu']}, "
          f"medians of {a.rounds} interleaved rounds")
    print(f"train 1 x 2048: transformers {s['hf_train_tok_s']:.0f} tok/s, posttrain {s['posttrain_train_tok_s']:.0f} "
          f"tok/s ({ratios['train_speedup_vs_transformers']:.2f}x)")
    print(f"generate (greedy, 8 x (64 + 128)): transformers {s['hf_gen_tok_s']:.0f} tok/s, posttrain "
          f"{s['posttrain_gen_tok_s']:.0f} tok/s ({ratios['generate_speedup_vs_transformers']:.2f}x)")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
