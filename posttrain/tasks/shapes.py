"""Shapes: a built-in image task ("How many squares?") for vision-language post-training, and a tiny random Qwen3-VL.

What it is: from one seed, small RGB images drawn with PIL (`size` x `size` pixels, black, cut into a `grid` x `grid`
board of cells; `count` of the cells hold a filled square of a random colour from `PALETTE`, at one of 4 places
within the cell), each asked "How many squares?" with the count (one digit) as the answer. The rows are TRL's vision
formats, with the image as a PIL image in `images` (in memory; `write_rows(rows, path)` saves them as PNG files
beside a JSONL file, relative paths):
  sft_train / sft_eval    {"prompt": [user: image + question], "completion": [assistant: "3"], "images": [image]}
  prompts / eval_prompts  {"prompt": [user: image + question], "images": [image], "answer": "3"}  (`last_number`)
  pairs / eval_pairs      {"prompt", "chosen": [assistant: "3"], "rejected": [assistant: a wrong count], "images"}
The held-out split is by the drawing (which cells, colours and places): no held-out image occurs in any training row.
`verify(row, completion)` is the `last_number` reward's check (the completion's last number equals "answer").

`noise` (a knob, default 0): the fraction of the SFT completions of pictures of `noisy_from` (default 4) or more
squares that are a careless annotator's count, one more than the truth (sft_train only; the RL rows, the pairs and
sft_eval keep the true count). With noise above one half (`DEMO`: 0.7 from 4 squares) a model that imitates the
SFT rows answers count + 1 greedily there, yet samples the true count often: the room that GRPO, rewarded by the
exact count, closes (tests/test_vlm_learning.py; the text demo's partial SFT plays that part there).

`write_model(path, seed=0)` writes a tiny random `qwen3_vl` folder that reads these images (4-pixel patches: a
32 x 32 image is 64 patches, 16 image tokens; with 8-pixel patches, 4 image tokens, the from-scratch SFT found the
count later and by seed: 250-300 steps for seed 1, stuck at the label prior at 200), with a byte-level tokenizer
that has Qwen's special tokens, a Qwen chat template and a Qwen2-VL image processor file: the from-scratch model of
the learning test and configs/vlm_shapes_*.yaml. No torch, no downloads.

What it is not: a general image-question generator, or a benchmark of real vision models.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.tasks.arithmetic import verify
from posttrain.tasks.base import TaskData, resolve_difficulty, sample_unique

DEFAULTS = {"size": 32, "grid": 4, "min_count": 1, "max_count": 5, "noise": 0.0, "noisy_from": 4}
LEVELS = {
    1: {"grid": 4, "max_count": 3},
    2: {"grid": 4, "max_count": 5},
    3: {"grid": 4, "max_count": 8},
}
PALETTE = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (240, 220, 40),
           "white": (245, 245, 245), "cyan": (40, 220, 230), "magenta": (220, 50, 220), "orange": (250, 150, 30)}
QUESTION = "How many squares?"
# the demo's and the learning test's rows: counts 1..5; 70 % of the pictures of 4 or 5 squares are labelled one too
# many in the SFT rows (tests/test_vlm_learning.py)
DEMO = {"noise": 0.7, "noisy_from": 4}


def _check(p: dict) -> None:
    if not (isinstance(p["grid"], int) and 1 <= p["grid"] <= 8):
        raise PosttrainError(f"shapes: grid must be an int in 1..8, got {p['grid']!r}")
    if not (isinstance(p["size"], int) and p["size"] >= 4 * p["grid"]):
        raise PosttrainError(f"shapes: size must be an int of at least 4 pixels per cell ({4 * p['grid']}), "
                             f"got {p['size']!r}")
    cells = p["grid"] ** 2
    if not (isinstance(p["min_count"], int) and isinstance(p["max_count"], int)
            and 0 <= p["min_count"] <= p["max_count"] <= min(cells, 9)):
        raise PosttrainError(f"shapes: need 0 <= min_count <= max_count <= min(grid*grid, 9) = {min(cells, 9)}, "
                             f"got {p['min_count']!r}..{p['max_count']!r}")
    if not (isinstance(p["noise"], (int, float)) and 0.0 <= p["noise"] <= 1.0):
        raise PosttrainError(f"shapes: noise must be a fraction in 0..1, got {p['noise']!r}")
    if not isinstance(p["noisy_from"], int):
        raise PosttrainError(f"shapes: noisy_from must be an int (the smallest count the noise touches), got "
                             f"{p['noisy_from']!r}")


def draw(cells: dict, p: dict):
    """The image of {cell index: (colour name, x, y, side)}: black, each square at (x, y) pixels within its cell."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (p["size"], p["size"]))
    pen = ImageDraw.Draw(img)
    cell_px = p["size"] // p["grid"]
    for cell, (colour, x, y, side) in cells.items():
        r, c = divmod(cell, p["grid"])
        x0, y0 = c * cell_px + x, r * cell_px + y
        pen.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=PALETTE[colour])
    return img


