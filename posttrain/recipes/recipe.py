"""The recipe protocol and the one driver every trainer runs on.

What it is: a trainer is a `Recipe` subclass in its own module under `posttrain.trainers`. It
declares `name` (the CLI subcommand and the name written into the run folder), `config_class`,
and three methods:
  - `load()`: the data and `self.model` (every user error is raised here, before anything is
    written; the shared checks, the tokenizer and the mesh come first, in `Recipe.__init__`);
  - `build() -> Parts`: the loss, the trainable filter, a frozen reference / teacher, the batch
    source, the eval set, the FLOPs per token and a one-line summary;
  - `done_line(result)`: the line a finished run prints (optional: loss first -> last).
`Recipe.setup()` turns the Parts into a train state, the jitted step (micro-batches from
train.micro_batch_size), the batch source and the evaluator (`Setup`); `Recipe.train()` hands them
to `recipes.lifecycle.run_trainer` (run folder, report) with its hooks (the evaluation every
train.eval_every steps, an RL rollout's statistics), which the engine (`train.trainer.Trainer`: resume,
checkpoints, sinks, the loop) fires. For a finished
run `run_model(config, tok)` rebuilds the module whose weights `trainable.safetensors` holds and
`exported(config, model)` picks what `posttrain export` writes (`posttrain.runs`).
`plan_rows(config)` gives `posttrain plan` the row length and the sampler's KV-cache tokens.

A new trainer is one module under `posttrain/trainers/` (found by its `name` and `help`), its config
and its docs (docs/ARCHITECTURE.md shows one); a recipe whose policy samples while it trains subclasses
`recipes.rl.RLRecipe`, which loads the prompts, rewards, policy and sampler for it.

What it is not: the engine (`posttrain.train`), the run folder (`recipes.lifecycle`) or a loss (`losses/`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import jax
from flax import nnx

from posttrain import config as C
from posttrain.data.prompts import eval_prompts
from posttrain.errors import PosttrainError
from posttrain.evals import SampledEval
from posttrain.models import count_params
from posttrain.models.lora import adapters_off
from posttrain.plan import format_plan
from posttrain.recipes.build import (
    build_mesh,
    build_model,
    build_tokenizer,
    memory_plan,
    split_devices,
    trainable_filter,
)
from posttrain.recipes.lifecycle import check_processes, prepare_run_dir, run_trainer
from posttrain.rewards.registry import reward_functions
from posttrain.train.loop import Hook, MetricsHook
from posttrain.train.step import TrainState, make_train_step, merge
from posttrain.train.trainer import make_eval, training_state


@dataclasses.dataclass
class Parts:
    """What a recipe's `build()` returns.

    `batches(graphdef)` makes the batch source once the train state exists (an iterator, or a
    rollout called with the state before every step; see `run_trainer`); `eval_arrays()` the host
    arrays of the eval set (None: no evaluation); `frozen` the (graphdef, state) of a frozen
    reference or teacher, handed to the loss as `frozen=`; `optimizer` replaces config.optim's AdamW."""

    model: nnx.Module
    loss_fn: Callable
    batches: Callable[[Any], Any]
    flops_per_token: float
    summary: str
    trainable: Any = nnx.Param
    frozen: Optional[tuple] = None
    eval_arrays: Optional[Callable[[], dict]] = None
    eval_loss_fn: Optional[Callable] = None
    optimizer: Any = None


@dataclasses.dataclass
class Setup:
    """A recipe ready to train: the jitted `raw_step(state, batch, frozen)` and its bound `step`."""

    graphdef: Any
    state: TrainState
    raw_step: Callable
    frozen: Any
    batches: Any
    evaluate: Optional[Callable]

    def step(self, state, batch):
        return self.raw_step(state, batch, self.frozen)


def lora_reference(loss_fn: Callable) -> Callable:
    """`loss_fn` whose `frozen` reference is the policy with its LoRA adapters off (the base weights, no copy)."""

    def fn(policy, batch, *, frozen=None, rng=None):
        return loss_fn(policy, batch, frozen=adapters_off(policy), rng=rng)

    return fn


