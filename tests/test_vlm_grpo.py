"""GRPO on image prompts (Qwen3-VL, #52), on the tiny random folder of tests/test_vlm_data.py.

TRL's vision prompt rows encode as Qwen3VLProcessor does (after TRL's `prepare_multimodal_messages`); prefix-shared
group rows with images (the prompt once, its completions as branches, `rl/images.py`) give the per-token log-probs and
gradients of unshared rows [prompt | c_i] (the SFT image-row forward); the GRPO loss on them equals TRL's
`GRPOTrainer._compute_loss` fed transformers' per-token log-probs (TRL cannot generate for this model without its
vision generation stack, so its loss is driven with stand-ins, as tests/test_policy_losses.py does): in float64,
posttrain's loss code (`policy_loss`) fed transformers' float64 log-probs equals TRL's float64 loss (<= 1e-6);
posttrain's models load in float32 at most, so its whole loss (forward included) is compared in float32 (<= 1e-5,
log-probs <= 1e-5); a short grpo run on image prompts is finite and leaves the tower as it was."""

import json
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from test_vlm_data import IMAGE, folder, processor, spec, tok  # noqa: F401  (module fixtures)

from posttrain.data.branches import ROW_FIELDS, SCORE_FIELDS, group_row
from posttrain.data.images import patch_bucket
from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.losses.grpo import make_grpo_loss
from posttrain.losses.logps import branch_logps
from posttrain.losses.policy import policy_loss
from posttrain.rl.images import add_image_fields
from posttrain.vision.batched import forward_rows, row_tables
from posttrain.vision.qwen_vl import rope_index

SIZES = [(20, 28), (16, 16), (33, 18)]
N_GEN, WIDTH = 3, 6  # completions per prompt, slot width


def image_user(*parts):
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


