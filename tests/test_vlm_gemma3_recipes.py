"""Gemma 3 vision-language folders through the recipes and `posttrain generate --image`, against transformers.

The folder: test_vlm_packing.py's tiny Gemma 3 model (2-layer text model, 2-layer SigLIP tower over 32 x 32 images, 4
image tokens an image) with a byte-level tokenizer carrying Gemma's special tokens and TRL's Gemma 3 chat template, its
Gemma3ImageProcessor and processor_config.json. Rows: test_vlm_data.py's five (1 and 2 images, two turns,
prompt/completion, a text row). References: Gemma3ForConditionalGeneration loading the exported folders, and its
Gemma3Processor + generate for the CLI's greedy text.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from test_vlm_data import write_rows
from test_vlm_packing import G_BOI, G_IMAGE, gemma_data_folder, gemma_image_processor, gemma_tokenizer  # noqa: F401

from posttrain import cli
from posttrain import config as C
from posttrain.models import from_pretrained

TOL = 1e-4  # of the logit range


def sft_config(folder, path, run_dir, **over):
    cfg = {"model": {"path": folder}, "data": {"train": str(path), "max_length": 128, "shuffle": False},
           "optim": {"lr": 1e-2, "schedule": "constant"},
           "train": {"steps": 6, "batch_size": 5, "log_every": 1}, "checkpoint": {"async_save": False},
           "metrics": {"sinks": ["jsonl"]}, "run_dir": str(run_dir)}
    for key, value in over.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    return cfg


def losses(run_dir):
    return [r["loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "loss" in r]


def tower(model):
    """The tower's and the projector's weights, flattened."""
    return jax.tree_util.tree_leaves((nnx.state(model.vision, nnx.Param), nnx.state(model.projector, nnx.Param)))


def moved(a, b) -> float:
    return max(float(jnp.abs(x - y).max()) for x, y in zip(a, b))


def image_example(folder, path):
    """(ids [1, T], pixels [2, 3, S, S]) of the two-image row, as posttrain's data path encodes it (equal to
    Gemma3Processor's: test_vlm_packing.py)."""
    from posttrain.data import load_examples
    from posttrain.recipes.build import image_spec
    from posttrain.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(folder)
    spec = image_spec(C.ModelSection(path=folder), tok)
    examples, _ = load_examples(path, tok, max_length=128, images=spec)
    ex = next(e for e in examples if e.pixels is not None and len(e.pixels) == 2)
    return ex.ids[None].astype(np.int64), ex.pixels


def check_export(model, out, ids, pixels):
    """The exported folder loads in transformers and its float32 logits equal the trained model's on an image row."""
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    t = torch.tensor(ids)
    with torch.no_grad():
        want = hf(input_ids=t, token_type_ids=(t == G_IMAGE).long(), pixel_values=torch.tensor(pixels)).logits.numpy()
    positions = jnp.arange(ids.shape[1])[None]
    got = np.asarray(nnx.jit(lambda m, t, p, x: m(t, p, x).logits)(model, jnp.asarray(ids), positions,
                                                                   jnp.asarray(pixels)))
    err, scale = float(np.abs(got - want).max()), float(np.ptp(want))
    print(f"export: max |difference| {err:.2e}, logit range {scale:.2f}")
    assert err <= TOL * scale, (err, scale)
    return want


@pytest.mark.parametrize("train_vision", [False, True], ids=["tower-frozen", "train-vision"])
def test_sft_trains_gemma3_on_image_rows_and_exports(tmp_path, gemma_data_folder, train_vision):  # noqa: F811
    """Six full fine-tuning steps on the image rows: the loss falls; the tower and projector stay bitwise frozen
    unless model.train_vision, the text model moves; `export_run` writes a Gemma3ForConditionalGeneration folder
    whose logits equal the trained model's, and differ from the base folder's."""
    from posttrain.runs import export_run
    from posttrain.trainers.sft import SFTTrainer

    path, _ = write_rows(tmp_path)
    cfg = C.from_dict(C.SFTConfig, sft_config(gemma_data_folder, path, tmp_path / "run",
                                              **{"model.train_vision": train_vision}))
    trainer = SFTTrainer(cfg, progress=False)
    result = trainer.train()
    run = losses(tmp_path / "run")
    print(f"losses {run}")
    assert len(run) == 6 and run[-1] < 0.7 * run[0] and result["first_loss"] == pytest.approx(run[0], rel=1e-4)
    base = from_pretrained(gemma_data_folder)
    shift = moved(tower(base), tower(trainer.model))
    assert (shift > 1e-4) if train_vision else (shift == 0.0), shift
    assert float(jnp.abs(base.text.embed[...] - trainer.model.text.embed[...]).max()) > 1e-4
    out = export_run(str(tmp_path / "run"), str(tmp_path / "export"))
    assert os.path.isfile(os.path.join(out, "preprocessor_config.json"))
    ids, pixels = image_example(gemma_data_folder, path)
    want = check_export(trainer.model, out, ids, pixels)
    assert moved([want], [check_export(base, gemma_data_folder, ids, pixels)]) > 1e-2 * np.ptp(want)


