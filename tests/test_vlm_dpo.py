"""DPO on image rows (Qwen3-VL, #52), on the tiny random folder of tests/test_vlm_data.py.

TRL's vision preference rows (a conversational prompt with image parts, or plain turns that get the images before the
first user text; `images` / `image`; JSONL with relative paths, Parquet bytes) read as TRL 1.16's
DataCollatorForVisionPreference renders them with Qwen3VLProcessor; bad images name FILE:LINE (or are skipped and
counted). A prefix-shared pair row [prompt + images | chosen | rejected] gives the per-token log-probs and gradients of
the unshared rows [prompt | chosen], [prompt | rejected]. The DPO loss on image pairs equals TRL's own: DPOTrainer.
_compute_loss run on the collator's batch with two Qwen3VLForConditionalGeneration models (policy and reference) in
float64 behind TRL's fused LM head. posttrain's models load in float32 at most (float64 end to end is not possible), so
the comparison is in two parts: posttrain's loss code fed TRL's float64 per-sequence log-probs equals TRL's float64
loss (<= 1e-6), and posttrain's float32 models give TRL's log-probs and loss within float32 round-off (<= 1e-5 per
token, the loss <= 1e-5). A 2-step `posttrain dpo` run on image pairs is finite, keeps the tower, and its export loads
in transformers."""

import json
import shutil
import types
import warnings
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from test_vlm_data import IMAGE, PAD, folder, processor, spec, tok  # noqa: F401  (module fixtures)

from posttrain.data.images import patch_bucket
from posttrain.data.preference import load_pairs, pair_arrays, pair_shapes
from posttrain.errors import PosttrainError
from posttrain.losses.dpo import make_dpo_loss
from posttrain.losses.logps import branch_logps
from posttrain.losses.preference import dpo_loss
from posttrain.vision.batched import forward_rows, row_tables
from posttrain.vision.qwen_vl import rope_index

SIZES = [(20, 28), (16, 16), (33, 18)]


def image_user(*parts):
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