def write_prompts(tmp_path):
    """Three TRL vision prompt rows: image parts, plain text turns (TRL puts the images before the first user text),
    a single `image` column; an `answer` column for the rewards."""
    rng = np.random.default_rng(1)
    names = []
    for i, (h, w) in enumerate(SIZES):
        names.append(f"p{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / names[-1])
    rows = [{"prompt": [image_user(None, "What is 2+3?")], "images": [names[0]], "answer": "5"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum of 1 and 3?"}],
             "images": [names[1], names[2]], "answer": "4"},
            {"prompt": [image_user("Count: ", None)], "image": names[0], "answer": "2"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_vision_prompts_encode_as_the_processor(tmp_path, processor, tok, spec):  # noqa: F811
    from trl.data_utils import prepare_multimodal_messages

    path, rows = write_prompts(tmp_path)
    prompts, counts = load_prompts(path, tok, max_prompt_length=512, images=spec)
    assert counts == {"rows": 3, "skipped": 0}
    for p, row in zip(prompts, rows):
        names = row["images"] if "images" in row else [row["image"]]
        images = [Image.open(tmp_path / n) for n in names]
        text = processor.apply_chat_template(prepare_multimodal_messages(row["prompt"], images=images),
                                             add_generation_prompt=True, tokenize=False)
        out = processor(text=[text], images=images, return_tensors="np")
        np.testing.assert_array_equal(p.ids, out["input_ids"][0])
        np.testing.assert_array_equal(p.grids, out["image_grid_thw"])
        assert np.abs(p.pixels - out["pixel_values"]).max() <= 1e-6
        assert p.columns["answer"] == row["answer"] and p.prompt == row["prompt"]  # the columns go to the rewards


@pytest.mark.parametrize("change,pattern", [
    (lambda r: {**r, "images": ["gone.png"]}, r"prompts.jsonl:1: images\[0\]: no such file"),
    (lambda r: {**r, "images": ["bad.png"]}, r"prompts.jsonl:1: image 0 \(.*bad.png\): not a readable image"),
    (lambda r: {**r, "images": ["p0.png", "p1.png"]}, r"prompts.jsonl:1: the row has 2 image"),
    (lambda r: {**r, "prompt": "2+3?"}, r"prompts.jsonl:1: a prompt with images must be a list of messages"),
], ids=["missing", "unreadable", "wrong-count", "string-prompt"])
def test_bad_image_prompts_name_the_line(tmp_path, tok, spec, change, pattern):  # noqa: F811
    path, rows = write_prompts(tmp_path)
    (tmp_path / "bad.png").write_text("not a png")
    path.write_text("\n".join([json.dumps(change(rows[0]))] + [json.dumps(r) for r in rows[1:]]) + "\n")
    with pytest.raises(PosttrainError, match=pattern):
        load_prompts(path, tok, max_prompt_length=512, images=spec)
    with pytest.warns(UserWarning, match="skipped 1 of 3 rows"):
        prompts, _ = load_prompts(path, tok, max_prompt_length=512, images=spec, skip_bad_rows=True)
    assert len(prompts) == 2
    with pytest.raises(PosttrainError, match="prompts.jsonl:1: the row has images but the model is not"):
        load_prompts(path, tok, max_prompt_length=512)


def completions(seed=3):
    """N_GEN completions per prompt of 1..WIDTH random text tokens (no image ids)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, int(rng.integers(1, WIDTH + 1))).tolist() for _ in range(N_GEN)]
            for _ in range(3)]


def shared_batch(prompts, conts, vision):
    """Group rows as GroupRollout.rows lays them out, then `add_image_fields`."""
    length = max(len(p.ids) for p in prompts) + N_GEN * WIDTH
    batch = {f: np.zeros((len(prompts), length), np.int32) for f in ROW_FIELDS}
    batch.update({f: np.zeros((len(prompts), N_GEN * WIDTH), np.float32 if f == "score_w" else np.int32)
                  for f in SCORE_FIELDS})
    for i, (p, c) in enumerate(zip(prompts, conts)):
        row = group_row(p.ids, c, WIDTH)
        for f in ROW_FIELDS:
            batch[f][i, :len(row["tokens"])] = row[f]
        for f in SCORE_FIELDS:
            batch[f][i] = row[f]
    return add_image_fields(batch, prompts, vision, patch_bucket(prompts, vision))


def unshared_logps(model, prompts, conts, vision):
    """[B, N_GEN, WIDTH] log-probs of each completion in its own image row [prompt | c_i] (the SFT forward: no
    branches, rope_index over the whole row), 0 past its end."""
    rows, seqs = [], []
    for p, c in zip(prompts, conts):
        for ci in c:
            rows.append((p, ci))
            seqs.append(np.concatenate([p.ids, ci]).astype(np.int32))
    L = max(map(len, seqs))
    patches = patch_bucket(prompts, vision)
    batch = {"tokens": np.zeros((len(seqs), L), np.int32), "segment_ids": np.zeros((len(seqs), L), np.int32)}
    tables, positions = [], []
    for b, s in enumerate(seqs):
        batch["tokens"][b, :len(s)], batch["segment_ids"][b, :len(s)] = s, 1
        p = rows[b][0]
        pos, _ = rope_index(batch["tokens"][b:b + 1], batch["segment_ids"][b:b + 1] != 0, p.grids, vision)
        positions.append(pos[:, 0])
        tables.append(row_tables(p.pixels, p.grids, vision, patches))
    batch["positions"] = np.stack(positions)
    batch.update({k: np.stack([t[k] for t in tables]) for k in tables[0]})

    def logps(model):
        logits = forward_rows(model, {k: jnp.asarray(v) for k, v in batch.items()}).logits
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        out = []
        for b, (p, ci) in enumerate(rows):
            P = len(p.ids)
            t = lp[b, P - 1 + np.arange(len(ci)), np.asarray(ci)]
            out.append(jnp.pad(t, (0, WIDTH - len(ci))))
        return jnp.stack(out).reshape(len(prompts), N_GEN, WIDTH)

    return logps


def test_prefix_shared_image_rows_equal_unshared_rows(tmp_path, folder, tok, spec):  # noqa: F811
    """Per-token log-probs and gradients (of a weighted sum of them) of the group rows = the unshared rows', float32."""
    from flax import nnx

    from posttrain.models import from_pretrained

    path, _ = write_prompts(tmp_path)
    prompts, _ = load_prompts(path, tok, max_prompt_length=512, images=spec)
    model = from_pretrained(folder)
    vision = model.cfg.vision
    conts = completions()
    batch = {k: jnp.asarray(v) for k, v in shared_batch(prompts, conts, vision).items()}
    assert batch["positions"].shape[1] == 3 and int(batch["branch_ids"].max()) == N_GEN
    w = jnp.asarray(np.random.default_rng(4).normal(size=(len(prompts), N_GEN, WIDTH)), jnp.float32)
    ref_fn = unshared_logps(model, prompts, conts, vision)

    def shared(m):
        return branch_logps(m, batch, N_GEN, forward=forward_rows)[0].reshape(len(prompts), N_GEN, WIDTH)

    # each side compiled whole (op by op, every primitive compiled per shape: 111 s of make test)
    a, b = nnx.jit(shared)(model), nnx.jit(ref_fn)(model)
    mask = batch["score_w"].reshape(b.shape) != 0
    diff = float(jnp.abs(jnp.where(mask, a - b, 0.0)).max())
    assert diff <= 1e-5, diff
    g_a = nnx.jit(nnx.grad(lambda m: jnp.sum(shared(m) * w * mask)))(model)
    g_b = nnx.jit(nnx.grad(lambda m: jnp.sum(ref_fn(m) * w * mask)))(model)
    leaves_a, leaves_b = jax.tree.leaves(g_a), jax.tree.leaves(g_b)
    gdiff = max(float(jnp.abs(x - y).max()) for x, y in zip(leaves_a, leaves_b))
    scale = max(float(jnp.abs(y).max()) for y in leaves_b)
    print(f"log-prob max diff {diff:.2e}, gradient max diff {gdiff:.2e} (largest gradient {scale:.2e})")
    assert gdiff <= 1e-5 and scale > 1e-3, (gdiff, scale)


def hf_logps(folder, processor, prompts, conts):  # noqa: F811
    """[B, N_GEN, WIDTH] float64 log-probs of the completions from Qwen3VLForConditionalGeneration in float64, row by
    row."""
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float64,
                                                         attn_implementation="eager").eval()
    out = np.zeros((len(prompts), N_GEN, WIDTH), np.float64)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        for j, ci in enumerate(c):
            ids = np.concatenate([p.ids, ci])[None]
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor(ids), pixel_values=torch.tensor(p.pixels).double(),
                            image_grid_thw=torch.tensor(p.grids),
                            mm_token_type_ids=torch.tensor((ids == IMAGE) * 1)).logits[0]
            lp = torch.log_softmax(logits, -1)
            P = len(p.ids)
            out[i, j, :len(ci)] = lp[P - 1 + np.arange(len(ci)), torch.tensor(ci)].numpy()
    return out


def trl_loss(new, old, adv, mask, loss_type):
    """TRL 1.16's GRPOTrainer._compute_loss on fixed per-token log-probs (in their dtype), beta 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.trainer.grpo_trainer import GRPOTrainer
    from collections import defaultdict

    N, T = new.shape
    newt = torch.from_numpy(new)
    acc = types.SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)
    self = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, *a, **kw: (newt, torch.zeros_like(newt), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
                                   sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                   vespo_lambda_neg=2.0, steps_per_generation=1),
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=T, accelerator=acc,
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=GRPOTrainer.get_gamma_weights)
    m = torch.from_numpy(mask.astype(np.int64))
    inputs = {"prompt_ids": torch.ones((N, 2), dtype=torch.long), "prompt_mask": torch.ones((N, 2), dtype=torch.long),
              "completion_ids": torch.ones((N, T), dtype=torch.long), "completion_mask": m,
              "advantages": torch.from_numpy(adv), "num_items_in_batch": torch.tensor(float(m.sum())),
              "old_per_token_logps": torch.from_numpy(old)}
    return float(GRPOTrainer._compute_loss(self, None, inputs))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_loss_on_image_rows_equals_trl_on_transformers_logps(tmp_path, folder, processor, tok, spec,  # noqa: F811
                                                                   loss_type):
    from posttrain.models import from_pretrained

    path, _ = write_prompts(tmp_path)
    prompts, _ = load_prompts(path, tok, max_prompt_length=512, images=spec)
    model = from_pretrained(folder)
    conts = completions(seed=5)
    batch = shared_batch(prompts, conts, model.cfg.vision)
    B = len(prompts)
    new = hf_logps(folder, processor, prompts, conts).reshape(B * N_GEN, WIDTH)  # float64
    mask = batch["score_w"].reshape(B * N_GEN, WIDTH)
    rng = np.random.default_rng(6)
    old = (new + rng.normal(0, 0.3, new.shape)) * mask  # ratios on both sides of the clip
    adv = rng.normal(size=B * N_GEN)
    want = trl_loss(new, old, adv, mask, loss_type)  # float64
    with jax.enable_x64(True):  # posttrain's loss code fed the same float64 log-probs
        ours64, _ = policy_loss(*(jnp.asarray(x, jnp.float64) for x in (new, old, adv, mask)), loss_type=loss_type,
                                epsilon_low=0.2, epsilon_high=0.28, max_completion_length=WIDTH)
        ours64 = float(ours64)
    batch.update(old_logps=old.reshape(B, -1).astype(np.float32), advantages=adv.reshape(B, N_GEN).astype(np.float32))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    loss_fn = make_grpo_loss(num_generations=N_GEN, max_new_tokens=WIDTH, loss_type=loss_type, epsilon_high=0.28,
                             forward=forward_rows)
    ours, _ = loss_fn(model, batch)  # float32, the model's forward included
    tok = np.asarray(branch_logps(model, batch, N_GEN, forward=forward_rows)[0]).reshape(B * N_GEN, WIDTH)
    lp_diff = float(np.abs((tok - new) * mask).max())
    print(f"{loss_type}: TRL float64 {want:.10f}; ours float64 on the same log-probs |diff| {abs(ours64 - want):.2e}; "
          f"ours float32 end to end |diff| {abs(float(ours) - want):.2e}; token log-probs max diff {lp_diff:.2e}")
    assert abs(ours64 - want) <= 1e-6, (ours64, want)
    assert abs(float(ours) - want) <= 1e-5 and lp_diff <= 1e-5, (float(ours), want, lp_diff)


def recipe_config(tmp_path, model_path):
    """A 3-step GRPO config on write_prompts' image prompts (4 samples of 4 tokens, the `format` reward), its run in
    tmp_path/run: the recipe tests of both families (test_vlm_gemma3_recipes.py too)."""
    from posttrain import config as C
    from posttrain.trainers.grpo import GRPOConfig

    path, _ = write_prompts(tmp_path)
    return C.from_dict(GRPOConfig, {
        "model": {"path": model_path}, "data": {"train": str(path), "max_prompt_length": 128, "seed": 1},
        "grpo": {"num_generations": 4, "max_new_tokens": 4, "rewards": {"format": 1.0},
                 "format_pattern": "(?s)[\\x00-\\x7f].*", "temperature": 1.0},
        "optim": {"lr": 1e-3, "schedule": "constant"}, "train": {"steps": 3, "batch_size": 2, "log_every": 1},
        "checkpoint": {"async_save": False}, "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "run")})


def test_grpo_recipe_on_image_prompts(tmp_path, folder):  # noqa: F811
    """A few grpo steps on image prompts: finite losses, rewards from `format`, the tower as loaded (frozen by
    default), the text model moved."""
    from flax import nnx

    from posttrain.models import from_pretrained
    from posttrain.runs import load_run
    from posttrain.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(recipe_config(tmp_path, folder), progress=False)
    trainer.train()
    logs = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert len(logs) == 3 and all(np.isfinite(r["loss"]) for r in logs), logs
    print("losses", [r["loss"] for r in logs], "logp_mismatch_max", [r["logp_mismatch_max"] for r in logs])
    assert all(r["logp_mismatch_max"] <= 1e-4 for r in logs), [r["logp_mismatch_max"] for r in logs]
    start = from_pretrained(folder)
    before = jax.tree.leaves(nnx.state(start.vision, nnx.Param))
    after = jax.tree.leaves(nnx.state(trainer.model.vision, nnx.Param))
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(before, after)) == 0.0
    assert float(jnp.abs(start.lm_head[...] - trainer.model.lm_head[...]).max()) > 0.0
    _, _, loaded = load_run(str(tmp_path / "run"))  # the run folder reloads (the tower from the base folder)
    assert float(jnp.abs(loaded.lm_head[...] - trainer.model.lm_head[...]).max()) == 0.0
