#!/usr/bin/env python
"""Same-run sweep against the anchors: training tokens/s and generation new tokens/s by length, peak memory.

Runs, for each shape and round, posttrain's benchmark and the anchors' transformers + PyTorch
(`hf_bench.py`) and Tunix (`tunix_bench.py`) scripts as separate processes one after another
(never in parallel: 2 cores), interleaved by shape so drift hits every library alike. Each
process's peak resident memory comes from `os.wait4`. run_all.sh cannot pass shapes, hence this
driver; it uses the same scripts, flags and reference venv ($ANCHOR_VENV, default /tmp/anchor-venv).

Writes OUT/sweep.json (every run, medians over rounds, same-round ratios) and, with --plot,
docs-ready PNGs (tokens/s and peak RSS against length).

Usage: .venv/bin/python benchmarks/sweep.py --out /tmp/sweep --rounds 3 \
           --train 8x256 4x512 1x2048 --gen 8x64 4x1024 [--plot docs/attention_scaling.png]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ANCHORS = os.path.join(HERE, "..", "..", "shared", "anchors")
LIBS = ("posttrain", "torch", "tunix")


def command(lib, kind, batch, length, args):
    """argv of one benchmark process and the JSON key of its figure."""
    steps = ["--steps", "3"] if kind == "train" else []
    common = ["--threads", str(args.threads), "--ckpt", args.ckpt, "--batch", str(batch), "--reps", str(args.reps)]
    common += steps
    shape = ["--seq", str(length)] if kind == "train" else ["--prompt", str(length), "--new", str(args.new)]
    apy = os.path.join(os.environ.get("ANCHOR_VENV", "/tmp/anchor-venv"), "bin", "python")
    if lib in ("posttrain", "baseline"):  # baseline: another checkout of posttrain (--baseline), e.g. the last release
        here = HERE if lib == "posttrain" else os.path.join(args.baseline, "benchmarks")
        script = os.path.join(here, "train.py" if kind == "train" else "generate.py")
        extra = [] if kind == "train" or lib == "baseline" else ["--only-batch"]
        return [sys.executable, script] + common + shape + extra, ("train_tok_s" if kind == "train" else "gen_tok_s")
    if lib == "torch":
        return [apy, os.path.join(ANCHORS, "hf_bench.py")] + common + shape, (
            "train_tok_s" if kind == "train" else "gen_tok_s")
    skip = "plain,gen" if kind == "train" else "peft,plain"
    return [apy, os.path.join(ANCHORS, "tunix_bench.py"), "--skip", skip] + common[:2] + common[4:] + shape, (
        "peft_train_tok_s" if kind == "train" else "gen_tok_s")


def run_one(argv, key, timeout):
    """(figure or None, seconds) of one benchmark process; its peak RSS is left in _LAST."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    start = time.time()
    env = dict(os.environ)
    if _BASELINE.get("path") and _BASELINE["path"] in argv[1]:
        env["PYTHONPATH"] = _BASELINE["path"]
    proc = subprocess.Popen(argv + ["--json", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    try:
        res = json.load(open(path))
        value = res.get(key)
    except (OSError, ValueError):
        value = None
        print(out[-2000:], flush=True)
    finally:
        os.unlink(path)
    return value, time.time() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/sweep")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt", default="/tmp/tiny-llama")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--train", nargs="*", default=["8x256", "4x512", "1x2048"], help="BATCHxSEQ")
    ap.add_argument("--gen", nargs="*", default=["8x64", "4x1024"], help="BATCHxPROMPT")
    ap.add_argument("--libs", nargs="*", default=list(LIBS), help="posttrain torch tunix baseline")
    ap.add_argument("--baseline", default=None, help="path of another posttrain checkout (lib 'baseline')")
    ap.add_argument("--skip", nargs="*", default=[], help="LIB:KIND:BATCHxLEN entries not to run")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--also", nargs="*", default=[], help="other sweep.json files whose shapes join the plot")
    args = ap.parse_args()
    _BASELINE["path"] = args.baseline and os.path.abspath(args.baseline)
    os.makedirs(args.out, exist_ok=True)
    shapes = [("train", s) for s in args.train] + [("gen", s) for s in args.gen]
    runs = []
    for r in range(args.rounds):
        for kind, s in shapes:
            b, n = (int(x) for x in s.split("x"))
            for lib in args.libs:
                if f"{lib}:{kind}:{s}" in args.skip:
                    continue
                argv, key = command(lib, kind, b, n, args)
                value, secs = run_one(argv, key, args.timeout)
                rss = _peak_rss_of_last()
                runs.append(dict(round=r + 1, lib=lib, kind=kind, shape=s, value=value, peak_rss=rss, seconds=secs))
                shown = "failed" if value is None else f"{value:.0f}"
                print(f"round {r + 1} {kind} {s:>8} {lib:<9} {shown:>7} "
                      f"tok/s  peak RSS {rss / 2**30 if rss else 0:.2f} GiB  ({secs:.0f} s)", flush=True)
                json.dump(dict(runs=runs), open(os.path.join(args.out, "sweep.json"), "w"), indent=1)
    summary = summarize(runs, shapes, args.libs)
    json.dump(dict(runs=runs, summary=summary, cpu=cpu_model()), open(os.path.join(args.out, "sweep.json"), "w"),
              indent=1)
    for row in summary:
        print(json.dumps(row))
    if args.plot:
        extra = [row for f in args.also for row in json.load(open(f))["summary"]]
        plot(sorted(summary + extra, key=lambda r: (r["kind"], int(r["shape"].split("x")[1]))), args.plot)


_LAST = {}
_BASELINE = {}


def _peak_rss_of_last():
    return _LAST.pop("rss", None)


def _wait4_patch():
    """Record each child's own peak RSS (ru_maxrss, KiB on Linux) when subprocess reaps it."""

    def waitpid(pid, options):
        got, status, usage = os.wait4(pid, options)
        if got:
            _LAST["rss"] = usage.ru_maxrss * 1024
        return got, status

    os.waitpid = waitpid


def summarize(runs, shapes, libs):
    out = []
    for kind, s in shapes:
        row = dict(kind=kind, shape=s)
        for lib in libs:
            vals = [x["value"] for x in runs if (x["lib"], x["kind"], x["shape"]) == (lib, kind, s) and x["value"]]
            rss = [x["peak_rss"] for x in runs if (x["lib"], x["kind"], x["shape"]) == (lib, kind, s) and x["peak_rss"]]
            row[lib] = statistics.median(vals) if vals else None
            row[f"{lib}_peak_rss"] = max(rss) if rss else None
        for ref in ("torch", "tunix", "baseline"):  # same-round ratios, then their median
            ratios = []
            by = {(x["round"], x["lib"]): x["value"] for x in runs if (x["kind"], x["shape"]) == (kind, s)}
            for r in sorted({x["round"] for x in runs}):
                mine, theirs = by.get((r, "posttrain")), by.get((r, ref))
                if mine and theirs:
                    ratios.append(mine / theirs)
            row[f"vs_{ref}"] = statistics.median(ratios) if ratios else None
            row[f"vs_{ref}_rounds"] = [round(x, 3) for x in ratios]
        out.append(row)
    return out


def cpu_model():
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return None


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, kind in enumerate(("train", "gen")):
        rows = [r for r in summary if r["kind"] == kind]
        tokens = [int(r["shape"].split("x")[1]) for r in rows]
        for lib in LIBS:  # the baseline is not plotted
            pts = [(t, r[lib], r[f"{lib}_peak_rss"]) for t, r in zip(tokens, rows) if r.get(lib)]
            if not pts:
                continue
            xs, ys, ms = zip(*pts)
            axes[0, col].plot(xs, ys, "o-", label=lib)
            axes[1, col].plot(xs, [m / 2**30 if m else float("nan") for m in ms], "o-", label=lib)
        what = "sequence length (batch x length ~ const)" if kind == "train" else "prompt length (+ new tokens)"
        axes[0, col].set_title(("training tokens/s" if kind == "train" else "generation new tokens/s"))
        axes[1, col].set_title("peak resident memory of the process (GiB)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel(what)
            ax.legend()
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    _wait4_patch()
    main()