def answer(text):
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def write_pairs(tmp_path):
    """Three TRL vision preference rows: image parts in the prompt; plain text turns with two images (TRL puts them
    before the first user text) and string answers; a single `image` column."""
    rng = np.random.default_rng(1)
    names = []
    for i, (h, w) in enumerate(SIZES):
        names.append(f"p{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / names[-1])
    rows = [{"prompt": [image_user(None, "What is 2+3?")], "chosen": answer("5"), "rejected": answer("six"),
             "images": [names[0]]},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which is wider?"}],
             "chosen": [{"role": "assistant", "content": "The first."}],
             "rejected": [{"role": "assistant", "content": "Both, equally so."}], "images": [names[1], names[2]]},
            {"prompt": [image_user("Count: ", None)], "chosen": answer("2"), "rejected": answer("22"),
             "image": names[0]}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def trl_batch(processor, rows, base):  # noqa: F811
    """TRL 1.16's DataCollatorForVisionPreference on the rows: [chosen rows; rejected rows]. (The collator reads an
    `image` column only when the batch's first row has one; a mixed batch gets `images` = [image], as it does.)"""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    examples = []
    for row in rows:
        ex = json.loads(json.dumps(row))
        if "image" in ex and len(rows) > 1:
            ex["images"] = [ex.pop("image")]
        for key in ("images", "image"):
            if key in ex:
                ex[key] = [Image.open(base / n) for n in ex[key]] if key == "images" else Image.open(base / ex[key])
        examples.append(ex)
    return DataCollatorForVisionPreference(processor)(examples)


def test_image_pairs_encode_as_trl_collator(tmp_path, processor, tok, spec):  # noqa: F811
    """Prompt / chosen / rejected ids, pixels and grids = TRL's collator (Qwen3VLProcessor), JSONL and Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, rows = write_pairs(tmp_path)
    pairs, counts = load_pairs(path, tok, max_length=512, images=spec)
    assert counts == {"rows": 3, "skipped": 0, "truncated": 0, "dropped": 0}
    for pair, row in zip(pairs, rows):
        out = trl_batch(processor, [row], tmp_path)
        ids, att, comp = (out[k].numpy() for k in ("input_ids", "attention_mask", "completion_mask"))
        np.testing.assert_array_equal(pair.prompt, ids[0][(att[0] == 1) & (comp[0] == 0)])
        np.testing.assert_array_equal(pair.chosen, ids[0][comp[0] == 1])
        np.testing.assert_array_equal(pair.rejected, ids[1][comp[1] == 1])
        n = len(pair.grids)  # the collator repeats the images for the rejected rows
        np.testing.assert_array_equal(pair.grids, out["image_grid_thw"].numpy()[:n])
        assert np.abs(pair.pixels - out["pixel_values"].numpy()[:len(pair.pixels)]).max() <= 1e-6
        assert int((pair.prompt == IMAGE).sum()) == int(pair.grids.prod(1).sum()) // 4
    data = (tmp_path / rows[0]["images"][0]).read_bytes()
    for i, image in enumerate([data, {"bytes": data, "path": "ignored.png"}]):
        table = {k: [rows[0][k]] for k in ("prompt", "chosen", "rejected")}
        pq.write_table(pa.table({**table, "images": [[image]]}), tmp_path / f"{i}.parquet")
        (pair,), _ = load_pairs(tmp_path / f"{i}.parquet", tok, max_length=512, images=spec)
        for a, b in [(pair.prompt, pairs[0].prompt), (pair.chosen, pairs[0].chosen), (pair.pixels, pairs[0].pixels)]:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change,pattern", [
    (lambda r: {**r, "images": ["gone.png"]}, r"pairs.jsonl:1: images\[0\]: no such file"),
    (lambda r: {**r, "images": ["bad.png"]}, r"pairs.jsonl:1: image 0 \(.*bad.png\): not a readable image"),
    (lambda r: {**r, "images": ["p0.png", "p1.png"]}, r"pairs.jsonl:1: the row has 2 image"),
    (lambda r: {**r, "prompt": "2+3?", "chosen": "5", "rejected": "6"},
     r"pairs.jsonl:1: a preference row with images needs a conversational prompt"),
], ids=["missing", "unreadable", "wrong-count", "string-prompt"])
def test_bad_image_pairs_name_the_line(tmp_path, tok, spec, change, pattern):  # noqa: F811
    path, rows = write_pairs(tmp_path)
    (tmp_path / "bad.png").write_text("not a png")
    path.write_text("\n".join([json.dumps(change(rows[0]))] + [json.dumps(r) for r in rows[1:]]) + "\n")
    with pytest.raises(PosttrainError, match=pattern):
        load_pairs(path, tok, max_length=512, images=spec)
    with pytest.warns(UserWarning, match="skipped 1 of 3 rows"):
        pairs, counts = load_pairs(path, tok, max_length=512, images=spec, skip_bad_rows=True)
    assert len(pairs) == 2 and counts["skipped"] == 1
    with pytest.raises(PosttrainError, match="pairs.jsonl:1: the row has images but the model is not"):
        load_pairs(path, tok, max_length=512)


def test_image_prompts_are_never_cut(tmp_path, tok, spec):  # noqa: F811
    path, _ = write_pairs(tmp_path)
    with pytest.raises(PosttrainError, match=r"pairs.jsonl:1: the prompt with its image tokens is \d+ tokens"):
        load_pairs(path, tok, max_length=512, max_prompt_length=8, truncation="truncate", images=spec)
    pairs, counts = load_pairs(path, tok, max_length=60, truncation="drop", images=spec)
    assert counts["dropped"] >= 1 and all(len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= 60 for p in pairs)


def test_the_cli_exits_2_naming_the_line_of_a_missing_image(tmp_path, folder, capsys):  # noqa: F811
    import yaml

    from posttrain.cli import main

    path, rows = write_pairs(tmp_path)
    path.write_text(json.dumps(rows[1]) + "\n" + json.dumps({**rows[0], "images": ["gone.png"]}) + "\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": folder}, "data": {"train": str(path), "max_length": 256},
                                   "train": {"steps": 1, "batch_size": 1}, "run_dir": str(tmp_path / "run")}))
    assert main(["dpo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: images[0]: no such file" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def image_batch(pairs, vision):
    length, score_length = pair_shapes(pairs)
    arrays = pair_arrays(pairs, length, score_length, PAD, vision=vision, patches=patch_bucket(pairs, vision))
    return {k: jnp.asarray(v) for k, v in arrays.items()}


def unshared_logps(pairs, vision):
    """fn(model) -> [N, M] log-probs of each answer token in its own image row [prompt | answer] (the SFT forward:
    no branches, rope_index over the whole row), laid out as the pair rows' score entries (chosen, then rejected)."""
    seqs = [(p, a) for p in pairs for a in (p.chosen, p.rejected)]
    L = max(len(p.prompt) + len(a) for p, a in seqs)
    patches = patch_bucket(pairs, vision)
    batch = {"tokens": np.full((len(seqs), L), PAD, np.int32), "segment_ids": np.zeros((len(seqs), L), np.int32)}
    tables, positions = [], []
    for b, (p, a) in enumerate(seqs):
        s = np.concatenate([p.prompt, a])
        batch["tokens"][b, :len(s)], batch["segment_ids"][b, :len(s)] = s, 1
        grids = np.zeros((0, 3), np.int64) if p.grids is None else p.grids  # a text pair: no images
        pixels = np.zeros((0, vision.patch_dim), np.float32) if p.pixels is None else p.pixels
        pos, _ = rope_index(batch["tokens"][b:b + 1], batch["segment_ids"][b:b + 1] != 0, grids, vision)
        positions.append(pos[:, 0])
        tables.append(row_tables(pixels, grids, vision, patches))
    batch["positions"] = np.stack(positions)
    batch.update({k: np.stack([t[k] for t in tables]) for k in tables[0]})
    M = pair_shapes(pairs)[1]

    def logps(model):
        lp = jax.nn.log_softmax(forward_rows(model, {k: jnp.asarray(v) for k, v in batch.items()}).logits, axis=-1)
        out = []
        for i, p in enumerate(pairs):
            parts = [lp[2 * i + j, len(p.prompt) - 1 + np.arange(len(a)), np.asarray(a)]
                     for j, a in enumerate((p.chosen, p.rejected))]
            t = jnp.concatenate(parts)
            out.append(jnp.pad(t, (0, M - len(t))))
        return jnp.stack(out)

    return logps


def test_prefix_shared_image_pair_rows_equal_unshared_rows(tmp_path, folder, tok, spec):  # noqa: F811
    """Per-token log-probs and gradients (of a weighted sum of them) of the pair rows = the unshared rows', float32;
    a text pair beside the image pairs (its row without patches)."""
    from flax import nnx

    from posttrain.models import from_pretrained

    path, _ = write_pairs(tmp_path)
    text = {"prompt": [{"role": "user", "content": "No image: 1+1?"}], "chosen": answer("2"), "rejected": answer("11")}
    path.write_text(path.read_text() + json.dumps(text) + "\n")
    pairs, _ = load_pairs(path, tok, max_length=512, images=spec)
    assert [p.pixels is None for p in pairs] == [False, False, False, True]
    model = from_pretrained(folder)
    vision = model.cfg.vision
    batch = image_batch(pairs, vision)
    assert batch["positions"].shape[1] == 3 and int(batch["branch_ids"].max()) == 2
    mask = batch["score_w"] != 0
    w = jnp.asarray(np.random.default_rng(4).normal(size=mask.shape), jnp.float32) * mask
    ref_fn = unshared_logps(pairs, vision)

    def shared(m):
        return branch_logps(m, batch, 2, forward=forward_rows)[0]

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def logps_and_grads(fn):  # (log-probs, gradients of their weighted sum); jitted (op by op: 2.3x slower)
        def f(p):
            lp = fn(nnx.merge(graphdef, p, rest))
            return jnp.sum(lp * w), lp

        grads, lp = jax.jit(jax.grad(f, has_aux=True))(params)
        return lp, grads

    (a, g_a), (b, g_b) = logps_and_grads(shared), logps_and_grads(ref_fn)
    diff = float(jnp.abs(jnp.where(mask, a - b, 0.0)).max())
    assert diff <= 1e-5, diff
    leaves_a, leaves_b = jax.tree.leaves(g_a), jax.tree.leaves(g_b)
    gdiff = max(float(jnp.abs(x - y).max()) for x, y in zip(leaves_a, leaves_b))
    scale = max(float(jnp.abs(y).max()) for y in leaves_b)
    print(f"log-prob max diff {diff:.2e}, gradient max diff {gdiff:.2e} (largest gradient {scale:.2e})")
    assert gdiff <= 1e-5 and scale > 1e-3, (gdiff, scale)


@pytest.fixture(scope="module")
def policy_folder(folder, tmp_path_factory):  # noqa: F811
    """The tiny folder with its text weights moved (noise 0.05, seed 7), tower unchanged: a policy that is not the
    reference, so the DPO loss is not log 2."""
    from transformers import Qwen3VLForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen3_vl_policy") / "hf"
    shutil.copytree(folder, path)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" not in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    return str(path)


def hf_models(policy, ref, fused):
    """The policy and reference folders as Qwen3VLForConditionalGeneration in float64, eager attention; `fused`: behind
    TRL's fused LM head (add_fused_lm_head, as DPOTrainer patches them: its log-probs are float32 math)."""
    from transformers import Qwen3VLForConditionalGeneration
    from trl.trainer.utils import add_fused_lm_head

    out = []
    for path in (policy, ref):
        m = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float64,
                                                            attn_implementation="eager").eval()
        if fused:
            add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        out.append(m)
    return out


