#!/usr/bin/env python
"""Vision-language speed on CPU (issue #52): a tiny random Qwen3-VL, posttrain against transformers + PyTorch in
ONE process, interleaved rounds (posttrain, transformers, posttrain, ...; median of --rounds per side).

  train:    one SFT step on the same batch of image rows (float32, AdamW lr 1e-4, loss on the text after each
            row's images, the vision tower frozen as posttrain's SFT default; --train-vision trains it on both
            sides): posttrain's `make_train_step` with `sft_loss` + `vision.batched.forward_rows` against
            Qwen3VLForConditionalGeneration forward + backward + torch.optim.AdamW.step. tokens/s = batch * seq / step.
  generate: greedy, --gen-batch prompts (each: text, its images, text), exactly --new new tokens: posttrain's
            `Sampler.generate(images=[ImageInputs])` against transformers' `generate(use_cache=True,
            do_sample=False, min_new_tokens=new)` on the same ids and pixels. new tokens/s = batch * new / call.

Both sides get the same preprocessed pixels (posttrain.vision.qwen_vl_patches; its time is reported apart as
`preprocess_s_per_image`). Compile / first-call times are excluded from the rates and reported. The first steps'
losses and the greedy tokens of both sides are reported too (same work: they agree to float32 rounding).
`peak_rss_bytes` is this process's peak (both libraries loaded); --rss-per-side adds each side's own peak, from a
child process running that side alone (`--only posttrain|hf`).

Usage: .venv/bin/python benchmarks/vlm.py --threads 2 --json out.json [--rounds 3] [--dry-run]
"""

import copy
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import med, parse_args, write  # noqa: E402

args = parse_args([
    (("--rounds",), dict(type=int, default=3)), (("--steps",), dict(type=int, default=3)),
    (("--gen-batch",), dict(type=int, default=4)),
    (("--images",), dict(default="224x224", help="HxW sizes in pixels, one image per row, cycled over the rows")),
    (("--vision-hidden",), dict(type=int, default=256)), (("--vision-depth",), dict(type=int, default=4)),
    (("--vision-heads",), dict(type=int, default=4)), (("--patch",), dict(type=int, default=16)),
    (("--train-vision",), dict(action="store_true")), (("--only",), dict(choices=("posttrain", "hf"), default=None)),
    (("--rss-per-side",), dict(action="store_true")),
    (("--profile",), dict(default=None, help="a folder: after the rounds, trace 3 posttrain train steps there with "
                                            "jax.profiler and add each thread's busiest ops to the JSON")),
    (("--dry-run",), dict(action="store_true", help="a minimal size, one round: the code path only (tests)"))])
if args.dry_run:
    args.rounds, args.steps, args.reps, args.batch, args.seq, args.gen_batch, args.new = 1, 1, 1, 2, 48, 2, 4
    args.vocab, args.layers, args.hidden, args.heads, args.kv_heads, args.mlp = 256, 1, 64, 2, 2, 96
    args.vision_hidden, args.vision_depth, args.vision_heads, args.images = 32, 2, 2, "64x64"
if args.new == 128 and not args.dry_run:
    args.new = 64  # this benchmark's default (common.py's is the text anchors' 128)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

import posttrain  # noqa: E402,F401  (before any JAX backend starts: its CPU XLA defaults)
from posttrain.data.pipeline import Example, to_arrays  # noqa: E402
from posttrain.generate import ImageInputs, Sampler, SamplingParams  # noqa: E402
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import count_params, from_pretrained  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402
from posttrain.vision import qwen_vl_image_tokens, qwen_vl_patches  # noqa: E402
from posttrain.vision.batched import forward_rows  # noqa: E402

IMAGE, VIDEO, START, END = 5, 6, 3, 4  # special ids; text ids are drawn from [8, vocab)