def _square(rng: random.Random, p: dict) -> tuple:
    """(colour, x, y, side): a square of 5/8 of its cell, 1 or 2 eighths of the cell from its top left corner."""
    cell_px = p["size"] // p["grid"]
    side, step = max(1, cell_px * 5 // 8), max(1, cell_px // 8)
    return rng.choice(sorted(PALETTE)), step * rng.randint(1, 2), step * rng.randint(1, 2), side


def _instance(rng: random.Random, p: dict):
    count = rng.randint(p["min_count"], p["max_count"])
    cells = {c: _square(rng, p) for c in sorted(rng.sample(range(p["grid"] ** 2), count))}
    return tuple(cells.items()), {"cells": cells, "answer": str(count)}


def user(question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def make(difficulty: Any = 2, *, seed: int = 0, n_eval: int = 200, n_train: int = 2000) -> TaskData:
    """`n_train` training and `n_eval` held-out images at `difficulty` (a LEVELS key or a dict of knobs), distinct
    drawings; the same seed gives the same rows (and the same SFT noise)."""
    p = resolve_difficulty("shapes", difficulty, LEVELS, DEFAULTS)
    _check(p)
    rng = random.Random(seed)
    insts = sample_unique(rng, lambda: _instance(rng, p), n_eval + n_train, task="shapes")
    noise = random.Random(seed + 1)
    for inst in insts:
        inst["image"] = draw(inst["cells"], p)

    def sft(rows, noisy):
        out = []
        for r in rows:
            n = int(r["answer"])
            said = str(n + 1) if noisy and n >= p["noisy_from"] and noise.random() < p["noise"] else r["answer"]
            out.append({"prompt": user(), "completion": assistant(said), "images": [r["image"]]})
        return out

    def rl(rows):
        return [{"prompt": user(), "images": [r["image"]], "answer": r["answer"]} for r in rows]

    def pairs(rows):
        wrong = random.Random(seed + 2)
        out = []
        for r in rows:
            n = int(r["answer"])
            bad = wrong.choice([k for k in (n - 1, n + 1) if 0 <= k <= 9])
            out.append({"prompt": user(), "chosen": assistant(r["answer"]), "rejected": assistant(str(bad)),
                        "images": [r["image"]]})
        return out

    train, held = insts[n_eval:], insts[:n_eval]
    return TaskData(name="shapes", sft_train=sft(train, True), sft_eval=sft(held, False), prompts=rl(train),
                    eval_prompts=rl(held), pairs=pairs(train), eval_pairs=pairs(held), verify=verify,
                    reward="last_number", params=dict(p))


def write_rows(rows: list[dict], path: str) -> str:
    """Write `rows` as JSONL at `path`, each PIL image in `images` saved as a PNG under `<path's folder>/images/`
    and replaced by its relative path (what `data.train` / `data.eval` read)."""
    base = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    os.makedirs(os.path.join(base, "images"), exist_ok=True)
    with open(path, "w") as fh:
        for i, row in enumerate(rows):
            names = []
            for j, img in enumerate(row["images"]):
                names.append(f"images/{stem}-{i}-{j}.png")
                img.save(os.path.join(base, names[-1]))
            fh.write(json.dumps({**row, "images": names}) + "\n")
    return path


# ----------------------------------------------------------------------------- the tiny random Qwen3-VL

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
# Qwen's chat layout, user / assistant / system turns with image parts (TRL's qwen3_vl.jinja without tools or
# video); {% generation %} marks the assistant replies (assistant_only_loss).
CHAT_TEMPLATE = (
    "{%- macro content(message) %}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{% generation %}{{- content(message) }}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- content(message) }}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tokenizer(path: str) -> None:
    """A 263-token byte-level tokenizer (256 bytes, then SPECIALS: pad <|endoftext|>, eos <|im_end|>) with
    CHAT_TEMPLATE, as tokenizer.json + tokenizer_config.json + chat_template.jinja."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Raw

    from posttrain.tokenizer import bytes_to_unicode

    raw = Raw(models.BPE(vocab={ch: b for b, ch in bytes_to_unicode().items()}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    os.makedirs(path, exist_ok=True)
    raw.save(os.path.join(path, "tokenizer.json"))
    cfg = {"backend": "tokenizers", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "model_max_length": 512, "tokenizer_class": "TokenizersBackend"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    with open(os.path.join(path, "chat_template.jinja"), "w") as fh:
        fh.write(CHAT_TEMPLATE)


def model_config(vocab_size: int = 263, patch_size: int = 4) -> dict:
    """config.json of the tiny qwen3_vl: a 2-layer, 64-wide text model; a 2-block, 32-wide tower."""
    ids = {name: 256 + SPECIALS.index(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10_000.0,
                                                        mrope_section=[2, 3, 3], mrope_interleaved=True),
                pad_token_id=256, bos_token_id=256, eos_token_id=258, tie_word_embeddings=False,
                model_type="qwen3_vl_text")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=patch_size,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0], model_type="qwen3_vl_vision")
    return dict(model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"], text_config=text,
                vision_config=vision, tie_word_embeddings=False, **ids)


def processor_config(patch_size: int = 4) -> dict:
    """preprocessor_config.json: a Qwen2-VL image processor (images of 256..4096 pixels keep their size when it is
    a multiple of 2 patches), mean and std 0.5."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch_size, "temporal_patch_size": 2,
            "merge_size": 2, "min_pixels": 256, "max_pixels": 4096, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}


def write_model(path: str, seed: int = 0, patch_size: int = 4) -> str:
    """A tiny random-init qwen3_vl folder at `path` (posttrain's initialisation, `seed`), with write_tokenizer's
    tokenizer and processor_config's image processor; returns `path`."""
    import tempfile

    from flax import nnx

    from posttrain.models import Transformer, load_config, save_pretrained
    from posttrain.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(model_config(patch_size=patch_size), fh)
        write_tokenizer(tmp)
        cfg, tok = load_config(tmp), Tokenizer.from_pretrained(tmp)
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
        for _, w in nnx.iter_graph(model.vision):  # the tower's matrices at std 1 / sqrt(fan in), not 0.02
            if isinstance(w, nnx.Param) and w[...].ndim == 2 and w is not model.vision.pos_embed:
                w[...] = w[...] * (w[...].shape[0] ** -0.5 / 0.02)
        save_pretrained(model, path, tokenizer=tok)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as fh:
        json.dump(processor_config(patch_size), fh, indent=2)
    return path


# ----------------------------------------------------------------------------- a run's files, and its score


def write_all(out: str, *, seed: int = 0, difficulty: Any = None, n_train: int = 1000, n_eval: int = 200) -> TaskData:
    """What configs/vlm_shapes_*.yaml read, under `out`: data/train.jsonl (SFT rows, with the noise),
    data/prompts.jsonl (GRPO prompts of the same pictures), data/eval.jsonl (held-out prompts) with their PNG
    files, and init/ (write_model). `difficulty` defaults to DEMO (the learning test's)."""
    data = make(DEMO if difficulty is None else difficulty, seed=seed, n_eval=n_eval, n_train=n_train)
    write_rows(data.sft_train, os.path.join(out, "data", "train.jsonl"))
    write_rows(data.prompts, os.path.join(out, "data", "prompts.jsonl"))
    write_rows(data.eval_prompts, os.path.join(out, "data", "eval.jsonl"))
    write_model(os.path.join(out, "init"), seed=seed)
    return data


class Greedy:
    """Greedy accuracy of a model on a prompts file (`verify` against each row's "answer"), read with `folder`'s
    tokenizer and image processor; 25 prompts per call (the tower compiles once per number of images), one
    Sampler for every model of the same shape (`update`)."""

    def __init__(self, prompts_path: str, folder: str, chunk: int = 25):
        from posttrain.data.images import image_spec
        from posttrain.data.prompts import load_prompts
        from posttrain.models import load_config
        from posttrain.tokenizer import Tokenizer
        from posttrain.vision import processor_settings

        self.tok, self.chunk, self.sampler = Tokenizer.from_pretrained(folder), chunk, None
        spec = image_spec(processor_settings(folder), load_config(folder).vision)
        self.prompts, _ = load_prompts(prompts_path, self.tok, max_prompt_length=512, images=spec)

    def __call__(self, model) -> tuple[float, list[str]]:
        """(accuracy, the greedy answers in file order)."""
        from posttrain.generate import Sampler, SamplingParams
        from posttrain.rl.images import sampler_images

        if self.sampler is not None and self.sampler.cfg == model.cfg:
            self.sampler.update(model)
        else:
            self.sampler = Sampler(model, max_len=max(len(p.ids) for p in self.prompts) + 4, pad_id=self.tok.pad_id)
        params = SamplingParams(max_new_tokens=3, temperature=0.0, stop_ids=self.tok.eos_ids)
        texts = []
        for i in range(0, len(self.prompts), self.chunk):
            part = self.prompts[i:i + self.chunk]
            texts += self.sampler.generate([p.ids for p in part], params, images=sampler_images(part)).texts(self.tok)
        right = [verify(p.columns, t) for p, t in zip(self.prompts, texts)]
        return sum(right) / len(right), texts


def main(argv=None) -> int:
    """`python -m posttrain.tasks.shapes data OUT [--seed N]` writes write_all's files; `... score FOLDER EVAL.jsonl`
    prints the greedy accuracy of a Hugging Face folder on a prompts file."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m posttrain.tasks.shapes", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="the task's rows, pictures and a tiny random qwen3_vl folder under OUT")
    d.add_argument("out")
    d.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("score", help="greedy accuracy of a model folder on a prompts file")
    s.add_argument("folder")
    s.add_argument("prompts")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "data":
            write_all(args.out, seed=args.seed)
            print(f"wrote {args.out}/data/{{train,prompts,eval}}.jsonl and the model folder {args.out}/init")
        else:
            from posttrain.models import from_pretrained

            acc, _ = Greedy(args.prompts, args.folder)(from_pretrained(args.folder))
            print(f"greedy accuracy {acc:.3f} on {args.prompts}")
    except PosttrainError as err:
        print(f"error: {err}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
