"""Packed image rows (several examples in one row: segment ids, positions restarting per segment) against
transformers run on each example alone, for both vision-language families, and SFT with data.packing on image rows.

Qwen3-VL: test_vlm_data.py's tiny folder (tokenizer, chat template, image processor) and its five rows (1 and 2
images of different sizes, a text-only row) through `load_examples` / `to_arrays(packing=True)` /
`vision.batched.forward_rows`: each segment's M-RoPE positions come from its own rope_index. Gemma 3:
test_vlm_gemma3.py's tiny folder, examples with 1 and 2 images laid out one after another in a row (each image block
bidirectional within its own image; segments apart). The reference is always transformers' float32 logits of one
example alone (no padding, no packing); an example's encoding against the processors is test_vlm_data.py's.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_vlm_gemma3 as g3
import torch
from flax import nnx
from hf_models import gemma3_vl_model
from test_vlm_data import IMAGE as QWEN_IMAGE
from test_vlm_data import PAD, folder, spec, tok, write_rows  # noqa: F401 (fixtures)
from test_vlm_gemma3 import IMAGE as GEMMA_IMAGE
from test_vlm_gemma3 import MM
from test_vlm_gemma3 import hf_logits as gemma_hf_logits
from test_vlm_gemma3 import images as gemma_images
from test_vlm_gemma3 import row as gemma_row

from posttrain.data import load_examples, to_arrays
from posttrain.losses import sft_loss
from posttrain.models import attention as attention_module
from posttrain.vision.batched import forward_rows
from posttrain.vision.preprocess import gemma3_pixels

TOL = 1e-4  # of the logit range


def check(got, want, what):
    err, scale = float(np.abs(got - want).max()), float(np.ptp(want))
    print(f"{what}: max |difference| {err:.2e}, logit range {scale:.2f}")
    assert err <= TOL * scale, (what, err, scale)
    return err


@pytest.fixture(scope="module")
def qwen(folder):  # noqa: F811
    from posttrain.models import from_pretrained

    return from_pretrained(folder)


@pytest.fixture(scope="module")
def qwen_hf(folder):  # noqa: F811
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def qwen_alone(hf, ex):
    """transformers' float32 logits [n, V] of one example alone."""
    ids = torch.tensor(ex.ids[None], dtype=torch.long)
    kw = {} if ex.pixels is None else dict(pixel_values=torch.tensor(ex.pixels),
                                           image_grid_thw=torch.tensor(ex.grids))
    with torch.no_grad():
        return hf(input_ids=ids, mm_token_type_ids=(ids == QWEN_IMAGE).long(), **kw).logits[0].numpy()


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """test_vlm_gemma3.py's tiny folder (its fixture's `folder` name is the Qwen3-VL folder's here)."""
    torch.manual_seed(0)
    model = gemma3_vl_model(g3.TEXT, g3.VISION, mm_tokens=MM, image=GEMMA_IMAGE, boi=g3.BOI, eoi=g3.EOI)
    path = str(tmp_path_factory.mktemp("gemma3_vl") / "hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_hf(gemma_folder):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(gemma_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma_model(gemma_folder):
    from posttrain.models import from_pretrained

    return from_pretrained(gemma_folder)


@nnx.jit
def _rows_logits(model, batch):
    return forward_rows(model, batch).logits


def packed_qwen(tmp_path, tok, spec, seq_len):  # noqa: F811
    examples, _ = load_examples(write_rows(tmp_path)[0], tok, max_length=seq_len, images=spec)
    return examples, to_arrays(examples, seq_len, PAD, True, spec.vision)


def test_qwen3vl_packed_rows_equal_transformers_per_example(tmp_path, tok, spec, qwen, qwen_hf):  # noqa: F811
    """Five examples (1 and 2 images of different sizes, a text-only one) packed first-fit into rows of 160: each
    segment's logits equal transformers' on the example alone."""
    examples, rows = packed_qwen(tmp_path, tok, spec, 160)
    assert len(rows["tokens"]) < len(examples) and rows["segment_ids"].max() >= 3  # packed: 3+ examples share a row
    logits = np.asarray(_rows_logits(qwen, {k: jnp.asarray(v) for k, v in rows.items()}))
    by_ids = {tuple(ex.ids.tolist()): ex for ex in examples}  # the five encodings differ
    seen = []
    for r in range(len(rows["tokens"])):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            at = rows["segment_ids"][r] == s
            ex = by_ids[tuple(rows["tokens"][r][at].tolist())]
            check(logits[r][at], qwen_alone(qwen_hf, ex), ex.where)
            seen.append(ex.where)
    assert sorted(seen) == sorted(ex.where for ex in examples)


def gemma_packed(rng, examples_parts, length):
    """Examples (token ids) packed one after another into a row of `length`: tokens, positions restarting per
    segment, segment ids (0 = padding), and the examples' token lists."""
    examples = [gemma_row(rng, p) for p in examples_parts]
    tokens, positions, segments = (np.zeros((1, length), np.int32) for _ in range(3))
    start = 0
    for s, ids in enumerate(examples, start=1):
        tokens[0, start:start + len(ids)] = ids
        positions[0, start:start + len(ids)] = np.arange(len(ids))
        segments[0, start:start + len(ids)] = s
        start += len(ids)
    assert start < length  # padding after them
    return tokens, positions, segments, examples


@nnx.jit
def _gemma_logits(model, tokens, positions, segments, pixels):
    return model(tokens, positions, pixels, segment_ids=segments).logits


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_gemma3_packed_rows_equal_transformers_per_example(gemma_model, gemma_hf, attention, monkeypatch):
    """Three examples (1, 2 and 1 images) in one right-padded row: each segment's logits equal transformers' on the
    example alone (its image blocks bidirectional within the image; no attention across segments). Blockwise
    attention with 4-token tiles cuts through the images and the segment boundaries."""
    if attention == "blockwise":
        monkeypatch.setattr(attention_module, "DENSE_MAX", 0)
        monkeypatch.setattr(attention_module, "BLOCK", 4)
    rng = np.random.default_rng(21)
    tokens, positions, segments, examples = gemma_packed(rng, [[3, "I", 5], [2, "I", 3, "I", 4], ["I", 2]], 48)
    counts = [int((np.asarray(e) == GEMMA_IMAGE).sum()) // MM for e in examples]
    pixels = gemma3_pixels(gemma_images(sum(counts), seed=22), size=32)
    got = np.asarray(_gemma_logits(gemma_model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments),
                                   jnp.asarray(pixels)))
    first = 0
    for s, (ids, n) in enumerate(zip(examples, counts), start=1):
        ids = np.asarray([ids])
        want = gemma_hf_logits(gemma_hf, ids, np.ones_like(ids), pixels[first:first + n])[0]
        check(got[0][segments[0] == s], want, f"segment {s}")
        first += n


def hf_loss(hf, examples):
    """Masked cross-entropy of transformers' float32 logits (float64 sums) over all examples, each alone: the
    token-weighted mean TRL's SFT loss is."""
    total = count = 0.0
    for ex in examples:
        logits = torch.tensor(qwen_alone(hf, ex)).double()
        nll = -torch.log_softmax(logits[:-1], -1)[torch.arange(len(ex.ids) - 1), torch.tensor(ex.ids[1:]).long()]
        w = torch.tensor(ex.loss_mask[1:], dtype=torch.float64)
        total += float((nll * w).sum())
        count += float(w.sum())
    return total / count


def test_sft_loss_of_packed_image_rows_equals_unpacked_and_transformers(tmp_path, tok, spec, qwen,  # noqa: F811
                                                                        qwen_hf):
    examples, packed = packed_qwen(tmp_path, tok, spec, 160)
    unpacked = to_arrays(examples, 160, PAD, False, spec.vision)
    assert len(packed["tokens"]) < len(unpacked["tokens"])
    loss = {}
    for name, rows in (("packed", packed), ("unpacked", unpacked)):
        total, metrics = jax.jit(lambda m, b: sft_loss(nnx.merge(*m), b, forward=forward_rows))(
            nnx.split(qwen), {k: jnp.asarray(v) for k, v in rows.items()})
        loss[name] = float(total) / float(metrics["denom"])
    want = hf_loss(qwen_hf, examples)
    print(f"loss packed {loss['packed']:.8f} unpacked {loss['unpacked']:.8f} transformers {want:.8f}")
    assert abs(loss["packed"] - loss["unpacked"]) <= 1e-5 and abs(loss["packed"] - want) <= 1e-5, (loss, want)


def test_sft_recipe_with_packing_on_image_rows(tmp_path, folder, tok, spec, qwen_hf):  # noqa: F811
    """`data.packing: true` on image rows: two steps, the whole packed data in each batch, so the first step's
    loss is transformers' loss over every example alone; the second is lower."""
    from posttrain import config as C
    from posttrain.trainers.sft import SFTTrainer

    path, _ = write_rows(tmp_path)
    examples, packed = packed_qwen(tmp_path, tok, spec, 160)
    cfg = C.from_dict(C.SFTConfig, {
        "model": {"path": folder}, "data": {"train": str(path), "max_length": 160, "packing": True, "shuffle": False},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "train": {"steps": 2, "batch_size": len(packed["tokens"]), "log_every": 1},
        "checkpoint": {"async_save": False}, "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "run")})
    SFTTrainer(cfg, progress=False).train()
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    want = hf_loss(qwen_hf, examples)
    print(f"run losses {losses}, transformers {want:.8f}")
    assert len(losses) == 2 and abs(losses[0] - want) <= 1e-5 and losses[1] < losses[0], (losses, want)


# ----------------------------------------------------------------------------- Gemma 3 image rows through SFT

G_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
              "<image_soft_token>"]
G_PAD, G_EOS, G_BOS, G_BOI, G_EOI, G_IMAGE = 256, 257, 258, 261, 262, 263  # the specials' ids after the 256 bytes


def gemma_tokenizer(name):
    """A byte-level tokenizer with Gemma 3's special tokens and TRL's Gemma 3 template `name`."""
    from test_vlm_data import template
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Raw
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Raw(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(s, special=True) for s in G_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                         "image_token": "<image_soft_token>"},
                                   chat_template=template(name))


def gemma_image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 32, "width": 32})


