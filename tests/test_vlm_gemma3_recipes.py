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