def build_folder(path: str) -> None:
    """A tiny random Qwen3VLForConditionalGeneration (float32, untied head) saved with save_pretrained."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    hd = args.hidden // args.heads
    hw = hd // 2 * 5 // 16  # M-RoPE sections (t, h, w) over the hd / 2 frequencies, Qwen's 24:20:20 shape
    section = [hd // 2 - 2 * hw, hw, hw]
    text = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=hd, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=10_000.0, mrope_section=section,
                                     mrope_interleaved=True), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=args.vision_depth, hidden_size=args.vision_hidden, intermediate_size=4 * args.vision_hidden,
                  num_heads=args.vision_heads, patch_size=args.patch, temporal_patch_size=2, spatial_merge_size=2,
                  out_hidden_size=args.hidden, num_position_embeddings=256,
                  deepstack_visual_indexes=list(range(min(3, args.vision_depth - 1))))
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)
    Qwen3VLForConditionalGeneration(config).float().save_pretrained(path)


def fail(msg: str):
    print(f"benchmarks/vlm.py: {msg}", file=sys.stderr)
    sys.exit(2)


def image_inputs(rng, count: int):
    """`count` random RGB images of the --images sizes (cycled), through posttrain's preprocessing."""
    from PIL import Image

    try:
        sizes = [tuple(int(v) for v in s.split("x", 1)) for s in args.images.split(",")]
    except ValueError:
        fail(f"--images {args.images!r}: give HxW sizes in pixels, comma separated (e.g. 224x224,160x320)")
    ims = [Image.fromarray(rng.integers(0, 256, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(count)]
    kw = dict(patch_size=args.patch, merge_size=2, min_pixels=args.patch ** 2 * 4, max_pixels=2048 * 2048)
    out = [qwen_vl_patches(im, **kw) for im in ims]
    t0 = time.perf_counter()
    qwen_vl_patches(ims, **kw)
    return out, (time.perf_counter() - t0) / count


def image_row(rng, grids, length: int):
    """[text, start, image tokens, end, text ...] ids of exactly `length` tokens (loss on what follows the image)."""
    n = int(qwen_vl_image_tokens(grids).sum())
    head = [1] + rng.integers(8, args.vocab, 7).tolist() + [START] + [IMAGE] * n + [END]
    if len(head) >= length:
        fail(f"--seq {length} is too short for a row with an image of {n} tokens; raise --seq or use smaller --images")
    return head + rng.integers(8, args.vocab, length - len(head)).tolist(), len(head)


def rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak resident memory since its exec (VmHWM; ru_maxrss would count the forking parent's)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


class Ours:
    """posttrain's side: the SFT step and the Sampler."""

    def __init__(self, folder, train_rows, gen_prompts):
        model = from_pretrained(folder)
        self.n_params = count_params(model)
        opt = optax.adamw(1e-4)
        tower = nnx.All(nnx.Param, nnx.PathContains("vision"))
        trainable = nnx.Param if args.train_vision else nnx.All(nnx.Param, nnx.Not(tower))  # recipes.build's
        self.graphdef, self.state = init_state(model, opt, trainable=trainable)
        self.step = make_train_step(lambda m, b, **kw: sft_loss(m, b, forward=forward_rows, **kw), opt,
                                    self.graphdef, trainable=trainable)
        examples = [Example(ids=np.array(ids, np.int32), loss_mask=np.array(mask, np.int32), where=f"row {i}",
                            pixels=p, grids=g) for i, (ids, mask, p, g) in enumerate(train_rows)]
        self.batch = {k: jnp.asarray(v) for k, v in to_arrays(examples, args.seq, 0, False, model.cfg.vision).items()}
        self.patches = int(self.batch["pixels"].shape[1])
        # its own copy of the weights: the train step donates (deletes) the state's arrays
        self.sampler = Sampler(from_pretrained(folder), max_len=max(len(p[0]) for p in gen_prompts) + args.new)
        self.prompts = [p[0] for p in gen_prompts]
        self.images = [ImageInputs(grids=g, pixels=p) for _, p, g in gen_prompts]
        self.greedy = SamplingParams(max_new_tokens=args.new, temperature=0.0)

    def train(self, steps):
        for _ in range(steps):
            self.state, m = self.step(self.state, self.batch)
        return float(jax.block_until_ready(m["loss"]))  # the step divides by denom

    def generate(self):
        out = self.sampler.generate(self.prompts, self.greedy, images=self.images)
        assert (np.asarray(out.lengths) == args.new).all()
        return np.asarray(out.tokens)


class Theirs:
    """transformers + PyTorch: forward + backward + AdamW, and generate."""

    def __init__(self, folder, train_rows, gen_prompts):
        from transformers import Qwen3VLForConditionalGeneration

        self.model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
        self.sampler = copy.deepcopy(self.model).eval()  # generate keeps the initial weights, as posttrain's Sampler
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if not args.train_vision:
            self.model.model.visual.requires_grad_(False)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.tensor([r[0] for r in train_rows])
        labels = torch.where(torch.tensor([r[1] for r in train_rows]) == 1, ids, -100)
        self.batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                          mm_token_type_ids=(ids == IMAGE).long(),
                          pixel_values=torch.tensor(np.concatenate([r[2] for r in train_rows])),
                          image_grid_thw=torch.tensor(np.concatenate([r[3] for r in train_rows])))
        gids = torch.tensor([p[0] for p in gen_prompts])  # equal lengths: no padding
        self.gen_kw = dict(input_ids=gids, attention_mask=torch.ones_like(gids),
                           mm_token_type_ids=(gids == IMAGE).long(),
                           pixel_values=torch.tensor(np.concatenate([p[1] for p in gen_prompts])),
                           image_grid_thw=torch.tensor(np.concatenate([p[2] for p in gen_prompts])),
                           max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, use_cache=True,
                           pad_token_id=0)

    def train(self, steps):
        self.model.train()
        for _ in range(steps):
            loss = self.model(**self.batch).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return float(loss.item())

    def generate(self):
        with torch.inference_mode():
            out = self.sampler.generate(**self.gen_kw)
        return out[:, self.gen_kw["input_ids"].shape[1]:].numpy()


def timed(fn, *a):
    t0 = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t0, out


def main():
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        build_folder(tmp)
        per_row = len(args.images.split(","))
        imgs, prep = image_inputs(rng, args.batch + args.gen_batch)
        train_rows = []
        for p, g in imgs[:args.batch]:
            ids, head = image_row(rng, g, args.seq)
            train_rows.append((ids, [0] * head + [1] * (len(ids) - head), p, g))
        gen_prompts = [(image_row(rng, g, int(qwen_vl_image_tokens(g).sum()) + 18)[0], p, g)
                       for p, g in imgs[args.batch:]]
        sides = {"posttrain": Ours, "hf": Theirs}
        names = [args.only] if args.only else list(sides)
        res = {"jax": jax.__version__, "torch": torch.__version__, "threads": args.threads,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "dry_run": args.dry_run, "train_vision": args.train_vision,
               "shape": dict(vocab=args.vocab, layers=args.layers, hidden=args.hidden, heads=args.heads,
                             kv_heads=args.kv_heads, mlp=args.mlp, vision_depth=args.vision_depth,
                             vision_hidden=args.vision_hidden, vision_heads=args.vision_heads, patch=args.patch,
                             images=args.images, images_per_row=1, batch=args.batch, seq=args.seq,
                             gen_batch=args.gen_batch, prompt=len(gen_prompts[0][0]), new=args.new,
                             image_tokens=int(qwen_vl_image_tokens(imgs[0][1]).sum()), dtype="float32"),
               "preprocess_s_per_image": prep, "image_sizes_cycled": per_row}
        libs, first, loss0, tokens0 = {}, {}, {}, {}
        for n in names:
            before = rss_now()
            libs[n] = sides[n](tmp, train_rows, gen_prompts)
            first[n + "_train_first_step_s"], loss0[n] = timed(libs[n].train, 1)
            first[n + "_gen_first_call_s"], tokens0[n] = timed(libs[n].generate)
            res[n + "_rss_added_bytes"] = rss_now() - before
            res[n + "_n_params"] = int(libs[n].n_params)
        res.update(first)
        res["first_step_loss"] = loss0
        if "posttrain" in libs:
            res["posttrain_patches_per_row"] = libs["posttrain"].patches
        if len(libs) == 2:
            a, b = tokens0["posttrain"], tokens0["hf"]
            res["greedy_tokens_equal_fraction"] = float((a == b).mean())
            res["greedy_first_difference"] = int(np.argmax((a != b).any(0))) if (a != b).any() else None
        times = {f"{n}_{k}": [] for n in libs for k in ("train", "gen")}
        for r in range(args.rounds):
            for n, lib in libs.items():
                times[f"{n}_train"].append(timed(lib.train, args.steps)[0] / args.steps)
            for n, lib in libs.items():
                times[f"{n}_gen"].append(timed(lib.generate)[0])
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
        for n in libs:
            st, sg = med(times[f"{n}_train"]), med(times[f"{n}_gen"])
            res[f"{n}_train_step_s"], res[f"{n}_gen_call_s"] = st, sg
            res[f"{n}_train_tok_s"] = args.batch * args.seq / st["median"]
            res[f"{n}_gen_tok_s"] = args.gen_batch * args.new / sg["median"]
            print(f"[{n}] train {res[f'{n}_train_tok_s']:.0f} tok/s (step {st['median'] * 1e3:.0f} ms, first "
                  f"{first[n + '_train_first_step_s']:.1f} s); generate {res[f'{n}_gen_tok_s']:.0f} new tok/s "
                  f"(call {sg['median']:.3f} s, first {first[n + '_gen_first_call_s']:.1f} s)", flush=True)
        if len(libs) == 2:
            res["train_ratio"] = res["posttrain_train_tok_s"] / res["hf_train_tok_s"]
            res["gen_ratio"] = res["posttrain_gen_tok_s"] / res["hf_gen_tok_s"]
            print(f"SUMMARY train {res['train_ratio']:.2f}x (bar 1.0), generate {res['gen_ratio']:.2f}x (bar 2.0); "
                  f"first-step losses {loss0}; greedy tokens equal {res['greedy_tokens_equal_fraction']:.0%}",
                  flush=True)
        if args.profile and "posttrain" in libs:
            with jax.profiler.trace(args.profile):
                libs["posttrain"].train(3)
            res["posttrain_profile"] = thread_ops(args.profile)
    res["peak_rss_bytes"] = peak_rss()
    if args.rss_per_side and not args.only:
        for n in libs:
            res[f"{n}_alone_peak_rss_bytes"] = alone_rss(n)
    write(res, args.json)


def thread_ops(folder: str, top: int = 25) -> dict:
    """Per thread (a host plane's line) of the newest trace in `folder`: its busy ms (the sum of its events) and its
    `top` longest ops by total ms, as [name, count, total ms]; threads with under 1 ms left out."""
    import glob

    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    out = {}
    for plane in ProfileData.from_file(max(files, key=os.path.getmtime)).planes:
        for line in plane.lines:
            agg = {}
            for e in line.events:
                a = agg.setdefault(e.name, [0, 0.0])
                a[0] += 1
                a[1] += e.duration_ns / 1e6
            busy = sum(v[1] for v in agg.values())
            if busy >= 1.0:
                rows = sorted(([k, c, round(ms, 2)] for k, (c, ms) in agg.items()), key=lambda r: -r[2])[:top]
                out[f"{plane.name} / {line.name}"] = {"busy_ms": round(busy, 1), "ops": rows}
    return out


def alone_rss(side: str) -> int:
    """Peak RSS of a child running this benchmark for one side only, one round (its own VmHWM, from its JSON)."""
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [sys.executable, os.path.abspath(__file__), "--only", side, "--rounds", "1", "--json", out]
    skip = {"--json", "--rounds", "--only"}
    argv = sys.argv[1:]
    i = 0
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        if argv[i] != "--rss-per-side":
            cmd.append(argv[i])
        i += 1
    code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    if code != 0:
        fail(f"the --only {side} child (for --rss-per-side) failed with exit {code}; run it alone to see why")
    with open(out) as fh:
        peak = json.load(fh)["peak_rss_bytes"]
    os.unlink(out)
    return peak


if __name__ == "__main__":
    main()