@pytest.fixture(scope="module")
def gemma_data_folder(tmp_path_factory):
    """test_vlm_gemma3.py's tiny model with a 272-token vocabulary (bytes + Gemma's specials), its tokenizer, image
    processor and processor_config.json (image_seq_length) saved beside it."""
    torch.manual_seed(1)
    text = {**g3.TEXT, "vocab_size": 272, "pad_token_id": G_PAD, "bos_token_id": G_BOS, "eos_token_id": G_EOS}
    model = gemma3_vl_model(text, g3.VISION, mm_tokens=MM, image=G_IMAGE, boi=G_BOI, eoi=G_EOI)
    path = str(tmp_path_factory.mktemp("gemma3_data") / "hf")
    model.save_pretrained(path)
    gemma_tokenizer("gemma3.jinja").save_pretrained(path)
    gemma_image_processor().save_pretrained(path)
    with open(f"{path}/processor_config.json", "w") as f:  # Gemma3Processor's: tokens per image
        json.dump({"processor_class": "Gemma3Processor", "image_seq_length": MM}, f)
    return path


def gemma_reference(row, base):
    """(ids, pixels, assistant mask) from transformers: Gemma3Processor's ids and pixels, and the assistant mask of
    TRL's Gemma 3 training template ({% generation %}) with each <start_of_image> expanded as the processor does
    (2 newline bytes, boi, MM image tokens, eoi, 2 newline bytes: one value, the turn's)."""
    from PIL import Image
    from test_vlm_data import conversation
    from transformers import Gemma3Processor

    processor = Gemma3Processor(image_processor=gemma_image_processor(), tokenizer=gemma_tokenizer("gemma3.jinja"),
                                chat_template=gemma_tokenizer("gemma3.jinja").chat_template, image_seq_length=MM)
    msgs = conversation(row)
    text = processor.apply_chat_template(msgs, tokenize=False)
    images = [Image.open(base / n) for n in row.get("images", [])]
    out = processor(text=[text], images=images or None, return_tensors="np")
    enc = gemma_tokenizer("gemma3_training.jinja").apply_chat_template(msgs, return_dict=True,
                                                                       return_assistant_tokens_mask=True)
    mask = []
    for t, m in zip(enc["input_ids"], enc["assistant_masks"]):
        mask += [m] * (MM + 6 if t == G_BOI else 1)
    return out["input_ids"][0], out.get("pixel_values"), np.array(mask)


