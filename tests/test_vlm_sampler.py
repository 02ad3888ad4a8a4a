"""Images through posttrain's Sampler and `posttrain generate --image` (Qwen3-VL, tiny random folders): greedy
tokens equal a cache-free transformers loop for a batch of rows with different images, grids and prompt lengths;
sampled tokens' log-probs equal the trainer's forward on the same rows; the CLI's image prompt (placeholders
expanded to each grid's token count) equals transformers' greedy generation; a bad image is exit 2."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_vlm_qwen3vl as qwen3vl
import torch
from flax import nnx
from test_vlm_qwen3vl import IMAGE, PATCHES, TEXT, VISION, hf_logits, images, row

from posttrain.generate import ImageInputs, Sampler, SamplingParams
from posttrain.vision import qwen_vl_patches
from posttrain.vision.qwen_vl import place, rope_index

ckpt, hf, ours = qwen3vl.ckpt, qwen3vl.hf, qwen3vl.ours  # the tiny random folder and its two models (fixtures)


def prompts(seed=2):
    """Two rows: one image (16 x 24) / two images (24 x 16, 32 x 32), different text lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for k, (sizes, text) in enumerate([([(16, 24)], (2, 4)), ([(24, 16), (32, 32)], (6, 3))]):
        pixels, grids = qwen_vl_patches(images(sizes, seed + k), **PATCHES)
        out.append((row(rng, grids, text), pixels, grids))
    return out


@pytest.fixture(scope="module")
def sampler(ours):
    return Sampler(ours, max_len=128)


def test_greedy_batch_matches_transformers(hf, sampler):
    """24 greedy tokens of two rows prefilled together (left-padded to one bucket, M-RoPE positions, the tower's
    features) and decoded at text position + delta equal transformers' full forward each step, row by row."""
    rows = prompts()
    assert len(rows[0][0]) != len(rows[1][0]) and rows[0][2].tolist() != rows[1][2].tolist()
    n = 24
    out = sampler.generate([r[0] for r in rows], SamplingParams(max_new_tokens=n, temperature=0.0),
                           images=[ImageInputs(grids=g, pixels=p) for _, p, g in rows])
    for b, (ids, pixels, grids) in enumerate(rows):
        seq, want = np.array([ids], np.int32), []
        for _ in range(n):
            want.append(int(np.argmax(hf_logits(hf, seq, np.ones_like(seq), pixels, grids)[0, -1])))
            seq = np.concatenate([seq, [[want[-1]]]], axis=1).astype(np.int32)
        assert out.tokens[b].tolist() == want, (b, out.tokens[b].tolist(), want)
        assert len(set(want)) > 3  # not one token repeated


def test_text_rows_beside_image_rows(sampler):
    """A text-only row (None) in an image batch decodes as it does alone; its image-free prefill path is the
    plain one (positions 0..len-1)."""
    (ids, pixels, grids), text = prompts()[0], [5, 9, 11, 4, 7]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    both = sampler.generate([text, ids], params, images=[None, ImageInputs(grids=grids, pixels=pixels)])
    alone = sampler.generate([text], params)
    assert both.tokens[0].tolist() == alone.tokens[0].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_trainer_forward(sampler, temperature):
    """Sampled tokens' log-probs (2 samples a prompt sharing one image prefill) equal log_softmax(logits / T) of one
    forward over prompt + completion: the features at the prompt's image tokens, rope_index's positions for the
    prompt, text positions + delta after it."""
    rows = prompts(seed=5)
    new = 40
    before = sampler.prefill_rows
    out = sampler.generate([r[0] for r in rows], SamplingParams(max_new_tokens=new, temperature=temperature, n=2),
                           key=jax.random.key(7), images=[ImageInputs(grids=g, pixels=p) for _, p, g in rows])
    assert sampler.prefill_rows - before == len(rows)  # the n samples share each prompt's prefill

    @nnx.jit(static_argnums=4)
    def forward(model, seq, pos, pixels, grids, mask):
        feats, deep = model.vision(pixels, grids)
        x = jnp.where(mask[..., None], place(mask, feats, jnp.float32), model.embed_tokens(seq))
        deep = tuple(place(mask, d, jnp.float32) for d in deep)
        return model(seq, pos, embeds=x, deepstack=deep).logits[0]

    model = nnx.merge(sampler.graphdef, sampler.state)
    for r in range(len(out.lengths)):
        ids, pixels, grids = rows[out.prompt_index[r]]
        L = len(ids)
        seq = np.array([ids + out.tokens[r].tolist()], np.int32)
        pos, delta = rope_index(np.array([ids]), np.ones((1, L)), grids, model.cfg.vision)
        text = np.broadcast_to(L + delta[0] + np.arange(new), (3, 1, new))
        mask = np.zeros_like(seq, bool)
        mask[0, :L] = np.array(ids) == IMAGE  # a sampled image-token id is text here, as in the decode
        logits = forward(model, jnp.asarray(seq), jnp.asarray(np.concatenate([pos, text], axis=2)),
                         jnp.asarray(pixels), tuple(map(tuple, grids.tolist())), jnp.asarray(mask))
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        ref = np.asarray(logp[L - 1:-1][np.arange(new), out.tokens[r]])
        np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-5, rtol=0)