def test_sft_lora_on_gemma3_resumes_and_exports_from_the_cli(tmp_path, gemma_data_folder, capsys):  # noqa: F811
    """`posttrain sft` with LoRA on the image rows (adapters on the text model only, as for Qwen3-VL): 4 steps (a
    checkpoint each) equal 2 resumed to 4, bitwise; `posttrain export` merges the adapters into a folder transformers
    loads with logits equal to the run's merged model."""
    import yaml

    from posttrain.runs import trained_model

    path, _ = write_rows(tmp_path)
    run = tmp_path / "run"
    cfg = sft_config(gemma_data_folder, path, run, **{"lora.enabled": True, "lora.rank": 4, "optim.lr": 3e-2,
                                                      "train.steps": 4, "checkpoint.every": 1, "checkpoint.keep": 4})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["sft", "--config", str(tmp_path / "c.yaml")]) == 0
    first = losses(run)
    assert len(first) == 4 and first[-1] < first[0], first
    final = (run / "trainable.safetensors").read_bytes()
    from safetensors import safe_open

    with safe_open(str(run / "trainable.safetensors"), "np") as f:
        names = list(f.keys())
    assert names and all("lora" in n and "vision" not in n and "projector" not in n for n in names), names
    for step in ("3", "4"):
        shutil.rmtree(run / "checkpoints" / step)
    (run / "trainable.safetensors").unlink()
    capsys.readouterr()
    assert cli.main(["sft", "--config", str(tmp_path / "c.yaml")]) == 0
    assert "resum" in capsys.readouterr().out.lower()
    assert (run / "trainable.safetensors").read_bytes() == final
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    _, merged = trained_model(str(run))
    ids, pixels = image_example(gemma_data_folder, path)
    check_export(merged, str(tmp_path / "export"), ids, pixels)


def test_cli_generate_with_an_image_equals_transformers(tmp_path, gemma_data_folder, capsys):  # noqa: F811
    """`posttrain generate --chat --image`: the chat template's <start_of_image> expanded as Gemma3Processor does;
    the greedy text equals transformers' generate on the processor's ids and pixels."""
    from PIL import Image
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor

    path, rows = write_rows(tmp_path)
    image = str(tmp_path / rows[0]["images"][0])
    template = gemma_tokenizer("gemma3.jinja").chat_template
    processor = Gemma3Processor(image_processor=gemma_image_processor(), tokenizer=gemma_tokenizer("gemma3.jinja"),
                                chat_template=template, image_seq_length=4)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[Image.open(image)], add_special_tokens=False, return_tensors="pt")
    assert int((enc["input_ids"] == G_BOI).sum()) == 1 and int((enc["input_ids"] == G_IMAGE).sum()) == 4
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma_data_folder, dtype=torch.float32).eval()
    new = 12
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=0)
    want = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(set(out[0, enc["input_ids"].shape[1]:].tolist())) > 3  # not one token repeated
    rc = cli.main(["generate", "--model", gemma_data_folder, "--chat", "--prompt", "What is it?", "--image", image,
                   "--max-new-tokens", str(new)])
    assert rc == 0
    assert capsys.readouterr().out == want + "\n"
    rc = cli.main(["generate", "--model", gemma_data_folder, "--prompt", "<image> and <image>", "--image", image])
    err = capsys.readouterr().err
    assert rc == 2 and "2 <image> placeholders but 1 images" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- DPO and GRPO on Gemma 3 image rows


def gemma_spec_tok(folder):
    from posttrain.recipes.build import image_spec
    from posttrain.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(folder)
    return image_spec(C.ModelSection(path=folder), tok), tok


def hf_token_logps(hf, prompt, answer, pixels):
    """transformers' float32 log-probs of `answer`'s tokens after `prompt` (with its images), the row alone."""
    ids = torch.tensor(np.concatenate([prompt, answer])[None]).long()
    with torch.no_grad():
        logits = hf(input_ids=ids, token_type_ids=(ids == G_IMAGE).long(),
                    pixel_values=None if pixels is None else torch.tensor(pixels)).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return lp[len(prompt) - 1 + torch.arange(len(answer)), torch.tensor(answer).long()].numpy()


