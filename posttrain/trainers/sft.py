"""Supervised fine-tuning recipe: examples + `sft_loss` on the shared driver.

`SFTTrainer(config).train()` (or `posttrain sft --config ...`): loads the tokenizer, the examples
(`data.load_examples`: text, prompt/completion and chat rows) and the model (a HF folder or a
preset; LoRA adapters when enabled, then only they train), and trains with `losses.sft_loss`
through `recipes.recipe.Recipe` -> `recipes.lifecycle.run_trainer`, which writes the run folder
(config.yaml, run.json, metrics.jsonl, `trainable.safetensors`, Orbax checkpoints), resumes a
re-run of the same command exactly and splits the work over processes (`--distributed`).
`posttrain export --run` writes the result as a Hugging Face folder (LoRA merged).
"""

from __future__ import annotations

import functools

from posttrain import config as C
from posttrain.data import batches, load_examples, to_arrays
from posttrain.errors import PosttrainError
from posttrain.losses import sft_loss
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model, image_spec, trainable_filter
from posttrain.recipes.recipe import Parts, Recipe
from posttrain.vision.batched import forward_rows


class SFTTrainer(Recipe):
    name = "sft"
    help = "supervised fine-tuning (full or LoRA) from a YAML config"
    config_class = C.SFTConfig

    def load(self) -> None:
        c, tok = self.config, self.tokenizer
        self.images = image_spec(c.model, tok)  # a vision-language folder: rows with an `images` column
        kw = dict(max_length=c.data.max_length, truncation=c.data.truncation, skip_bad_rows=c.data.skip_bad_rows,
                  completion_only_loss=c.data.completion_only_loss, assistant_only_loss=c.data.assistant_only_loss,
                  images=self.images)
        self.train_examples, self.data_stats = load_examples(c.data.train, tok, **kw)
        self.eval_examples = load_examples(c.data.eval, tok, **kw)[0] if c.data.eval else None
        self.model = build_model(c.model, tok, c.lora, self.mesh, self.rules, images=True)
        if c.data.max_length > self.model.cfg.max_position:
            raise PosttrainError(f"data.max_length={c.data.max_length} exceeds the model's maximum position "
                                 f"{self.model.cfg.max_position}; lower data.max_length")

    def build(self) -> Parts:
        c, tok = self.config, self.tokenizer
        d = c.data
        evals, vision = None, self.images.vision if self.images is not None else None  # a VLM folder
        if self.eval_examples is not None:
            evals = lambda: to_arrays(self.eval_examples, d.max_length, tok.pad_id, d.packing, vision)  # noqa: E731
        return Parts(
            model=self.model, loss_fn=sft_loss if vision is None else functools.partial(sft_loss, forward=forward_rows),
            trainable=trainable_filter(c.model, c.lora, self.model),
            batches=lambda graphdef: iter(batches(self.train_examples, batch_size=c.train.batch_size,
                                                  seq_len=d.max_length, pad_id=tok.pad_id, packing=d.packing,
                                                  seed=d.seed, shuffle=d.shuffle, vision=vision)),
            eval_arrays=evals, flops_per_token=flops_per_token(self.model.cfg, d.max_length),
            summary=f"{len(self.train_examples)} examples ({self.data_stats})")


RECIPE = SFTTrainer
