"""Typed run configuration: YAML file + dotted command-line overrides -> frozen dataclasses.

What it is: the config sections shared by all trainers (model, data, optim, lora, train, ...),
`RunConfig` (the sections every recipe's config extends), the SFT config and the RL field groups
`Sampling` / `Rewards`. The loading rules (`load`, `from_dict`, `to_dict`, `save`, `read_yaml`,
`parse_override`, the bounds `Positive`, `AtLeast1`, ... and the `Section` base) live in
`posttrain.config_rules` and are re-exported here, so `config.load(...)` is the one way to load.

What it is not: not a schema library of its own (field types: int, float, str, bool, Optional[X],
tuple[X, ...], Literal[...], nested dataclasses, dict[str, X], dict[int, X]), and it does not
resolve paths or load models or data: sections only hold and validate values (`__post_init__`).
Trainer-specific configs (DPO, GRPO, ...) live next to their trainers and reuse these sections.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

from annotated_types import Ge, Interval

from posttrain.config_rules import (  # noqa: F401  (re-exported: posttrain.config is where users load configs)
    AtLeast1,
    Count,
    NonNegative,
    Positive,
    Probability,
    Rate,
    Section,
    Seed,
    bound_text,
    field_limits,
    from_dict,
    load,
    load_yaml,
    parse_override,
    read_yaml,
    save,
    to_dict,
    unknown_key,
)
from posttrain.errors import PosttrainError

# ----------------------------------------------------------------------------- shared sections

@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    key = "model"

    path: str | None = None  # local HF checkpoint folder (config.json + safetensors); default None
    preset: str | None = None  # or a named preset, randomly initialised (tests, demo); default None
    tokenizer: str | None = None  # folder; None = model path, or the byte tokenizer with a preset
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype; default "float32"
    # activation dtype; None = dtype, "bfloat16" for mixed precision
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    remat: bool = False  # rematerialise each layer in the backward pass (less memory, ~30% more compute)
    # what a rematerialised layer keeps: "full" (its input only: least memory) or "dots" (the outputs of its weight
    # matmuls: only element-wise parts and attention are recomputed); default "full"
    remat_policy: Literal["full", "dots"] = "full"
    # matmul precision of the model's forward; None = JAX's default (on a TPU: bfloat16 passes for float32
    # operands). "highest" for float32-exact matmuls on a TPU; default None
    matmul_precision: Literal["default", "high", "highest"] | None = None
    # run the decoder layers as one lax.scan when they are identical (compiles one layer, not each: docs/tpu.md);
    # off by default until measured on a TPU
    scan_layers: bool = False
    seed: Seed = 0  # PRNG seed of a preset's weights, LoRA adapters (and their dropout) and new heads
    # model.path is a multimodal Gemma 4 folder (model_type gemma4): load its text model only (the
    # vision and audio towers are not supported); a vision-language folder (gemma3, qwen3_vl): its text model
    # alone (text rows only); default false
    text_only: bool = False
    # a vision-language folder (qwen3_vl, gemma3): train its vision tower (Gemma 3: and projector) too; false = the
    # tower stays frozen (image rows train the text model, and LoRA adapters only ever go on the text model);
    # default false
    train_vision: bool = False

    def __post_init__(self):
        super().__post_init__()
        if (self.path is None) == (self.preset is None):
            got = "both" if self.path is not None else "neither"
            raise PosttrainError(f"set exactly one of model.path (a local HF checkpoint folder) or "
                                 f"model.preset (a named random-init preset); got {got}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    key = "data"

    train: str  # training data: .jsonl, .parquet or a datasets.save_to_disk folder (required)
    eval: str | None = None  # held-out data in the same formats; None = no evaluation set
    max_length: Annotated[int, Ge(2)] = 512  # tokens per sequence (and per packed row); default 512
    # What to do with rows longer than max_length: raise, keep the first / last tokens, or skip the row.
    truncation: Literal["error", "keep_start", "keep_end", "drop"] = "error"
    packing: bool = False  # concatenate short rows into max_length rows (no cross-row attention)
    completion_only_loss: bool = True  # prompt/completion rows: loss on completion tokens only
    assistant_only_loss: bool = True  # chat rows: loss on assistant turns only
    skip_bad_rows: bool = False  # skip malformed rows with a warning instead of raising
    shuffle: bool = True  # shuffle rows every epoch; default true
    seed: Seed = 0  # shuffle seed; default 0



@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceDataSection(Section):
    key = "data"

    train: str  # preference pairs: .jsonl, .parquet or a save_to_disk folder (TRL formats; required)
    eval: str | None = None  # held-out pairs in the same formats; None = no evaluation set
    max_length: Annotated[int, Ge(2)] = 512  # tokens of the prompt + the longer answer (TRL's meaning); default 512
    # with truncation=truncate: keep only the prompt's last tokens; None = the whole prompt
    max_prompt_length: int | None = None
    # Pairs longer than max_length: raise naming the row, truncate (prompt from the start, answers
    # at the end), or drop the pair (counted).
    truncation: Literal["error", "truncate", "drop"] = "error"
    skip_bad_rows: bool = False  # skip malformed rows (counted, one warning) instead of raising
    shuffle: bool = True  # shuffle pairs every epoch; default true
    seed: Seed = 0  # shuffle seed; default 0

    def __post_init__(self):
        super().__post_init__()
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.max_length:
            raise PosttrainError(f"data.max_prompt_length must be in [1, max_length={self.max_length}), got "
                                 f"{self.max_prompt_length}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptDataSection(Section):
    key = "data"

    train: str  # prompt rows: {"prompt": str | [messages], other columns...} (.jsonl, .parquet, folder)
    max_prompt_length: AtLeast1 = 256  # the sampler's prompt budget in tokens; longer prompts are row errors
    eval: str | None = None  # held-out prompt rows for the sampled evaluation (eval.k); None = no evaluation
    skip_bad_rows: bool = False  # skip (and count) bad rows instead of raising
    shuffle: bool = True  # shuffle the prompt stream every epoch
    seed: Seed = 0  # seed of the prompt stream's shuffle and of the rollouts' sampling keys



@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSection(Section):
    key = "optim"

    lr: Positive = 1e-5  # peak learning rate (after warmup); default 1e-5
    schedule: Literal["constant", "linear", "cosine"] = "cosine"  # decay after warmup; default cosine
    warmup_steps: Count = 0  # optimizer steps of linear warmup from 0 to lr; default 0
    min_lr_ratio: Probability = 0.0  # final lr as a fraction of lr for linear/cosine decay; default 0.0
    weight_decay: NonNegative = 0.0  # decoupled (AdamW) weight decay per step, times lr; default 0.0
    beta1: Rate = 0.9  # Adam first-moment decay; default 0.9
    beta2: Rate = 0.999  # Adam second-moment decay; default 0.999
    eps: Positive = 1e-8  # Adam denominator epsilon; default 1e-8
    max_grad_norm: Positive | None = 1.0  # global-norm gradient clipping; None = off; default 1.0



@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection(Section):
    key = "lora"

    enabled: bool = False  # train low-rank adapters instead of all weights; default false
    rank: AtLeast1 = 8  # adapter rank r; default 8
    alpha: Positive = 16.0  # scaling numerator: update = (alpha / rank) * B @ A; default 16.0
    dropout: Rate = 0.0  # dropout probability on the adapter input; default 0.0
    # Projections to adapt: a projection's name (attention qkv, o; MLP gate_up, down; Gated DeltaNet layers
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) matches that projection in every layer; anything
    # else is a regex searched in the parameter path (e.g. 'layers\\.0\\.attn\\.qkv'). Default: all of them.
    targets: tuple[str, ...] = ("qkv", "o", "gate_up", "down", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                "out_proj")



@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection(Section):
    key = "train"

    steps: AtLeast1 = 100  # optimizer steps; default 100
    batch_size: AtLeast1 = 8  # sequences per optimizer step (global, across devices); default 8
    micro_batch_size: AtLeast1 | None = None  # sequences per forward/backward; None = batch_size
    log_every: Count = 10  # steps between metric logs; default 10
    eval_every: Count = 0  # steps between evaluations; 0 = off; default 0
    seed: Seed = 0  # the train state's PRNG key (handed to the loss as rng) and distill's teacher sampling
    max_nonfinite: AtLeast1 = 3  # halt after this many non-finite (NaN/Inf) steps in a row; each is skipped

    def __post_init__(self):
        super().__post_init__()
        micro = self.micro_batch_size
        if micro is not None and self.batch_size % micro:
            raise PosttrainError(f"train.micro_batch_size ({micro}) must divide train.batch_size "
                                 f"({self.batch_size}) evenly: gradients are accumulated over "
                                 f"batch_size / micro_batch_size steps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection(Section):
    key = "checkpoint"

    every: Count = 0  # steps between checkpoints; 0 = only at the end; default 0
    keep: AtLeast1 = 2  # newest checkpoints kept on disk; default 2
    # an evaluation metric whose best step is kept beside the newest `keep` (e.g. eval_pass@1, eval_loss);
    # `posttrain export --run R --best` exports that step. None = off
    best_metric: str | None = None
    best_mode: Literal["max", "min"] = "max"  # whether a larger or a smaller best_metric is better
    async_save: bool = True  # write checkpoints in the background while training continues
    resume: bool = True  # re-running the same command continues from the latest valid checkpoint



@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection(Section):
    """The sampled evaluation (`posttrain.evals`): every train.eval_every steps, eval.k samples for each prompt
    of data.eval, scored by reward functions: eval_pass@1, eval_pass@k, eval_maj@k, eval_reward, eval_length."""

    key = "eval"

    k: Count = 0  # samples per prompt; 0 = no sampled evaluation (a loss-only eval_every, where there is one)
    max_new_tokens: AtLeast1 | None = None  # completion budget; None = the RL section's, else 64
    temperature: Positive = 1.0  # sampling temperature of the evaluation samples
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0  # nucleus sampling; 1 = off
    top_k: Count = 0  # top-k sampling; 0 = off
    # reward -> weight, as grpo.rewards; None = the RL section's rewards, else {math_answer: 1.0}
    rewards: dict[str, float] | None = None
    correct_at: float = 1.0  # a sample counts as correct (pass@k, maj@k) when its total reward is at least this
    max_prompts: AtLeast1 | None = None  # evaluate the first N prompts of data.eval only; None = all
    prompts_per_call: AtLeast1 = 64  # prompts per sampler call (k samples each)
    seed: Seed = 0  # the sampling key (the same at every evaluation)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsSection(Section):
    key = "metrics"

    # Where metrics go: any of console, jsonl, tensorboard, prometheus, wandb (pip install 'posttrain[wandb]').
    sinks: tuple[Literal["console", "jsonl", "tensorboard", "prometheus", "wandb"], ...] = ("console", "jsonl")
    prometheus_host: str = "127.0.0.1"  # the exporter binds here (loopback unless you change it)
    # HTTP port of the Prometheus exporter; 0 = pick a free port
    prometheus_port: Annotated[int, Interval(ge=0, le=65535)] = 9400
    wandb_project: str = "posttrain"  # W&B project of the wandb sink; its run name = the run folder's name
    peak_flops: Positive | None = None  # per-device peak FLOP/s for MFU; None = measured once on CPU

    def __post_init__(self):
        super().__post_init__()
        import importlib.util

        if "wandb" in self.sinks and importlib.util.find_spec("wandb") is None:  # fail before training, not after
            raise PosttrainError("metrics.sinks names 'wandb' but the wandb package is not installed; install it "
                                 "with `pip install 'posttrain[wandb]'` or drop 'wandb' from metrics.sinks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSection(Section):
    key = "profile"

    start_step: Count = 0  # first profiled step; 0 = profiler off
    num_steps: AtLeast1 = 3  # steps traced into <run_dir>/profile



@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingSection(Section):
    key = "sharding"

    # Mesh preset over all devices: dp | fsdp | tp | fsdp_tp; None = one device, no mesh.
    preset: Literal["dp", "fsdp", "tp", "fsdp_tp"] | None = None
    # Explicit axis sizes, e.g. {data: 2, fsdp: 2, tensor: 2}; None = the preset's default layout.
    mesh_shape: dict[str, int] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.mesh_shape is not None:
            bad = set(self.mesh_shape) - {"data", "fsdp", "tensor"}
            if bad:
                raise PosttrainError(f"sharding.mesh_shape: unknown axes {sorted(bad)}; use data, fsdp, tensor")
            if self.preset is None:
                raise PosttrainError("sharding.mesh_shape needs sharding.preset (its logical-axis rules)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The sections every training run has; each recipe's config extends it (re-declaring `data` with its
    own data section, `run_dir` with its default) and adds its own section."""

    model: ModelSection  # the model to train: a HF folder or a preset (required)
    data: DataSection  # training data (required)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)  # AdamW + lr schedule
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)  # adapters; off by default
    train: TrainSection = dataclasses.field(default_factory=TrainSection)  # steps, batch, logging
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)  # sampled evaluation (pass@k); off by default
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)  # save / resume
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)  # metric sinks, MFU
    profile: ProfileSection = dataclasses.field(default_factory=ProfileSection)  # JAX profiler window
    sharding: ShardingSection = dataclasses.field(default_factory=ShardingSection)  # device mesh
    run_dir: str = "runs/run"  # folder for checkpoints, logs and the saved config


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(RunConfig):
    run_dir: str = "runs/sft"  # folder for checkpoints, logs and the saved config; default runs/sft


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling(Section):
    """The sampling settings of an RL section (grpo, ppo): flattened into it, so the keys are grpo.temperature ..."""

    num_generations: AtLeast1 = 8  # samples per prompt
    max_new_tokens: AtLeast1 = 64  # completion budget per sample
    temperature: Positive = 1.0  # sampling temperature (the loss uses the same one)
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0  # nucleus sampling; 1 = off
    top_k: Count = 0  # top-k sampling; 0 = off


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSection(Section):
    """How an RL recipe's sampler relates to the trained weights: its precision and the correction of the
    log-prob mismatch that a different precision brings (docs/guides/grpo.md)."""

    key = "rollout"

    dtype: Literal["float32", "bfloat16"] | None = None  # sampling precision; None = the model's (exact log-probs)
    # the sampler's KV cache storage (generate.sampling.KV_DTYPES): float8 / int8 halve its bytes (a decode step reads
    # less); its log-probs are then not the trainer's, as with dtype; None = the sampling precision's
    kv_dtype: Literal["float8_e4m3fn", "float8_e5m2", "int8", "bfloat16", "float16", "float32"] | None = None
    # importance-sampling correction of the sampler/trainer mismatch (TRL's vllm_importance_sampling_mode):
    # token_truncate (TIS), token_mask, sequence_truncate, sequence_mask; None = none
    is_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None = None
    is_clip_max: Positive | None = 3.0  # upper bound of the correction weight (truncate: clip; mask: zero above)
    is_clip_min: NonNegative | None = None  # lower bound; None = none
    # off-policy rollouts: step r trains on a batch sampled by the weights of step r - max_staleness, sampled
    # in the background while the trainer updates (rl/offpolicy.py); 0 = on-policy, sampled before each step
    max_staleness: Count = 0
    # devices of the sampler's own mesh (the last ones; the weights are pushed to them after every update, device
    # to device), the training mesh on the others; 0 = sample on the training mesh. Needs sharding.preset
    devices: Count = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESection(Section):
    """Mixture-of-experts settings of an RL recipe."""

    key = "moe"

    # the sampler records the experts each token was routed to; the update's forward uses them (the gate
    # weights still come from the current router), so the policy gradient goes through the routing the
    # sample used (R3)
    routing_replay: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rewards(Section):
    """The reward settings of an RL section (grpo, ppo; `rewards.registry` reads them), flattened into it."""

    # reward -> weight: built-ins (math_answer, last_number, countdown, code_tests, format, overlong,
    # reward_model) or "module:function"
    rewards: dict[str, float] = dataclasses.field(default_factory=lambda: {"math_answer": 1.0})
    format_pattern: str | None = None  # regex for the "format" reward (full match)
    overlong_cache: Count = 0  # DAPO soft overlong penalty: tokens of the soft zone before max_new_tokens
    reward_model: str | None = None  # a *ForSequenceClassification folder for the "reward_model" reward
    reward_timeout_s: Positive | None = 60.0  # a reward call running longer counts as failed
    # where code_tests runs model-written code: auto (bwrap, else a fresh uid as root), bwrap, uid, or
    # unsafe_inprocess_guard (a Python-level guard only; warns). See posttrain/sandbox and docs/security.md
    sandbox: str = "auto"
    on_reward_error: Literal["zero", "drop"] = "zero"  # failed reward: 0, or drop the samples from the loss

    def __post_init__(self):
        super().__post_init__()
        if not self.rewards:
            raise PosttrainError(f"{self.key}.rewards is empty; name at least one reward function, e.g. "
                                 "{math_answer: 1.0}")
        for name, w in self.rewards.items():
            if not math.isfinite(w):
                raise PosttrainError(f"{self.key}.rewards.{name}: the weight must be a finite number, got {w}")
        if self.overlong_cache > getattr(self, "max_new_tokens", self.overlong_cache):
            raise PosttrainError(f"{self.key}.overlong_cache must be in [0, {self.key}.max_new_tokens="
                                 f"{self.max_new_tokens}], got {self.overlong_cache}")