def group_rows(config, n: int, width: int) -> tuple[int, int]:
    """`plan_rows` of an RL recipe: a row is the prompt once, then its n completion slots of `width`
    tokens; the sampler's KV cache holds every sample's prompt and completion."""
    prompt = config.data.max_prompt_length
    return prompt + n * width, config.train.batch_size * n * (prompt + width)


class Recipe:
    """Base of every trainer: `Trainer(config).train()`; see the module docstring."""

    name: ClassVar[str] = ""  # the CLI subcommand; with `help`, how `trainers.TRAINERS` finds the recipe
    help: ClassVar[str] = ""  # the one line `posttrain --help` shows
    config_class: ClassVar[type]
    # An RL recipe: the policy samples while it trains (one process for now; no LoRA dropout, which would
    # make the sampler's policy differ from the trainer's), its loss normalises over the whole batch (no
    # micro-batches) and it evaluates sampled answers only (eval.k).
    samples: ClassVar[bool] = False
    generates: ClassVar[bool] = True  # the model can sample answers (eval.k); False for a score head


    def __init__(self, config, *, progress: bool = True):
        self.config, self.progress = config, progress
        check_processes(config)
        if self.samples:
            self.check_sampling()
        self.check()
        for key, on in (("train.eval_every", config.train.eval_every), ("eval.k", config.eval.k),
                        ("checkpoint.best_metric", config.checkpoint.best_metric)):
            if on and not getattr(config.data, "eval", None):
                raise PosttrainError(f"{key} is set but data.eval is not; give data.eval=FILE or set {key}=0")
        if config.eval.k and not self.generates:
            raise PosttrainError(f"eval.k: a {self.name} model does not generate answers to sample; set eval.k=0")
        self.tokenizer = build_tokenizer(config.model)
        split = getattr(getattr(config, "rollout", None), "devices", 0)  # an RL sampler on its own devices
        train_devices, self.sampler_devices = split_devices(config.sharding, split) if split else (None, None)
        self.mesh, self.rules = build_mesh(config.sharding, train_devices)
        self.load()
        self.sampled_eval = self.make_sampled_eval() if config.eval.k else None

    def make_sampled_eval(self) -> SampledEval:
        """The in-loop sampled evaluation (`evals.SampledEval`) of data.eval under the eval section: its
        rewards and budget default to the RL section's (the one with `rewards`), else math_answer and 64."""
        c, e = self.config, self.config.eval
        rl = next((getattr(c, f.name) for f in dataclasses.fields(c) if isinstance(getattr(c, f.name), C.Rewards)),
                  None)
        section = rl if rl is not None else C.Rewards()
        if e.rewards is not None:
            section = dataclasses.replace(section, rewards=e.rewards)
        prompt_budget = getattr(c.data, "max_prompt_length", None) or c.data.max_length
        prompts = eval_prompts(c.data.eval, self.tokenizer, max_prompt_length=prompt_budget, limit=e.max_prompts)
        funcs, weights = reward_functions(section, self.tokenizer, prompts, key="eval" if rl is None else rl.key)
        new = e.max_new_tokens or getattr(rl, "max_new_tokens", 64)
        return SampledEval(prompts, self.tokenizer, funcs, weights, k=e.k, max_new_tokens=new,
                           temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, correct_at=e.correct_at,
                           seed=e.seed, prompts_per_call=e.prompts_per_call,
                           reward_timeout_s=section.reward_timeout_s, mesh=self.mesh, rules=self.rules)

    def check_sampling(self) -> None:
        c, name = self.config, self.name
        for bad, msg in [
            (c.train.micro_batch_size not in (None, c.train.batch_size),
             f"train.micro_batch_size is not supported by {name} (its loss normalises over the whole batch); lower "
             "train.batch_size instead"),
            (jax.process_count() > 1, f"posttrain {name} runs in one process for now (the sampler's multi-process "
                                      "placement is not built); run it without --distributed"),
            (c.lora.enabled and c.lora.dropout > 0, f"lora.dropout must be 0 for {name}: the sampler would sample "
                                                    "from a noised policy and its log-probs would no longer be the "
                                                    "trainer's"),
            (c.train.eval_every and not c.eval.k, f"train.eval_every: {name} evaluates sampled answers only; set "
                                                  "eval.k (samples per prompt, e.g. 8) or train.eval_every=0")]:
            if bad:
                raise PosttrainError(msg)

    # ---------------------------------------------------------------- what a recipe defines
    def check(self) -> None:
        """Raise on settings this recipe cannot run (called first, before the model or data load)."""

    def load(self) -> None:
        raise NotImplementedError

    def build(self) -> Parts:
        raise NotImplementedError

    @staticmethod
    def done_line(result: dict) -> str:
        return f"loss {result['first_loss']:.4f} -> {result['loss']:.4f}"

    @classmethod
    def plan_rows(cls, config) -> tuple[int, int]:
        """(tokens per training row, KV-cache tokens of the sampler) for `posttrain plan`."""
        return config.data.max_length, 0

    @classmethod
    def run_model(cls, config, tok) -> tuple[nnx.Module, Any]:
        """(model, trainable filter) of a run of this recipe, with fresh weights (`runs.load_run` fills them); the
        filter is the one the recipe trains with (`build.trainable_filter`: a VLM's tower frozen unless
        model.train_vision)."""
        model = build_model(config.model, tok, config.lora, images=True)  # its training built it
        return model, trainable_filter(config.model, config.lora, model)

    @classmethod
    def exported(cls, config, model) -> nnx.Module:
        """The module `posttrain export` writes, from `run_model`'s (LoRA still separate)."""
        return model

    # ---------------------------------------------------------------- the driver
    def prepare_run_dir(self) -> None:
        """Check and create the run folder now (a recipe that caches data there before training)."""
        prepare_run_dir(self.config, recipe=self.name)

    def setup(self) -> Setup:
        c = self.config
        self.built = p = self.build()
        graphdef, state, optimizer, lr = training_state(c, p.model, trainable=p.trainable, mesh=self.mesh,
                                                        rules=self.rules, optimizer=p.optimizer)
        frozen_graphdef, frozen = p.frozen or (None, None)
        raw = make_train_step(p.loss_fn, optimizer, graphdef,
                              micro_batches=c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size),
                              schedule=lr, frozen_graphdef=frozen_graphdef, trainable=p.trainable, mesh=self.mesh,
                              rules=self.rules)
        losses = sampled = None
        if p.eval_arrays is not None:
            losses = make_eval(p.eval_loss_fn or p.loss_fn, graphdef, p.eval_arrays(), batch_size=c.train.batch_size,
                               mesh=self.mesh, rules=self.rules, frozen=frozen, frozen_graphdef=frozen_graphdef)
        if self.sampled_eval is not None:
            sampled = lambda st: self.sampled_eval.metrics(merge(graphdef, st))  # noqa: E731
        evaluate = None
        if losses is not None or sampled is not None:
            def evaluate(st) -> dict:
                return {**(losses(st) if losses else {}), **(sampled(st) if sampled else {})}
        return Setup(graphdef, state, raw, frozen, p.batches(graphdef), evaluate)

    def train(self) -> dict:
        """Train (or resume) in run_dir, see `run_trainer`; afterwards `self.model` holds the trained weights."""
        c = self.config
        s = self.setup()
        p = self.built
        n = count_params(p.model)
        seq, kv = self.plan_rows(c)
        mesh_shape = dict(self.mesh.shape) if self.mesh is not None else {}
        summary = (f"[{self.name}] {p.summary}; the model trained: {n:,} parameters, trainable "
                   f"{count_params(nnx.state(p.model, p.trainable)) / n:.2%}\n[{self.name}] memory estimate (as "
                   f"`posttrain plan`):\n" + format_plan(memory_plan(c, p.model.cfg, mesh_shape, seq_len=seq,
                                                                     kv_cache_tokens=kv)))
        hooks = []
        if s.evaluate is not None:  # every train.eval_every steps and after the last; its metrics are logged
            hooks.append(Hook(lambda _step, st, _m: s.evaluate(st), c.train.eval_every))
        if callable(s.batches) and callable(getattr(s.batches, "metrics", None)):  # a rollout's statistics
            hooks.append(MetricsHook(lambda _record: s.batches.metrics()))
        state, result = run_trainer(c, s.state, s.step, s.batches, name=self.name, hooks=hooks, mesh=self.mesh,
                                    rules=self.rules, summary=summary, progress=self.progress,
                                    flops_per_token=p.flops_per_token)
        self.model = merge(s.graphdef, state)
        return result