def test_precomputed_features_equal_pixels(sampler, ours):
    """ImageInputs(features=, deepstack=) (the tower's output computed elsewhere) samples the same tokens."""
    rows = prompts()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    a = sampler.generate([r[0] for r in rows], params, images=[ImageInputs(grids=g, pixels=p) for _, p, g in rows])
    pre = []
    for _, p, g in rows:
        feats, deep = ours.vision(jnp.asarray(p), g)
        pre.append(ImageInputs(grids=g, features=np.asarray(feats), deepstack=tuple(map(np.asarray, deep))))
    b = sampler.generate([r[0] for r in rows], params, images=pre)
    assert a.tokens.tolist() == b.tokens.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_image_batches_reuse_the_compiled_prefill(sampler):
    """Other images of the same sizes (and text of the same lengths) compile nothing; other grids compile the
    tower again, never the prefill (one per bucket) or the decode."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0)

    def run(rows):
        sampler.generate([r[0] for r in rows], params, images=[ImageInputs(grids=g, pixels=p) for _, p, g in rows])

    rows = prompts()
    run(rows)
    before = dict(sampler.traces)
    run(prompts(seed=9))
    assert dict(sampler.traces) == before
    run(rows[::-1])  # the grids in another order: a new tower program
    assert dict(sampler.traces) == {**before, "image_encode": before["image_encode"] + 1}


def test_image_errors(sampler):
    from posttrain.errors import PosttrainError

    ids, pixels, grids = prompts()[0]
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(PosttrainError, match="one ImageInputs"):
        sampler.generate([ids, ids], params, images=[ImageInputs(grids=grids, pixels=pixels)])
    with pytest.raises(PosttrainError, match="image tokens"):  # two images' grids for one image's tokens
        sampler.generate([ids], params, images=[ImageInputs(grids=np.concatenate([grids, grids]), pixels=pixels)])
    with pytest.raises(PosttrainError, match="exactly one of pixels"):
        ImageInputs(grids=grids)


# ----------------------------------------------------------------------------------------------- the CLI

SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # ids 263 .. 266


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    """A tiny random qwen3_vl folder whose tokenizer (the byte tokenizer + Qwen's vision tokens) knows the image
    tokens, with a Qwen2VLImageProcessor preprocessor_config.json."""
    from tokenizers import AddedToken
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    tok._light.raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    start, end, image, video = (tok._light.raw.token_to_id(t) for t in SPECIALS)
    torch.manual_seed(1)
    text = dict(TEXT, vocab_size=272)
    config = Qwen3VLConfig(text_config=text, vision_config=VISION, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("qwen3_vl_cli") / "hf"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(dict(
        image_processor_type="Qwen2VLImageProcessor", patch_size=4, temporal_patch_size=2, merge_size=2,
        min_pixels=PATCHES["min_pixels"], max_pixels=PATCHES["max_pixels"], image_mean=[0.5] * 3,
        image_std=[0.5] * 3)))
    files = []
    for k, size in enumerate([(16, 24), (32, 32)]):
        files.append(os.fspath(path.parent / f"img{k}.png"))
        images([size], seed=10 + k)[0].save(files[-1])
    return path, model, files


def test_cli_generate_with_images(cli_folder, capsys):
    """`posttrain generate --image a --image b`: each `<image>` becomes <|vision_start|>, the image's
    <|image_pad|> run, <|vision_end|>; the greedy text equals transformers' generate on ids built here."""
    from posttrain.cli import main
    from posttrain.tokenizer import Tokenizer

    path, model, files = cli_folder
    tok = Tokenizer.from_pretrained(path)
    start, end, image, _ = (tok._light.raw.token_to_id(t) for t in SPECIALS)
    pixels, grids = qwen_vl_patches(files, **PATCHES)
    ids = tok.encode("look ")
    for n, after in zip(grids.prod(1) // 4, [" then ", "!"]):
        ids += [start] + [image] * int(n) + [end] + tok.encode(after, add_special_tokens=False)
    new = 8
    with torch.no_grad():
        gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                             max_new_tokens=new, do_sample=False, eos_token_id=list(tok.eos_ids), pad_token_id=0)
    want = tok.decode(gen[0, len(ids):].tolist())
    rc = main(["generate", "--model", os.fspath(path), "--prompt", "look <image> then <image>!",
               "--image", files[0], "--image", files[1], "--max-new-tokens", str(new)])
    assert rc == 0
    assert capsys.readouterr().out == want + "\n"


@pytest.mark.parametrize("images_argv, needle", [
    (["--image", "{missing}"], "{missing}"),
    (["--image", "{bad}"], "{bad}"),
    (["--image", "{good}", "--image", "{good}"], "2 images"),
])
def test_cli_image_errors_exit_2(cli_folder, capsys, tmp_path, images_argv, needle):
    from posttrain.cli import main

    path, _, files = cli_folder
    (tmp_path / "bad.png").write_bytes(b"not a png")
    names = dict(missing=os.fspath(tmp_path / "nope.png"), bad=os.fspath(tmp_path / "bad.png"), good=files[0])
    argv = [a.format(**names) for a in images_argv]
    assert main(["generate", "--model", os.fspath(path), "--prompt", "one <image> only"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error:") and needle.format(**names) in err and "Traceback" not in err