def test_gemma3_image_rows_sft_loss_equals_transformers(tmp_path, gemma_data_folder):
    """Gemma 3 image rows (1 and 2 images, multi-turn, prompt/completion, a text row) through load_examples: ids
    and pixels equal Gemma3Processor's; sft_loss with `forward_rows` on padded rows and on packed rows equals the
    masked cross-entropy of transformers' float32 logits over TRL's assistant tokens (<= 1e-5 relative)."""
    from transformers import Gemma3ForConditionalGeneration

    from posttrain.data.images import image_spec
    from posttrain.models import from_pretrained
    from posttrain.tokenizer import Tokenizer
    from posttrain.vision import processor_settings

    path, rows = write_rows(tmp_path)
    ours = from_pretrained(gemma_data_folder)
    spec = image_spec(processor_settings(gemma_data_folder), ours.vcfg)  # noqa: F811
    examples, _ = load_examples(path, Tokenizer.from_pretrained(gemma_data_folder), max_length=256, images=spec)
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma_data_folder, dtype=torch.float32).eval()
    want_total = want_count = 0.0
    for ex, row in zip(examples, rows):
        ids, pixels, mask = gemma_reference(row, tmp_path)
        np.testing.assert_array_equal(ex.ids, ids)
        np.testing.assert_array_equal(ex.loss_mask, mask)
        assert (ex.pixels is None) == (pixels is None)
        if pixels is not None:
            assert ex.pixels.shape == pixels.shape and np.abs(ex.pixels - pixels).max() <= 1e-6
        t = torch.tensor(ids[None]).long()
        with torch.no_grad():
            logits = hf(input_ids=t, token_type_ids=(t == G_IMAGE).long(),
                        pixel_values=None if pixels is None else torch.tensor(pixels)).logits[0].double()
        nll = -torch.log_softmax(logits[:-1], -1)[torch.arange(len(ids) - 1), t[0, 1:]]
        w = torch.tensor(mask[1:], dtype=torch.float64)
        want_total += float((nll * w).sum())
        want_count += float(w.sum())
    want = want_total / want_count
    for packing in (False, True):
        batch = to_arrays(examples, 256, G_PAD, packing, spec.vision)
        per_row = (batch["tokens"] == G_IMAGE).sum(1) // MM  # image slots: the most images of a row
        assert batch["pixels"].shape[1] == per_row.max() and (len(per_row) < 5 if packing else per_row.max() == 2)
        total, metrics = jax.jit(lambda m, b: sft_loss(nnx.merge(*m), b, forward=forward_rows))(
            nnx.split(ours), {k: jnp.asarray(v) for k, v in batch.items()})
        print(f"packing={packing}: loss {float(total) / want_count:.8f}, transformers {want:.8f}")
        assert float(metrics["denom"]) == want_count
        assert abs(float(total) / want_count - want) <= 1e-5 * want, (packing, float(total) / want_count, want)


@pytest.mark.parametrize("options,length,pattern", [
    (dict(size=(32, 32), pan_and_scan=True), 4, "do_pan_and_scan is on"),
    (dict(size=(64, 64), pan_and_scan=False), 4, r"images resized to \(64, 64\).*reads 32 x 32"),
    (dict(size=(32, 32), pan_and_scan=False), 9, "image_seq_length 9.*mm_tokens_per_image is 4"),
], ids=["pan-and-scan", "size", "tokens"])
def test_gemma3_image_spec_refuses_what_rows_cannot_hold(options, length, pattern):
    from posttrain.data.images import image_spec
    from posttrain.errors import PosttrainError
    from posttrain.vision.gemma3 import Gemma3VisionConfig
    from posttrain.vision.preprocess import ImageSettings
    from posttrain.vision.siglip import SiglipConfig

    vcfg = Gemma3VisionConfig(vision=SiglipConfig(hidden_size=32, num_heads=2, image_size=32, patch_size=4),
                              mm_tokens_per_image=MM)
    with pytest.raises(PosttrainError, match="preprocessor_config.json: " + pattern):
        image_spec(ImageSettings("gemma3", options, length, "m/preprocessor_config.json"), vcfg)