def float64_head(m):
    """model(**kw, labels=, fused_lm_head=True) as TRL calls it, answered from transformers' own float64 logits:
    log_softmax in float64 at the labelled positions (what the fused head computes, without its float32 tiles)."""
    def fn(labels, fused_lm_head, **kw):
        logits = m(**kw).logits[:, :-1]
        tgt = labels[:, 1:]
        lp = torch.log_softmax(logits, -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0] * (tgt != -100)
        zero = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=zero, mean_logits=zero, is_top1=zero.bool(), aux_loss=None)
    return fn


def trl_dpo(models, inputs, loss_type, beta, fused):
    """(loss, [policy chosen, policy rejected, ref chosen, ref rejected] log-probs, [chosen, rejected] lengths) of
    TRL 1.16's DPOTrainer._compute_loss on the collator's batch `inputs`, the reference a ref_model forward
    (precompute_ref_logps off); `self` is a stand-in with the attributes the method reads (no trainer __init__, no
    accelerator)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    seen = []

    def record(m):
        call = m if fused else float64_head(m)

        def fn(**kw):
            out = call(**kw)
            seen.append(out.log_probs.detach().sum(1))
            return out
        return fn

    acc = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                unwrap_model=lambda m: m)
    self = types.SimpleNamespace(
        model=models[0], ref_model=record(models[1]), accelerator=acc, aux_loss_enabled=False,
        precompute_ref_logps=False, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        args=types.SimpleNamespace(discopop_tau=0.05, gradient_checkpointing_kwargs=None),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = DPOTrainer._compute_loss(self, record(models[0]), inputs, return_outputs=False)
    assert loss.dtype == (torch.float32 if fused else torch.float64)
    (pc, pr), (rc, rr) = (s.chunk(2) for s in seen)
    lengths = inputs["completion_mask"].sum(1).double().chunk(2)
    return float(loss), [x.double().numpy() for x in (pc, pr, rc, rr)], [x.numpy() for x in lengths]


def test_dpo_loss_on_image_rows_equals_trl(tmp_path, folder, policy_folder, processor, tok, spec):  # noqa: F811
    """TRL's loss in float64: _compute_loss fed transformers' float64 log-probs (its fused head rounds to float32),
    = posttrain's loss code (losses/preference.dpo_loss, float64) fed the same, <= 1e-6. posttrain's float32 models:
    per-sequence log-probs and the whole DPO loss (make_dpo_loss: policy and frozen reference forwards on the pair
    rows) within 1e-5 (relative, above 1) of it, and of TRL's own fused-head run."""
    from posttrain.models import from_pretrained

    path, rows = write_pairs(tmp_path)
    pairs, _ = load_pairs(path, tok, max_length=512, images=spec)
    policy, ref = from_pretrained(policy_folder), from_pretrained(folder)
    batch = image_batch(pairs, policy.cfg.vision)
    ours_logps = np.concatenate([np.asarray(branch_logps(m, batch, 2, forward=forward_rows)[1], np.float64)
                                 for m in (policy, ref)], 1)  # [N, 4]: policy c, r, ref c, r
    inputs = dict(trl_batch(processor, rows, tmp_path))
    inputs["pixel_values"] = inputs["pixel_values"].double()
    plain, fused = hf_models(policy_folder, folder, False), hf_models(policy_folder, folder, True)
    for loss_type, beta in [("sigmoid", 0.5), ("ipo", 0.1)]:
        want, logps, (lc, lr) = trl_dpo(plain, inputs, loss_type, beta, fused=False)
        trl32, logps32, _ = trl_dpo(fused, inputs, loss_type, beta, fused=True)
        lp_diff = float(np.abs(ours_logps - np.stack(logps, 1)).max())
        lp_rel = float((np.abs(ours_logps - np.stack(logps, 1)) / np.abs(np.stack(logps, 1))).max())
        with jax.enable_x64(True):  # posttrain's loss code fed TRL's float64 log-probs
            per_pair, _, _ = dpo_loss(*(jnp.asarray(x, jnp.float64) for x in logps), loss_type=loss_type,
                                      beta=beta, chosen_lengths=jnp.asarray(lc), rejected_lengths=jnp.asarray(lr))
            ours64 = float(jnp.mean(per_pair))
        total, metrics = make_dpo_loss(beta=beta, loss_type=loss_type, forward=forward_rows)(policy, batch,
                                                                                           frozen=ref)
        ours32 = float(total / metrics["denom"])
        print(f"{loss_type}: TRL float64 {want:.10f} (fused head {trl32:.7f}); ours float64 on its log-probs "
              f"|diff| {abs(ours64 - want):.2e}; log-probs {ours_logps.min():.2f}..{ours_logps.max():.2f}, "
              f"relative diff {lp_rel:.2e}; ours float32 end to end |diff| {abs(ours32 - want):.2e} "
              f"(vs fused {abs(ours32 - trl32):.2e}); sequence log-probs max diff {lp_diff:.2e} (fused "
              f"{float(np.abs(ours_logps - np.stack(logps32, 1)).max()):.2e})")
        if loss_type == "sigmoid":
            assert abs(want - np.log(2)) > 0.05, want  # the policy is not the reference
        assert abs(ours64 - want) <= 1e-6, (ours64, want)
        assert lp_rel <= 1e-6, (lp_diff, lp_rel)  # float32 sums over the answer tokens, |sum| 27..241
        tol = 1e-5 * max(1.0, abs(want))  # float32 round-off is relative (IPO's loss is ~ 1 / (2 beta)^2)
        assert abs(ours32 - want) <= tol and abs(ours32 - trl32) <= tol, (ours32, want, trl32)


