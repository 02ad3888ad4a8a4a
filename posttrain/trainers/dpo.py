"""Direct preference optimisation recipe: preference pairs + a DPO-family loss over the shared lifecycle.

`DPOTrainer(config).train()` (or `posttrain dpo --config ...`): loads the tokenizer, the pairs
(TRL's preference formats, `data/preference.py`) and the policy, and trains it with
`losses/dpo.make_dpo_loss` (every TRL 1.16 DPO loss type) on prefix-shared pair rows
[prompt | chosen | rejected]: the prompt is computed once per pair. The reference model is
  - with LoRA: the same weights with the adapters off (no second copy of the base),
  - with full fine-tuning: a frozen copy of the initial weights,
  - with `dpo.precompute_ref: true`: neither during training; the reference log-probabilities of
    every pair are computed once before the first step and cached in `<run_dir>/ref_logps.npz`
    (a resumed run reads them back).
Metrics every log step: loss, rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected (TRL's names); with data.eval the same as
eval_*. Run folder, resume, checkpoints, sinks and the mesh are the shared driver's (`recipes.recipe`),
exactly as for SFT; `posttrain export --run` writes the policy as a Hugging Face folder.

Pairs with images (TRL's vision preference rows, a Qwen3-VL or Gemma 3 folder; `data/preference.py`) train the same
way: the prompt and its images once per row, the tower's features at the prompt's image tokens
(`vision.batched.forward_rows`; Qwen3-VL's M-RoPE positions), the tower frozen unless model.train_vision.

What it is not: online DPO (no sampling) or KTO (unpaired data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Literal

import jax
import numpy as np
from flax import nnx

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.data.images import patch_bucket
from posttrain.data.preference import load_pair_sets, pair_arrays, pair_batches, pair_shapes
from posttrain.errors import PosttrainError
from posttrain.losses.dpo import make_dpo_loss
from posttrain.losses.logps import branch_logps
from posttrain.models.lora import adapters_off
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model, image_spec, model_vision, trainable_filter, weights_stamp
from posttrain.recipes.recipe import Parts, Recipe, lora_reference
from posttrain.train.trainer import frozen_copy, place_batch
from posttrain.vision.batched import forward_rows

REF_FILE = "ref_logps.npz"
LossType = Literal["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                   "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOSection(C.Section):
    key = "dpo"

    beta: C.Positive = 0.1  # strength of the implicit KL to the reference; default 0.1
    loss_type: LossType = "sigmoid"  # a TRL 1.16 DPO loss type (losses/preference.py); default sigmoid
    label_smoothing: float = 0.0  # robust / exo_pair / aot label-flip rate; default 0.0
    precompute_ref: bool = False  # reference log-probs computed once, cached in run_dir; default false

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type == "exo_pair" and not 0 < self.label_smoothing < 1:
            raise PosttrainError("dpo.loss_type=exo_pair needs 0 < dpo.label_smoothing < 1 (EXO's epsilon, e.g. 1e-3)")
        if not 0 <= self.label_smoothing < 0.5 and self.loss_type != "exo_pair":
            raise PosttrainError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(C.RunConfig):
    model: C.ModelSection  # the policy to train (also the reference's initial weights; required)
    data: C.PreferenceDataSection  # preference pairs (required)
    dpo: DPOSection = dataclasses.field(default_factory=DPOSection)  # loss type, beta, reference mode
    run_dir: str = "runs/dpo"  # folder for checkpoints, logs, the config and cached ref log-probs


class DPOTrainer(Recipe):
    name = "dpo"
    help = "direct preference optimisation (DPO family) from a YAML config"
    config_class = DPOConfig

    def load(self) -> None:
        c, tok = self.config, self.tokenizer
        images = image_spec(c.model, tok)  # a vision-language folder: pairs with an `images` column
        self.train_pairs, self.data_stats, self.eval_pairs = load_pair_sets(c.data, tok, images)
        if len(self.train_pairs) < c.train.batch_size:
            raise PosttrainError(f"{c.data.train}: {len(self.train_pairs)} usable pairs are fewer than "
                                 f"train.batch_size={c.train.batch_size}; lower the batch size or add pairs")
        self.length, self.score_length = pair_shapes(self.train_pairs, self.eval_pairs or [])
        self.model = build_model(c.model, tok, c.lora, self.mesh, self.rules, images=True)
        if self.length > self.model.cfg.max_position:
            raise PosttrainError(f"a pair row is {self.length} tokens (prompt + both answers), more than the model's "
                                 f"maximum position {self.model.cfg.max_position}; lower data.max_length")
        pairs = self.train_pairs + (self.eval_pairs or [])
        self.vision = model_vision(self.model) if any(p.pixels is not None for p in pairs) else None
        self.patches = patch_bucket(pairs, self.vision) if self.vision is not None else 0
        self.forward = forward_rows if self.vision is not None else None
        self._ref_fn = None
        d = c.dpo
        self.loss_fn = make_dpo_loss(beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                                     reference=None if d.precompute_ref else "frozen", forward=self.forward)
        if c.lora.enabled and not d.precompute_ref:
            self.loss_fn = lora_reference(self.loss_fn)

    def _arrays(self, pairs, ref=None) -> dict:
        return pair_arrays(pairs, self.length, self.score_length, self.tokenizer.pad_id,
                           None if ref is None else {"ref_logps": ref}, vision=self.vision, patches=self.patches)

    def reference_logps(self, pairs) -> np.ndarray:
        """[N, 2] summed (chosen, rejected) log-probs of `pairs` under the initial model (the reference)."""
        model = adapters_off(self.model) if self.config.lora.enabled else self.model
        graphdef, state = nnx.split(model)
        if self._ref_fn is None:  # one compiled forward for the train and the eval pairs (same shapes)
            def fn(gd, st, b):
                with sh.use_mesh(self.mesh, self.rules):
                    return branch_logps(nnx.merge(gd, st), b, 2, forward=self.forward)[1]

            self._ref_fn = jax.jit(fn, static_argnums=0)
        arrays, bs, out = self._arrays(pairs), self.config.train.batch_size, []
        for i in range(0, len(pairs), bs):
            chunk = {k: v[i:i + bs] for k, v in arrays.items()}
            n = len(chunk["tokens"])
            if n < bs:  # one compiled shape: pad the last chunk with copies of its first row
                chunk = {k: np.concatenate([v, np.repeat(v[:1], bs - n, 0)]) for k, v in chunk.items()}
            logps = self._ref_fn(graphdef, state, place_batch(chunk, self.mesh, self.rules))
            out.append(np.asarray(sh.to_host(logps))[:n])
        return np.concatenate(out).astype(np.float32)

    def _cached_reference(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(train, eval) reference log-probs: read from run_dir when this data's are there, else computed
        and written (atomically) once the run folder is ready."""
        c = self.config
        path = os.path.join(c.run_dir, REF_FILE)
        # The key: the pairs' token ids and lengths, and what defines the reference model.
        digest = hashlib.sha256(repr((C.to_dict(c.model), C.to_dict(c.lora), weights_stamp(c.model.path))).encode())
        for p in self.train_pairs + (self.eval_pairs or []):
            for x in (p.prompt, p.chosen, p.rejected) + ((p.pixels, p.grids) if p.pixels is not None else ()):
                digest.update(np.int64(len(x)).tobytes() + x.tobytes())
        key = digest.hexdigest()
        found = None
        if c.checkpoint.resume and os.path.isfile(path):
            with np.load(path, allow_pickle=False) as f:
                if str(f["key"]) == key:
                    found = f["train"], (f["eval"] if self.eval_pairs else None)
        if jax.process_count() > 1:  # computing is collective: every process takes process 0's branch
            from jax.experimental import multihost_utils

            use = bool(multihost_utils.broadcast_one_to_all(np.int32(found is not None)))
            if use and found is None:
                raise PosttrainError(f"{path}: process 0 reads cached reference log-probs that this process does "
                                     "not see; put run_dir on a file system every process shares")
            found = found if use else None
        if found is not None:
            return found
        train = self.reference_logps(self.train_pairs)
        evals = self.reference_logps(self.eval_pairs) if self.eval_pairs else np.zeros((0, 2), np.float32)
        if sh.is_main_process():
            tmp = path + ".tmp.npz"
            np.savez(tmp, key=key, train=train, eval=evals)
            os.replace(tmp, path)
        return train, (evals if self.eval_pairs else None)

    def build(self) -> Parts:
        c, d, tok = self.config, self.config.dpo, self.tokenizer
        ref_train = ref_eval = None
        if d.precompute_ref:
            self.prepare_run_dir()  # the cache goes into a checked run folder (run_trainer's check is idempotent)
            ref_train, ref_eval = self._cached_reference()
        extra = None if ref_train is None else {"ref_logps": ref_train}
        mode = "precomputed" if d.precompute_ref else "adapters off" if c.lora.enabled else "frozen copy"
        # The reference forward adds one forward (a third of a training step) unless precomputed.
        flops = flops_per_token(self.model.cfg, self.length) * (1.0 if d.precompute_ref else 4 / 3)
        return Parts(
            model=self.model, loss_fn=self.loss_fn,
            trainable=trainable_filter(c.model, c.lora, self.model),  # a VLM's tower frozen unless train_vision
            frozen=frozen_copy(self.model) if not d.precompute_ref and not c.lora.enabled else None,
            batches=lambda graphdef: iter(pair_batches(
                self.train_pairs, batch_size=c.train.batch_size, length=self.length, score_length=self.score_length,
                pad_id=tok.pad_id, seed=c.data.seed, shuffle=c.data.shuffle, extra=extra, vision=self.vision,
                patches=self.patches)),
            eval_arrays=(lambda: self._arrays(self.eval_pairs, ref_eval)) if self.eval_pairs else None,
            flops_per_token=flops,
            summary=(f"{len(self.train_pairs)} pairs ({self.data_stats}), rows of {self.length} tokens, loss "
                     f"{d.loss_type} beta {d.beta}, reference: {mode}"))

    @staticmethod
    def done_line(r: dict) -> str:
        return f"loss {r['first_loss']:.4f} -> {r['loss']:.4f}, reward accuracy {r['rewards/accuracies']:.1%}"

    @classmethod
    def plan_rows(cls, c) -> tuple[int, int]:
        return 2 * c.data.max_length - 1, 0  # [prompt | chosen | rejected]: prompt + the longer answer + the other


RECIPE = DPOTrainer
