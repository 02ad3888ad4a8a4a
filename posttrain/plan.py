"""Per-device memory plan of a training (or sampling) setup, before any array is allocated.

`plan(model_cfg, batch=..., seq_len=..., mesh_shape={...}, preset=...)` returns bytes per device
for parameters, optimizer state, gradients, activations and the KV cache. Parameter shapes come
from the model itself (`nnx.eval_shape`: nothing is allocated) and each tensor's bytes are divided
by the product of the mesh axes that the preset's rules shard it over (the exact placement
`posttrain.sharding` gives it, indivisible dimensions included); a mixture-of-experts model counts
every expert (all are held; the `expert` axis splits them over fsdp) and the activations of the
k experts each token is routed to. Per-layer shapes (Gemma 4: global layers' own head size and kv
heads, KV-shared layers without a cache of their own, double-wide MLPs, per-layer inputs, experts
beside the dense MLP) are counted layer by layer. `format_plan` renders the dict
and warns when the total exceeds a device's memory.

What it is not: XLA's buffer assignment. Parameters, gradients and optimizer state are exact;
activations are an estimate of the tensors a train step keeps for its backward pass (listed in
`_activation_bytes`), and XLA's temporaries, fragmentation and the runtime's reserve come on top.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import jax.numpy as jnp
from flax import nnx

from posttrain import sharding as sh
from posttrain.errors import PosttrainError
from posttrain.losses.logps import chunk_len
from posttrain.models.attention import TPU_TILE, choose
from posttrain.models.config import ModelConfig
from posttrain.models.deltanet import CHUNK

KEYS = ("parameters", "optimizer", "gradients", "activations", "kv_cache")


def _axis_sizes(mesh_shape: Mapping[str, int]) -> dict:
    bad = set(mesh_shape) - set(sh.MESH_AXES)
    if bad:
        raise PosttrainError(f"plan: mesh_shape names unknown axes {sorted(bad)}; the axes are {sh.MESH_AXES}")
    sizes = {a: int(mesh_shape.get(a, 1)) for a in sh.MESH_AXES}
    if any(s <= 0 for s in sizes.values()):
        raise PosttrainError(f"plan: mesh_shape sizes must be positive, got {dict(mesh_shape)}")
    return sizes


def _abstract_model(cfg: ModelConfig, trainable: str, lora_rank: int, lora_targets):
    from posttrain.models.transformer import Transformer

    if trainable == "full":
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    if trainable == "lora":
        from posttrain.models.lora import PROJECTIONS, apply_lora

        return nnx.eval_shape(lambda: apply_lora(Transformer(cfg, rngs=nnx.Rngs(0)), rank=lora_rank,
                                                 targets=lora_targets or PROJECTIONS))
    raise PosttrainError(f"plan: trainable must be 'full' or 'lora', got {trainable!r}")


def param_bytes_per_device(state, rules: dict, axis_sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of an (abstract) NNX state placed by `rules`."""
    total = 0
    for _, v in nnx.to_flat_state(state):
        shape = tuple(v.shape)
        names = v.get_metadata().get("out_sharding")
        spec = sh.param_spec(names, shape, rules, axis_sizes)
        total += math.prod(shape) * jnp.dtype(v.dtype).itemsize // sh.spec_axis_product(spec, axis_sizes)
    return total


