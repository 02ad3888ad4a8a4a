"""Image rows (TRL's vision formats) through the data pipeline and SFT, against transformers.

A tiny random qwen3_vl folder (built as tests/test_vlm_qwen3vl.py builds its own) with a byte-level tokenizer that has
Qwen's special tokens, Qwen's chat template (TRL's copy, trl/chat_templates/qwen3_vl.jinja) and a Qwen2VL image
processor with 4-pixel patches. References: Qwen3VLProcessor (apply_chat_template + the processor call) for the ids,
pixels and grids; TRL's training template (its {% generation %} markers, transformers' assistant mask) and
Qwen3VLForConditionalGeneration's logits for the SFT loss."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import trl
from hf_models import qwen3_vl_model
from PIL import Image

from posttrain.data import load_examples, to_arrays
from posttrain.data.images import image_spec
from posttrain.errors import PosttrainError
from posttrain.losses import sft_loss
from posttrain.tokenizer import Tokenizer
from posttrain.vision import processor_settings
from posttrain.vision.batched import forward_rows

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
PAD, EOS, START, END, IMAGE, VIDEO = 256, 258, 259, 260, 261, 262  # the specials' ids after the 256 bytes
TEXT = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10_000.0, mrope_section=[2, 3, 3],
                                 mrope_interleaved=True), pad_token_id=PAD, bos_token_id=PAD, eos_token_id=EOS)
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")


def template(name):
    with open(os.path.join(TEMPLATES, name)) as f:
        return f.read()


def hf_tokenizer(chat_template):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Raw
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Raw(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat_template)


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                    max_pixels=4096, image_mean=[0.5] * 3, image_std=[0.5] * 3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = qwen3_vl_model(TEXT, VISION, image=IMAGE, video=VIDEO, start=START, end=END)
    path = os.fspath(tmp_path_factory.mktemp("qwen3_vl_data") / "hf")
    model.save_pretrained(path)
    hf_tokenizer(template("qwen3_vl.jinja")).save_pretrained(path)
    image_processor().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def processor():
    from transformers import Qwen3VLProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    video = BaseVideoProcessor()  # never used (no video here); Qwen3VLProcessor wants one, of a torchvision class
    video.merge_size, video.temporal_patch_size = 2, 2
    check = Qwen3VLProcessor.check_argument_for_proper_class
    Qwen3VLProcessor.check_argument_for_proper_class = lambda self, name, arg: type(arg)
    try:
        return Qwen3VLProcessor(image_processor=image_processor(), tokenizer=hf_tokenizer(template("qwen3_vl.jinja")),
                                video_processor=video, chat_template=template("qwen3_vl.jinja"))
    finally:
        Qwen3VLProcessor.check_argument_for_proper_class = check


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def spec(folder):
    from posttrain.models import load_config

    return image_spec(processor_settings(folder), load_config(folder).vision)


def user(*parts):
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


def assistant(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


SIZES = [(20, 28), (16, 16), (33, 18), (24, 40), (12, 30)]


def write_rows(tmp_path):
    """Five image rows in a JSONL file (images as PNG files beside it): 1 or 2 images, two turns, prompt/completion."""
    rng = np.random.default_rng(0)
    names = []
    for i, (h, w) in enumerate(SIZES):
        names.append(f"img{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / names[-1])
    rows = [
        {"messages": [user(None, "What is it?"), assistant("A cat.")], "images": [names[0]]},
        {"messages": [user("Compare ", None, " and ", None), assistant("The first is darker.")],
         "images": [names[1], names[2]]},
        {"messages": [user(None, "Colour?"), assistant("Red."), user("Sure?"), assistant("Yes, red.")],
         "images": [names[3]]},
        {"prompt": [user(None, "Describe it.")], "completion": [assistant("Noise, mostly.")], "images": [names[4]]},
        {"messages": [{"role": "user", "content": "No image here."}, {"role": "assistant", "content": "Fine."}]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def conversation(row):
    return row["messages"] if "messages" in row else row["prompt"] + row["completion"]


def reference(processor, row, base):
    """(ids, pixels, grids, assistant mask) from transformers: Qwen3VLProcessor's ids / pixels / grids, and the
    assistant mask of TRL's training template ({% generation %}) with each image token expanded as the processor
    expands it."""
    msgs = conversation(row)
    text = processor.apply_chat_template(msgs, tokenize=False)
    images = [Image.open(base / n) for n in row.get("images", [])]
    out = processor(text=[text], images=images or None, return_tensors="np")
    tok = hf_tokenizer(template("qwen3_vl_training.jinja"))
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    counts = iter([] if not images else out["image_grid_thw"].prod(1) // 4)
    mask = []
    for t, m in zip(enc["input_ids"], enc["assistant_masks"]):
        mask += [m] * (int(next(counts)) if t == IMAGE else 1)
    return out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), np.array(mask)


def test_encoding_matches_the_transformers_processor(tmp_path, processor, tok, spec):
    path, rows = write_rows(tmp_path)
    examples, counts = load_examples(path, tok, max_length=512, images=spec)
    assert counts["rows"] == 5 and len(examples) == 5
    for ex, row in zip(examples, rows):
        ids, pixels, grids, mask = reference(processor, row, tmp_path)
        np.testing.assert_array_equal(ex.ids, ids)
        if pixels is None:
            assert ex.pixels is None
            continue
        np.testing.assert_array_equal(ex.grids, grids)
        assert ex.pixels.shape == pixels.shape and np.abs(ex.pixels - pixels).max() <= 1e-6
        if "messages" in row:  # our incremental assistant mask (the template has no markers) equals TRL's
            np.testing.assert_array_equal(ex.loss_mask, mask)
    assert sum(int(e.ids.tolist().count(IMAGE) > 0) for e in examples) == 4


def test_bytes_and_datasets_image_dicts_in_parquet(tmp_path, processor, tok, spec):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, rows = write_rows(tmp_path)
    data = [(tmp_path / n).read_bytes() for n in rows[1]["images"]]
    for i, images in enumerate([data, [{"bytes": d, "path": "ignored.png"} for d in data]]):
        pq.write_table(pa.table({"messages": [rows[1]["messages"]], "images": [images]}), tmp_path / f"{i}.parquet")
        (ex,), _ = load_examples(tmp_path / f"{i}.parquet", tok, max_length=512, images=spec)
        ids, pixels, grids, _ = reference(processor, rows[1], tmp_path)
        np.testing.assert_array_equal(ex.ids, ids)
        assert np.abs(ex.pixels - pixels).max() <= 1e-6 and (ex.grids == grids).all()


@pytest.mark.parametrize("change,pattern", [
    (lambda r: {**r, "images": ["missing.png"]}, r"train.jsonl:1: images\[0\]: no such file"),
    (lambda r: {**r, "images": ["bad.png"]}, r"train.jsonl:1: image 0 \(.*bad.png\): not a readable image"),
    (lambda r: {**r, "images": ["img0.png", "img1.png"]}, r"train.jsonl:1: the row has 2 image"),
    (lambda r: {"prompt": "Describe", "completion": "it", "images": ["img0.png"]}, r"train.jsonl:1: .*conversational"),
], ids=["missing", "unreadable", "wrong-count", "string-prompt"])
def test_bad_images_name_the_file_and_line(tmp_path, tok, spec, change, pattern):
    path, rows = write_rows(tmp_path)
    (tmp_path / "bad.png").write_text("not a png")
    lines = [json.dumps(change(rows[0]))] + [json.dumps(r) for r in rows[1:]]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PosttrainError, match=pattern):
        load_examples(path, tok, max_length=512, images=spec)
    with pytest.warns(UserWarning, match="skipped 1 of 5 rows"):
        examples, counts = load_examples(path, tok, max_length=512, images=spec, skip_bad_rows=True)
    assert counts["skipped"] == 1 and len(examples) == 4


def test_image_rows_need_a_vision_model_and_are_never_cut(tmp_path, tok, spec):
    path, _ = write_rows(tmp_path)
    with pytest.raises(PosttrainError, match=r"train.jsonl:1: the row has images but the model is not"):
        load_examples(path, tok, max_length=512)
    with pytest.raises(PosttrainError, match=r"train.jsonl:1: the row is \d+ tokens long.*'drop'"):
        load_examples(path, tok, max_length=20, truncation="keep_start", images=spec)


def test_sft_loss_on_image_rows_equals_transformers(tmp_path, folder, processor, tok, spec):
    """sft_loss (sum and count) on a padded batch of image rows = masked cross-entropy over TRL's assistant tokens
    of Qwen3VLForConditionalGeneration's float32 logits, row by row (the prompt/completion row's one assistant
    message is its completion, so completion-only and assistant-only masks agree there)."""
    from transformers import Qwen3VLForConditionalGeneration

    from posttrain.models import from_pretrained

    path, rows = write_rows(tmp_path)
    examples, _ = load_examples(path, tok, max_length=512, images=spec)
    batch = to_arrays(examples, 128, PAD, False, spec.vision)
    ours = from_pretrained(folder)
    total, metrics = sft_loss(ours, {k: jnp.asarray(v) for k, v in batch.items()}, forward=forward_rows)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    want_total = want_count = 0.0
    for row in rows:
        ids, pixels, grids, mask = reference(processor, row, tmp_path)
        kw = {} if pixels is None else dict(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids))
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor(ids[None]), mm_token_type_ids=torch.tensor((ids == IMAGE)[None] * 1),
                        **kw).logits[0].double()
        nll = -torch.log_softmax(logits[:-1], -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        w = torch.tensor(mask[1:], dtype=torch.float64)
        want_total += float((nll * w).sum())
        want_count += float(w.sum())
    assert float(metrics["denom"]) == want_count
    assert abs(float(total) / want_count - want_total / want_count) <= 1e-5, (float(total) / want_count,
                                                                              want_total / want_count)


def sft_config(folder, path, run_dir, train_vision):
    from posttrain import config as C

    return C.from_dict(C.SFTConfig, {
        "model": {"path": folder, "train_vision": train_vision},
        "data": {"train": str(path), "max_length": 128, "shuffle": False},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "train": {"steps": 6, "batch_size": 5, "log_every": 1}, "checkpoint": {"async_save": False},
        "metrics": {"sinks": ["jsonl"]}, "run_dir": str(run_dir)})


@pytest.mark.parametrize("train_vision", [False, True], ids=["tower-frozen", "train-vision"])
def test_sft_recipe_on_image_rows_learns_and_freezes_the_tower(tmp_path, folder, train_vision):
    from flax import nnx

    from posttrain.models import from_pretrained
    from posttrain.trainers.sft import SFTTrainer

    path, _ = write_rows(tmp_path)
    trainer = SFTTrainer(sft_config(folder, path, tmp_path / "run", train_vision), progress=False)
    result = trainer.train()
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses
    before = nnx.state(from_pretrained(folder).vision, nnx.Param)
    after = nnx.state(trainer.model.vision, nnx.Param)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax_leaves(before), jax_leaves(after)))
    assert (moved > 1e-4) if train_vision else (moved == 0.0), moved
    text_moved = float(jnp.abs(from_pretrained(folder).lm_head[...] - trainer.model.lm_head[...]).max())
    assert text_moved > 1e-4 and result["first_loss"] == pytest.approx(losses[0], rel=1e-4)


def jax_leaves(state):
    import jax

    return jax.tree_util.tree_leaves(state)


def test_a_datasets_folder_with_an_image_column(tmp_path, processor, tok, spec):
    import datasets

    path, rows = write_rows(tmp_path)
    ds = datasets.Dataset.from_dict({"messages": [rows[1]["messages"]],
                                     "images": [[str(tmp_path / n) for n in rows[1]["images"]]]})
    ds = ds.cast_column("images", datasets.Sequence(datasets.Image()))
    ds.save_to_disk(str(tmp_path / "ds"))
    (ex,), _ = load_examples(tmp_path / "ds", tok, max_length=512, images=spec)
    ids, pixels, grids, _ = reference(processor, rows[1], tmp_path)
    np.testing.assert_array_equal(ex.ids, ids)
    assert np.abs(ex.pixels - pixels).max() <= 1e-6 and (ex.grids == grids).all()


def test_the_cli_exits_2_naming_the_line_of_a_missing_image(tmp_path, folder, capsys):
    import yaml

    from posttrain.cli import main

    path, rows = write_rows(tmp_path)
    path.write_text(json.dumps(rows[4]) + "\n" + json.dumps({**rows[0], "images": ["gone.png"]}) + "\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": folder}, "data": {"train": str(path), "max_length": 128},
                                   "train": {"steps": 1, "batch_size": 1}, "run_dir": str(tmp_path / "run")}))
    assert main(["sft", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: images[0]: no such file" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