@pytest.mark.parametrize("extra", [{}, {"lora": {"enabled": True, "rank": 4}, "dpo": {"precompute_ref": True},
                                      "train": {"eval_every": 2}, "optim": {"lr": 1e-2}}],
                         ids=["full", "lora-precomputed-eval"])
def test_dpo_recipe_on_image_pairs_and_export(tmp_path, folder, capsys, extra):  # noqa: F811
    """`posttrain dpo` on three image pairs: 2 steps on the same batch of all three, the loss lower at the second,
    the tower as loaded (frozen by default), the text model moved; `posttrain export` writes a folder
    Qwen3VLForConditionalGeneration loads with those weights. Also with LoRA, the reference log-probs precomputed
    and an evaluation of the same pairs."""
    import yaml
    from transformers import Qwen3VLForConditionalGeneration

    from posttrain.cli import main

    path, _ = write_pairs(tmp_path)
    cfg = {"model": {"path": folder}, "data": {"train": str(path), "max_length": 256, "shuffle": False},
           "optim": {"lr": 1e-3, "schedule": "constant"}, "train": {"steps": 2, "batch_size": 3, "log_every": 1},
           "checkpoint": {"async_save": False}, "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "run")}
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    if extra:
        cfg["data"]["eval"] = str(path)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["dpo", "--config", str(tmp_path / "cfg.yaml")]) == 0, capsys.readouterr().err
    records = list(map(json.loads, open(tmp_path / "run" / "metrics.jsonl")))
    logs = [r for r in records if "loss" in r]
    print("losses", [r["loss"] for r in logs])
    assert len(logs) == 2 and all(np.isfinite(r["loss"]) for r in logs) and logs[1]["loss"] < logs[0]["loss"], logs
    if extra:
        assert (tmp_path / "run" / "ref_logps.npz").is_file()
        assert any(np.isfinite(r.get("eval_loss", np.nan)) for r in records), records
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    base = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).state_dict()
    out = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert base.keys() == out.keys()
    tower = [k for k in base if "visual" in k]
    assert tower and all(torch.equal(base[k], out[k]) for k in tower)
    assert max(float((base[k] - out[k]).abs().max()) for k in base if "visual" not in k) > 1e-4