def _split(n: int, ways: int) -> int:
    return -(-n // ways)


def _activation_bytes(cfg: ModelConfig, rows: int, seq_len: int, t: int, remat: bool) -> int:
    """Estimate of what a train step keeps for the backward pass on one device.

    rows: sequences on this device; t: the tensor-parallel split of heads, mlp and vocab.
    Per layer and token (compute dtype): the residual input, two norm outputs, the attention
    output projection and residual (5 D); qkv, rotated q and k, attention output
    ((K (G + 2) + 2 N + K) H / t, with that layer's K, H and projections); gate/up, activation and
    product (4 F / t; an MoE layer: k times its expert width, plus the k dispatched inputs and outputs
    and the router logits; both beside a dense MLP); Gemma 4 per-layer inputs (3 P + D); attention: on the
    dense path (short rows, models/attention.py `choose`) the float32 scores and compute-dtype
    probabilities over seq_len keys (N seq_len / t each), on the blockwise path only a float32
    log-sum-exp per query and head (N / t): its tiles are recomputed in the backward pass.
    With remat only each layer's input (D) is kept, plus one layer's full set during its backward, and on the
    blockwise path that layer's attention backward (`_attention_backward_bytes`: its float32 dq, dk, dv
    accumulators and two [rows, N / t, tile, tile] tiles) beside them.
    The loss head keeps the final hidden state per token (D); its float32 logits exist one chunk at a time
    (`losses.logps.token_logps`: at most LOGIT_BUDGET elements, [rows, T, V / t] when that fits), three such
    arrays at the peak (logits, their softmax, their gradient).
    """
    D, N = cfg.embed_dim, cfg.num_heads
    cb = jnp.dtype(cfg.dtype).itemsize
    tokens = rows * seq_len
    dense = choose("cpu", T=seq_len, S=seq_len, branches=False, softcap=False, cached=False) == "dense"
    attn = _split(N * seq_len, t) * (4 + cb) if dense else _split(N, t) * 4
    ple = 3 * cfg.per_layer_dim + D if cfg.per_layer_dim else 0
    per_layer = [(5 * D + _heads(cfg, i, t) + _mlp_activations(cfg, i, t) + ple) * cb + attn
                 for i in range(cfg.num_layers)]
    backward = 0 if dense else max(_attention_backward_bytes(cfg, i, rows, seq_len, t) for i in range(cfg.num_layers))
    layers = cfg.num_layers * D * cb + max(per_layer) if remat else sum(per_layer)
    V = _split(cfg.vocab_size, t)
    logits = rows * chunk_len(rows, seq_len, V) * V
    return tokens * (layers + D * cb) + 3 * 4 * logits + (backward if remat else 0)


def _attention_backward_bytes(cfg: ModelConfig, i: int, rows: int, seq_len: int, t: int) -> int:
    """Layer i's blockwise attention backward (models/attention.py `_flash`'s VJP), live while that layer's
    gradients are computed: float32 accumulators of dq, dk and dv over the whole row ((N + 2 K) H per token,
    the heads split t ways) and two compute-dtype [rows, N / t, tile, tile] tiles (the recomputed
    probabilities and their gradient; the tile a TPU uses, TPU_TILE, or the row when shorter).

    Measured (XLA's live ranges at the peak of the llama3-1b GRPO update with full remat, 8 rows x 1,152
    tokens padded to 1,536, on a v5e): dq f32 [8, 8, 4, 1536, 64] 0.101 GB (twice: the loop carry in and out),
    dk and dv f32 [8, 8, 1536, 64] 0.025 GB each, two bf16 [8, 8, 4, 512, 512] tiles 0.134 GB each: 0.54 GB in
    all; this counts dq once over the unpadded row: 0.38 GB."""
    K, H, cb = cfg.layer_kv_heads(i), cfg.layer_head_dim(i), jnp.dtype(cfg.dtype).itemsize
    tile = min(TPU_TILE, seq_len)
    accumulators = rows * seq_len * _split((cfg.num_heads + 2 * K) * H, t) * 4
    return accumulators + 2 * rows * _split(cfg.num_heads, t) * tile * tile * cb


def _heads(cfg: ModelConfig, i: int, t: int) -> int:
    """Per-token attention activations of layer i: projections, rotated q (and k), output."""
    K, H, c = cfg.layer_kv_heads(i), cfg.layer_head_dim(i), cfg.layer_kv_slots(i)
    return _split((K * (cfg.num_heads // K + c) + 2 * cfg.num_heads + (K if c else 0)) * H, t)


def _mlp_activations(cfg: ModelConfig, i: int, t: int) -> int:
    """Per-token MLP activations of layer i (compute-dtype elements), tensor split t."""
    dense = _split(4 * cfg.layer_mlp_dim(i), t)
    if not cfg.is_moe_layer(i):
        return dense
    k = cfg.experts_per_token
    experts = _split(4 * k * cfg.expert_mlp_dim, t) + 2 * k * cfg.embed_dim + cfg.num_experts
    shared = _split(4 * cfg.shared_expert_dim, t) + cfg.embed_dim if cfg.shared_expert_dim else 0
    return experts + shared + (dense + 3 * cfg.embed_dim if cfg.moe_beside_mlp else 0)  # Gemma 4: + its own norms


def layer_flops(cfg: ModelConfig, i: int, seq_len: int) -> int:
    """Forward matmul FLOPs per token of layer i (what MFU counts): q / k / v / output projections (the
    layer's own head size, KV heads and KV slots), attention against `seq_len` keys (QK^T and PV; causal
    masking and windows ignored, the PaLM convention), the dense MLP (its own width) and, on a sparse
    layer, the top-k experts, the router and a shared expert. A Gated DeltaNet layer: its projections and the
    chunked delta rule (linear in length: no `seq_len` term)."""
    D, N, H = cfg.embed_dim, cfg.num_heads, cfg.layer_head_dim(i)
    mlp = 0 if cfg.is_moe_layer(i) and not cfg.moe_beside_mlp else 3 * D * cfg.layer_mlp_dim(i)
    if cfg.is_moe_layer(i):
        mlp += cfg.experts_per_token * 3 * D * cfg.expert_mlp_dim + D * cfg.num_experts
        mlp += 3 * D * cfg.shared_expert_dim + D if cfg.shared_expert_dim else 0  # Qwen3.5-MoE's shared expert
    if cfg.layer_type(i) == "linear":  # Gated DeltaNet: projections, then per value head the chunked rule
        Hv, Dk, Dv = cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        proj = D * (2 * cfg.linear_key_heads * Dk + 2 * Hv * Dv + 2 * Hv) + Hv * Dv * D
        rule = Hv * (3 * Dk * Dv + CHUNK * (3 * Dk + 2 * Dv))  # S reads and update; a whole chunk's products
        return 2 * (proj + mlp + rule)
    proj = D * (N + cfg.layer_kv_heads(i) * cfg.layer_kv_slots(i)) * H + N * H * D
    return 2 * (proj + mlp) + 2 * 2 * N * H * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token of the whole model: every layer's `layer_flops` plus the LM head (2·D·V),
    times 3 when training (the backward costs twice the forward)."""
    forward = float(sum(layer_flops(cfg, i, seq_len) for i in range(cfg.num_layers)) + 2 * cfg.embed_dim
                    * cfg.vocab_size)
    return 3 * forward if training else forward


def _kv_bytes(cfg: ModelConfig, i: int, rules: dict, sizes: dict) -> int:
    """One device's KV-cache bytes per cached token of layer i (KV-shared layers have none: not asked)."""
    K = cfg.layer_kv_heads(i)
    split = sh.spec_axis_product(sh.logical_to_spec(("kv_heads",), rules, shape=(K,), axis_sizes=sizes), sizes)
    return 2 * K * cfg.layer_head_dim(i) * jnp.dtype(cfg.dtype).itemsize // split


def plan(model_cfg: ModelConfig, *, batch: int, seq_len: int, mesh_shape: Mapping[str, int], preset: str,
         trainable: str = "full", optimizer_slots: int = 2, remat: bool = False, kv_cache_tokens: int = 0,
         lora_rank: int = 8, lora_targets=None, micro_batches: int = 1,
         device_bytes: Optional[int] = None) -> dict:
    """Bytes per device: parameters, optimizer, gradients, activations, kv_cache and total.

    batch: global sequences per step (split over data x fsdp); seq_len: tokens per sequence.
    trainable: "full" (every parameter trains) or "lora" (only adapters; the base is frozen and
    has no gradients or optimizer state). optimizer_slots: state arrays per trainable parameter
    (AdamW: 2, SGD with momentum: 1). lora_targets: as `lora.targets` (None: every projection).
    kv_cache_tokens: cached tokens across the whole sampling
    batch (rows x cache length), 0 for training only. batch is one micro-batch's rows; micro_batches (M) of
    them make an optimizer step.

    The total is what XLA's buffer assignment needs at the step's peak (measured on a TPU v5e, llama3-1b,
    docs/benchmarks.md; benchmarks/plan_tpu.py compiles the same steps ahead of time): with one micro-batch and
    no remat the backward pass writes each layer's gradients as it frees that layer's saved activations, so the
    two share their space and the larger counts (`gradients` is then reported once); with remat they do not:
    the layer inputs are small and every layer's backward recomputes that layer's full set of activations, the
    last one (layer 0) beside nearly all of the gradients, so gradients and activations add; with M > 1 the
    accumulated gradients are carried through the micro-batch loop beside the current micro-batch's own, so
    `gradients` counts twice and adds to the activations.

    device_bytes: the memory of one device (a TPU v5e: 15.75 GiB). When the program would need more, XLA's own
    rematerialisation (the compiler's, beside `remat`) recomputes activations until it fits: the compiled step's
    peak is then the device's memory, not the demand (measured: the llama3-1b GRPO update of 8 rows x 1,152
    tokens without remat, demand 22.6 GB, compiles to 16.49 GB on the v5e's 16.91 GB; told 14 GiB, to 14.82 GB).
    `demand` is the total before that and `fitted` says it happened (it costs recompute time).
    """
    rules = sh.preset_rules(preset)
    sizes = _axis_sizes(mesh_shape)
    if batch <= 0 or seq_len <= 0:
        raise PosttrainError(f"plan: batch and seq_len must be positive, got {batch} and {seq_len}")
    model = _abstract_model(model_cfg, trainable, lora_rank, lora_targets)
    params = nnx.state(model, nnx.Param)
    if trainable == "lora":
        from posttrain.models.lora import LoraParam

        train = nnx.state(model, LoraParam)
    else:
        train = params
    p_bytes = param_bytes_per_device(params, rules, sizes)
    t_bytes = param_bytes_per_device(train, rules, sizes)

    batch_ways = sh.spec_axis_product(sh.logical_to_spec(("batch",), rules, axis_sizes=sizes), sizes)
    tensor = sh.spec_axis_product(sh.logical_to_spec(("mlp",), rules, axis_sizes=sizes), sizes)
    rows = _split(batch, batch_ways)
    kv = sum(_kv_bytes(model_cfg, i, rules, sizes) for i in range(model_cfg.cache_layers)) * _split(
        kv_cache_tokens, batch_ways)
    out = {
        "parameters": p_bytes,
        "optimizer": optimizer_slots * t_bytes,
        "gradients": t_bytes * (2 if micro_batches > 1 else 1),
        "activations": _activation_bytes(model_cfg, rows, seq_len, tensor, remat),
        "kv_cache": kv,
    }
    step = (out["gradients"] + out["activations"] if micro_batches > 1 or remat
            else max(out["gradients"], out["activations"]))
    out["demand"] = out["parameters"] + out["optimizer"] + step + out["kv_cache"]
    out["fitted"] = device_bytes is not None and out["demand"] > device_bytes
    out["total"] = min(out["demand"], device_bytes) if out["fitted"] else out["demand"]
    out.update(preset=preset, mesh_shape=sizes, devices=math.prod(sizes.values()), rows_per_device=rows,
               trainable=trainable, remat=remat, micro_batches=micro_batches, device_bytes=device_bytes)
    return out


def _gib(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_plan(d: dict, device_bytes: Optional[int] = None) -> str:
    """The plan as aligned lines; a WARNING line when the total exceeds `device_bytes`."""
    mesh = " x ".join(f"{a} {n}" for a, n in d["mesh_shape"].items() if n > 1) or "1 device"
    lines = [f"memory per device: preset {d['preset']}, mesh {mesh} ({d['devices']} devices), "
             f"{d['rows_per_device']} rows per device, {d['trainable']} training" + (", remat" if d["remat"] else "")]
    for k in KEYS:
        note = "  (estimate)" if k == "activations" else ""
        lines.append(f"  {k.replace('_', ' '):<12} {_gib(d[k]):>12}{note}")
    shared = "gradients + activations (micro-batches)" if d.get("micro_batches", 1) > 1 else \
        "gradients + activations (remat: each layer's backward recomputes its set beside the gradients)" \
        if d["remat"] else \
        "the larger of gradients and activations (the backward pass frees one as it writes the other)"
    if d.get("fitted"):
        lines.append(f"  {'total':<12} {_gib(d['total']):>12}  (the device's memory: the step needs "
                     f"{_gib(d['demand'])}, parameters + optimizer + kv cache + {shared}; XLA rematerialises "
                     "activations to fit, at a cost in time)")
    else:
        lines.append(f"  {'total':<12} {_gib(d['total']):>12}  (parameters + optimizer + kv cache + {shared})")
    if device_bytes is not None:
        lines.append(f"  {'device':<12} {_gib(device_bytes):>12}")
        if d.get("demand", d["total"]) > device_bytes:
            lines.append(f"WARNING: the plan needs {_gib(d.get('demand', d['total']))} per device but a device has "
                         f"{_gib(device_bytes)}; shard more (fsdp / tensor axes), turn on remat, train LoRA, "
                         "or use a smaller batch or micro-batches")
    return "\n".join(lines)