def test_dpo_on_gemma3_image_pairs(tmp_path, gemma_data_folder, capsys):  # noqa: F811
    """test_vlm_dpo.py's TRL vision preference rows on the Gemma 3 folder: each prompt's ids hold Gemma3Processor's
    image sequence; the prefix-shared pair rows' token log-probs (`branch_logps` through `forward_rows`) equal
    transformers' on [prompt | chosen] and [prompt | rejected] alone (<= 2e-5); `posttrain dpo` 2 steps: the loss
    falls, the export loads in transformers with the tower and projector as loaded and the text model moved."""
    import yaml
    from test_vlm_dpo import write_pairs
    from transformers import Gemma3ForConditionalGeneration

    from posttrain.data.images import patch_bucket
    from posttrain.data.preference import load_pairs, pair_arrays, pair_shapes
    from posttrain.losses.logps import branch_logps
    from posttrain.vision.batched import forward_rows

    path, _ = write_pairs(tmp_path)
    spec, tok = gemma_spec_tok(gemma_data_folder)
    pairs, counts = load_pairs(path, tok, max_length=256, images=spec)
    assert counts["rows"] == 3 and counts["skipped"] == 0
    run = [G_BOI] + [G_IMAGE] * 4  # the processor's <start_of_image> and its 4 image tokens
    for p, n in zip(pairs, (1, 2, 1)):
        assert len(p.pixels) == n and p.grids is None
        starts = [i for i in range(len(p.prompt)) if list(p.prompt[i:i + 5]) == run]
        assert len(starts) == n and int((p.prompt == G_IMAGE).sum()) == 4 * n
    length, score_length = pair_shapes(pairs)
    batch = pair_arrays(pairs, length, score_length, tok.pad_id, vision=spec.vision,
                        patches=patch_bucket(pairs, spec.vision))
    assert batch["pixels"].shape[1:] == (2, 3, 32, 32) and batch["positions"].ndim == 2
    model = from_pretrained(gemma_data_folder)
    got = np.asarray(nnx.jit(lambda m, b: branch_logps(m, b, 2, forward=forward_rows)[0])(
        model, {k: jnp.asarray(v) for k, v in batch.items()}))
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma_data_folder, dtype=torch.float32).eval()
    err = 0.0
    for i, p in enumerate(pairs):
        want = np.concatenate([hf_token_logps(hf, p.prompt, a, p.pixels) for a in (p.chosen, p.rejected)])
        err = max(err, float(np.abs(got[i, :len(want)] - want).max()))
    print(f"pair rows against transformers: max |log-prob difference| {err:.2e}")
    assert err <= 2e-5, err

    cfg = {"model": {"path": gemma_data_folder}, "data": {"train": str(path), "max_length": 256, "shuffle": False},
           "optim": {"lr": 3e-3, "schedule": "constant"}, "train": {"steps": 2, "batch_size": 3, "log_every": 1},
           "checkpoint": {"async_save": False}, "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "run")}
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["dpo", "--config", str(tmp_path / "dpo.yaml")]) == 0, capsys.readouterr().err
    logs = losses(tmp_path / "run")
    print("dpo losses", logs)
    assert len(logs) == 2 and logs[1] < logs[0], logs
    assert cli.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    base = hf.state_dict()
    out = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert base.keys() == out.keys()
    frozen = [k for k in base if "vision_tower" in k or "multi_modal_projector" in k]
    assert frozen and all(torch.equal(base[k], out[k]) for k in frozen)
    assert max(float((base[k] - out[k]).abs().max()) for k in base if k not in frozen) > 1e-4


def test_grpo_on_gemma3_image_prompts(tmp_path, gemma_data_folder):  # noqa: F811
    """test_vlm_grpo.py's TRL vision prompt rows on the Gemma 3 folder: 3 grpo steps with finite losses; the sampler's
    log-probs (its image prefill equals transformers' generate: test_vlm_gemma3.py) equal the update's prefix-shared
    image rows' (logp_mismatch_max <= 1e-4); a step with differing rewards has a gradient; the tower and projector
    stay as loaded, the text model moves."""
    from test_vlm_grpo import recipe_config

    from posttrain.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(recipe_config(tmp_path, gemma_data_folder), progress=False)
    assert all(p.pixels is not None for p in trainer.prompts)
    trainer.train()
    logs = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    print("losses", [r["loss"] for r in logs], "logp_mismatch_max", [r["logp_mismatch_max"] for r in logs])
    assert len(logs) == 3 and all(np.isfinite(r["loss"]) for r in logs), logs
    assert all(r["logp_mismatch_max"] <= 1e-4 for r in logs), [r["logp_mismatch_max"] for r in logs]
    assert any(r["reward/std"] > 0 and r["grad_norm"] > 0 for r in logs), logs  # a step that learns something
    base = from_pretrained(gemma_data_folder)
    assert moved(tower(base), tower(trainer.model)) == 0.0
    assert float(jnp.abs(base.text.embed[...] - trainer.model.text.embed[...]).max()) > 0.0
