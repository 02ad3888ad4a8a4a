"""ModelConfig: every architectural choice of the one decoder-only Transformer, and named presets.

Families (Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, Gemma 4 text, and the
mixture-of-experts Qwen3-MoE and Mixtral) differ only in the fields below; there is no second model
class. A mixture-of-experts model (num_experts > 0) swaps the gated MLP of its sparse layers for the
routed block of `models/moe.py`; `dense_layers` keep the dense MLP of width `mlp_dim` (Gemma 4 runs
the routed block beside the dense MLP instead: `moe_beside_mlp`). Gemma 4's per-layer variants
(global layers with their own head size and kv heads, keys-as-values, KV-shared layers, per-layer
input embeddings) are fields too, read per layer through the `layer_*` methods. `hf.py`
translates a Hugging Face config.json into a ModelConfig; `PRESETS` holds the published shapes
(used for memory planning and `eval_shape` parameter counts, never downloaded). Numbers are from
each model's published config.json.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from posttrain.errors import PosttrainError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding of one attention kind (HF `rope_parameters`)."""

    theta: float = 10_000.0  # base frequency
    kind: str = "default"  # "default" | "linear" | "llama3" | "proportional" (Gemma 4 global layers) | "yarn"
    factor: float = 1.0  # linear / llama3 / proportional scaling factor
    partial: float = 1.0  # share of the head that rotates: proportional (Gemma 4), the first partial * H/2 pairs at
    #   the full head's frequencies; default (Qwen3.5), the first partial * H dimensions as a head of that size
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 / yarn: pre-training context length
    beta_fast: float = 32.0  # yarn only: rotations where interpolation starts (HF beta_fast)
    beta_slow: float = 1.0  # yarn only: rotations where extrapolation ends (HF beta_slow)
    truncate: bool = True  # yarn only: round the correction range to whole dimensions (HF truncate)
    attention_factor: Optional[float] = None  # yarn only: cos / sin scale; None = 0.1 ln(factor) + 1 (HF)
    # Qwen3-VL's interleaved M-RoPE (HF mrope_section): of the H/2 frequencies, index j rotates by the height
    # position when j % 3 == 1 and j < 3 * s[1], by the width position when j % 3 == 2 and j < 3 * s[2], else by
    # the temporal / text one; () = plain RoPE. Positions [3, B, T] select it; [B, T] positions (every axis
    # equal) give plain RoPE
    mrope_section: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3", "proportional", "yarn"):
            raise PosttrainError(
                f"unsupported rope type {self.kind!r}; posttrain supports default, linear, llama3, proportional and "
                "yarn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Transformer (HF-style names)."""

    # informational: llama | qwen2 | qwen3 | mistral | gemma[2|3|4] | qwen3_moe | mixtral | gpt_oss
    family: str = "llama"
    vocab_size: int  # tokens
    embed_dim: int  # hidden size D
    num_layers: int
    num_heads: int  # query heads N
    num_kv_heads: int  # key/value heads K (GQA: N % K == 0)
    head_dim: int  # H
    mlp_dim: int  # F, gated MLP inner size
    max_position: int = 8192  # longest position the model was trained for (informational)
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + w) instead of w
    activation: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on q and k per head, before RoPE
    sandwich_norm: bool = False  # Gemma 2/3: extra norms after attention and around the MLP
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(embed_dim)
    tie_embeddings: bool = False  # output head shares the embedding matrix
    query_scale: Optional[float] = None  # attention score scale; None = head_dim ** -0.5
    attn_softcap: Optional[float] = None  # Gemma 2: tanh soft-capping of attention scores
    final_softcap: Optional[float] = None  # Gemma 2: tanh soft-capping of output logits
    sliding_window: Optional[int] = None  # window (tokens, query included) of sliding layers
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding" | "linear" (Gated DeltaNet); () = all full
    rope: RopeConfig = RopeConfig()  # RoPE of full-attention layers
    rope_local: Optional[RopeConfig] = None  # RoPE of sliding layers (Gemma 3); None = `rope`
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of parameters
    remat: bool = False  # recompute each layer's activations in the backward pass (saves memory)
    remat_policy: str = "full"  # what a remat layer keeps: "dots" (weight-matmul outputs) | "full" (its input only)
    # run identical layers as ONE lax.scan over their stacked weights (models/scan.py): XLA compiles one layer, not
    # num_layers; True = wherever the layers allow it; False (the default until it is measured on a TPU) = never
    scan_layers: bool = False
    # matmul precision of the forward ("default" | "high" | "highest"); None = JAX's default. On a TPU the default
    # runs float32 matmuls through bfloat16 passes: "highest" for float32 exactness (parity tests)
    matmul_precision: Optional[str] = None
    # Mixture of experts (models/moe.py); num_experts = 0 is a dense model and ignores the rest.
    num_experts: int = 0  # E, routed experts per sparse layer
    experts_per_token: int = 0  # top-k experts each token is sent to
    expert_mlp_dim: int = 0  # gated MLP inner size of one expert (Qwen3-MoE moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum 1 (Mixtral: always)
    dense_layers: tuple[int, ...] = ()  # layer indices that keep the dense MLP (Qwen3-MoE mlp_only_layers)
    router_aux_loss_coef: float = 0.001  # load-balancing loss weight added by the train step (HF's name)
    router_z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE: mean logsumexp(router logits)^2)
    moe_beside_mlp: bool = False  # Gemma 4: every layer keeps its dense MLP and adds the routed block beside it
    shared_expert_dim: int = 0  # Qwen3.5-MoE: a gated MLP of this width beside the routed experts, * sigmoid(x w)
    #   (own norms; the router normalises its input and learns an input scale and a per-expert weight scale)
    # Gemma 4 per-layer variants (all off by default; see the layer_* methods).
    global_head_dim: Optional[int] = None  # head size of full-attention layers; None = head_dim
    global_kv_heads: Optional[int] = None  # kv heads of full-attention layers; None = num_kv_heads
    k_eq_v: bool = False  # full-attention layers: values are the raw key projection (no v weights)
    v_norm: bool = False  # RMSNorm without a scale on the values, per head
    kv_shared_layers: int = 0  # the last n layers reuse the keys/values (and cache) of the last earlier layer
    #   of their type: no k/v weights of their own, no cache of their own
    double_wide_mlp: bool = False  # KV-shared layers' dense MLP is 2 * mlp_dim wide
    per_layer_dim: int = 0  # P, width of the per-layer input embeddings added after each layer's MLP (0 = none)
    per_layer_vocab: int = 0  # tokens of the per-layer embedding table; 0 = vocab_size
    layer_scalar: bool = False  # each layer's output is multiplied by a loaded (never trained) scalar
    # GPT-OSS (all off by default)
    attn_sinks: bool = False  # a learned logit per query head joins every softmax (its value is zero)
    o_bias: bool = False  # the attention output projection has a bias
    router_bias: bool = False  # the MoE router has a bias
    expert_bias: bool = False  # each expert's gate/up and down projections have biases
    expert_act: str = "glu"  # "glu": act(gate) * up; "gpt_oss": clamped (7) gate * sigmoid(1.702 gate) * (up + 1)
    # Qwen3.5 (all off by default; models/qwen3_5.py): Gated DeltaNet layers (layer type "linear",
    # models/deltanet.py) beside gated full attention
    attn_output_gate: bool = False  # q projection makes [q | gate] per head; output *= sigmoid(gate) before o
    linear_key_heads: int = 0  # Gated DeltaNet key heads (q and k)
    linear_value_heads: int = 0  # Gated DeltaNet value heads (a multiple of linear_key_heads)
    linear_key_dim: int = 0  # size of a key head
    linear_value_dim: int = 0  # size of a value head
    linear_conv_kernel: int = 4  # taps of the causal depthwise convolution over the q, k, v channels
    # Vision-language (#52): the vision tower's config (posttrain.vision.qwen_vl.VisionConfig); None = text only
    vision: Optional[Any] = None

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "mlp_dim"):
            if getattr(self, name) <= 0:
                raise PosttrainError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise PosttrainError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.remat_policy not in ("full", "dots"):
            raise PosttrainError(f"model config: remat_policy {self.remat_policy!r} is not full or dots")
        if self.matmul_precision not in (None, "default", "high", "highest"):
            raise PosttrainError(f"model config: matmul_precision {self.matmul_precision!r} is not default, high or "
                                 "highest")
        if self.activation not in ("silu", "gelu_tanh"):
            raise PosttrainError(f"model config: activation {self.activation!r} is not silu or gelu_tanh")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise PosttrainError(
                    f"model config: layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_layers} layers"
                )
            bad = set(self.layer_types) - {"full", "sliding", "linear"}
            if bad:
                raise PosttrainError(f"model config: unknown layer types {sorted(bad)}; use full|sliding|linear")
            lin = (self.linear_key_heads, self.linear_value_heads, self.linear_key_dim, self.linear_value_dim,
                   self.linear_conv_kernel)
            if "linear" in self.layer_types and (min(lin) <= 0 or self.linear_value_heads % self.linear_key_heads):
                raise PosttrainError("model config: linear layers need linear_key_heads, linear_value_heads (a "
                                     "multiple of linear_key_heads), linear_key_dim, linear_value_dim and "
                                     f"linear_conv_kernel > 0, got {lin}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise PosttrainError("model config: sliding layers need sliding_window > 0")
        if self.num_experts < 0:
            raise PosttrainError(f"model config: num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise PosttrainError(f"model config: experts_per_token must be in 1..num_experts ({self.num_experts}), "
                                     f"got {self.experts_per_token}")
            if self.expert_mlp_dim <= 0:
                raise PosttrainError(f"model config: expert_mlp_dim must be positive, got {self.expert_mlp_dim}")
            bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
            if bad:
                raise PosttrainError(f"model config: dense_layers {bad} are not layer indices 0..{self.num_layers - 1}")
            if self.expert_act not in ("glu", "gpt_oss"):
                raise PosttrainError(f"model config: expert_act {self.expert_act!r} is not glu or gpt_oss")
            if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
                raise PosttrainError("model config: router_aux_loss_coef and router_z_loss_coef must be >= 0")
        if self.global_kv_heads and self.num_heads % self.global_kv_heads:
            raise PosttrainError(f"model config: num_heads ({self.num_heads}) must be a multiple of global_kv_heads "
                                 f"({self.global_kv_heads})")
        if not 0 <= self.kv_shared_layers < self.num_layers:
            raise PosttrainError(f"model config: kv_shared_layers must be in 0..{self.num_layers - 1} (fewer than "
                                 f"num_layers), got {self.kv_shared_layers}")
        for i in range(self.cache_layers, self.num_layers):
            if self.kv_source(i) is None:
                raise PosttrainError(f"model config: KV-shared layer {i} ({self.layer_type(i)}) has no earlier "
                                     f"{self.layer_type(i)} layer to share with; lower kv_shared_layers")
        if self.per_layer_dim < 0 or self.per_layer_vocab < 0:
            raise PosttrainError("model config: per_layer_dim and per_layer_vocab must be >= 0")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i routes over experts (models/moe.py): instead of its dense MLP, or beside it."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def layer_type(self, i: int) -> str:
        if self.layer_types:
            return self.layer_types[i]
        return "sliding" if self.sliding_window else "full"

    def layer_window(self, i: int) -> Optional[int]:
        return self.sliding_window if self.layer_type(i) == "sliding" else None

    def layer_rope(self, i: int) -> RopeConfig:
        if self.layer_type(i) == "sliding" and self.rope_local is not None:
            return self.rope_local
        return self.rope

    def layer_head_dim(self, i: int) -> int:
        """H of layer i: full-attention layers may have their own (Gemma 4 global_head_dim)."""
        return (self.global_head_dim or self.head_dim) if self.layer_type(i) == "full" else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return (self.global_kv_heads or self.num_kv_heads) if self.layer_type(i) == "full" else self.num_kv_heads

    def layer_k_eq_v(self, i: int) -> bool:
        """Whether layer i's values are its raw key projection (Gemma 4 attention_k_eq_v: full layers only)."""
        return self.k_eq_v and self.layer_type(i) == "full"

    def layer_kv_slots(self, i: int) -> int:
        """Projections layer i makes after its queries: 2 (k, v), 1 (k: keys are values), 0 (KV-shared layer)."""
        return 0 if self.kv_source(i) is not None else 1 if self.layer_k_eq_v(i) else 2

    @property
    def cache_layers(self) -> int:
        """Layers with keys, values and a KV cache of their own: all but the last kv_shared_layers."""
        return self.num_layers - self.kv_shared_layers

    def kv_source(self, i: int) -> Optional[int]:
        """The layer whose keys and values layer i attends (the last non-shared layer of its type), or None."""
        if i < self.cache_layers:
            return None
        return next((j for j in reversed(range(self.cache_layers)) if self.layer_type(j) == self.layer_type(i)), None)

    def layer_mlp_dim(self, i: int) -> int:
        """Dense MLP width of layer i (Gemma 4 double_wide_mlp: KV-shared layers are twice as wide)."""
        return 2 * self.mlp_dim if self.double_wide_mlp and i >= self.cache_layers else self.mlp_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _gemma3_types(n: int, every: int = 6) -> tuple[str, ...]:
    # Gemma 3: five sliding layers, then one global layer.
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(n))


def _gemma2_types(n: int) -> tuple[str, ...]:
    # Gemma 2: sliding and global layers alternate, starting with sliding.
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))


_LLAMA31_ROPE = RopeConfig(theta=500_000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position=8192)
_LLAMA32_ROPE = dataclasses.replace(_LLAMA31_ROPE, factor=32.0)

_GEMMA3 = dict(family="gemma3", norm_eps=1e-6, norm_unit_offset=True, activation="gelu_tanh", qk_norm=True,
               sandwich_norm=True, embed_scale=True, tie_embeddings=True, head_dim=256,
               rope_local=RopeConfig(theta=10_000.0), max_position=131_072)

# Gemma 4 text: plain (w) norms, values normalised, unit query scale, proportional RoPE (a quarter of the
# pairs rotate) on the global layers, which have 512-wide heads. Shapes from the published config.json
# text_config of google/gemma-4-{E2B,E4B,26B-A4B,31B} (not shipped with transformers).
_GEMMA4 = dict(family="gemma4", vocab_size=262_144, norm_eps=1e-6, activation="gelu_tanh", qk_norm=True, v_norm=True,
               sandwich_norm=True, embed_scale=True, tie_embeddings=True, head_dim=256, global_head_dim=512,
               query_scale=1.0, final_softcap=30.0, layer_scalar=True, rope_local=RopeConfig(theta=10_000.0),
               rope=RopeConfig(theta=1_000_000.0, kind="proportional", partial=0.25))

# Qwen3.5 / Qwen3-Next public sizes: gated attention heads of 256, 16 linear key heads of 128, every 4th layer full
# attention, RoPE on a quarter of each head (theta: the classes' default; a real folder's config.json sets its own)
_QWEN_HYBRID = dict(head_dim=256, max_position=32_768, norm_eps=1e-6, norm_unit_offset=True, qk_norm=True,
                    attn_output_gate=True, linear_key_heads=16, linear_key_dim=128, linear_value_dim=128,
                    rope=RopeConfig(theta=10_000.0, partial=0.25))


def _qwen_hybrid_types(n: int) -> tuple[str, ...]:
    return ("linear", "linear", "linear", "full") * (n // 4)


PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        family="llama", vocab_size=128_256, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, max_position=131_072, rope=_LLAMA31_ROPE),
    "llama3-1b": ModelConfig(
        family="llama", vocab_size=128_256, embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, mlp_dim=8192, max_position=131_072, rope=_LLAMA32_ROPE, tie_embeddings=True),
    "qwen2.5-0.5b": ModelConfig(
        family="qwen2", vocab_size=151_936, embed_dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, mlp_dim=4864, max_position=32_768, norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, rope=RopeConfig(theta=1_000_000.0)),
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151_936, embed_dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, mlp_dim=3072, max_position=40_960, norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
        rope=RopeConfig(theta=1_000_000.0)),
    "qwen3-8b": ModelConfig(
        family="qwen3", vocab_size=151_936, embed_dim=4096, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=12_288, max_position=40_960, norm_eps=1e-6, qk_norm=True,
        rope=RopeConfig(theta=1_000_000.0)),
    "mistral-7b": ModelConfig(
        family="mistral", vocab_size=32_768, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, max_position=32_768, rope=RopeConfig(theta=1_000_000.0)),
    "gemma2-2b": ModelConfig(
        family="gemma2", vocab_size=256_000, embed_dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
        head_dim=256, mlp_dim=9216, max_position=8192, norm_eps=1e-6, norm_unit_offset=True,
        activation="gelu_tanh", sandwich_norm=True, embed_scale=True, tie_embeddings=True,
        query_scale=256 ** -0.5, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
        layer_types=_gemma2_types(26)),
    "gemma3-1b": ModelConfig(
        **_GEMMA3, vocab_size=262_144, embed_dim=1152, num_layers=26, num_heads=4, num_kv_heads=1,
        mlp_dim=6912, query_scale=256 ** -0.5, sliding_window=512, layer_types=_gemma3_types(26),
        rope=RopeConfig(theta=1_000_000.0)),
    "gemma3-4b": ModelConfig(
        **_GEMMA3, vocab_size=262_208, embed_dim=2560, num_layers=34, num_heads=8, num_kv_heads=4,
        mlp_dim=10_240, query_scale=256 ** -0.5, sliding_window=1024, layer_types=_gemma3_types(34),
        rope=RopeConfig(theta=1_000_000.0, kind="linear", factor=8.0)),
    # Gemma 4: the "effective" E2B / E4B sizes (per-layer input embeddings, KV-shared last layers), the
    # 26B-A4B mixture of experts (128 experts of width 704, top 8, beside a dense MLP) and the dense 31B.
    "gemma4-e2b": ModelConfig(
        **_GEMMA4, embed_dim=1536, num_layers=35, num_heads=8, num_kv_heads=1, mlp_dim=6144, max_position=131_072,
        sliding_window=512, layer_types=_gemma3_types(35, every=5), per_layer_dim=256, kv_shared_layers=20,
        double_wide_mlp=True),
    "gemma4-e4b": ModelConfig(
        **_GEMMA4, embed_dim=2560, num_layers=42, num_heads=8, num_kv_heads=2, mlp_dim=10_240, max_position=131_072,
        sliding_window=512, layer_types=_gemma3_types(42), per_layer_dim=256, kv_shared_layers=18),
    "gemma4-26b-a4b": ModelConfig(
        **_GEMMA4, embed_dim=2816, num_layers=30, num_heads=16, num_kv_heads=8, global_kv_heads=2, k_eq_v=True,
        mlp_dim=2112, max_position=262_144, sliding_window=1024, layer_types=_gemma3_types(30), num_experts=128,
        experts_per_token=8, expert_mlp_dim=704, moe_beside_mlp=True, router_aux_loss_coef=0.0),
    "gemma4-31b": ModelConfig(
        **_GEMMA4, embed_dim=5376, num_layers=60, num_heads=32, num_kv_heads=16, global_kv_heads=4, k_eq_v=True,
        mlp_dim=21_504, max_position=262_144, sliding_window=1024, layer_types=_gemma3_types(60)),
    # Mixture of experts: Qwen3-30B-A3B (128 experts of width 768, top 8) and Mixtral 8x7B (8 of 14336, top 2).
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151_936, embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, mlp_dim=6144, max_position=40_960, norm_eps=1e-6, qk_norm=True,
        rope=RopeConfig(theta=1_000_000.0), num_experts=128, experts_per_token=8, expert_mlp_dim=768,
        norm_topk_prob=True),
    # transformers 5.12's Qwen3_5MoeTextConfig defaults, which its docs name Qwen/Qwen3.5-35B-A3B:
    # tests/test_qwen3_5_moe.py checks the match
    "qwen3.5-35b-a3b": ModelConfig(
        **_QWEN_HYBRID, family="qwen3_5_moe", vocab_size=248_320, embed_dim=2048, num_layers=40, num_heads=16,
        num_kv_heads=2, mlp_dim=512, layer_types=_qwen_hybrid_types(40), linear_value_heads=32, num_experts=256,
        experts_per_token=8, expert_mlp_dim=512, shared_expert_dim=512, norm_topk_prob=True),
    # Qwen3.5 dense: -9b = transformers 5.12's Qwen3_5TextConfig defaults (4096 x 32 layers, 16 / 4 heads, MLP 12288),
    # -27b per the Qwen/Qwen3.5-27B model card (5120 x 64 layers, 24 / 4 heads of 256, MLP 17408; 48 Gated DeltaNet
    # value heads): the text model of each (no vision tower, no multi-token-prediction layer)
    **{name: ModelConfig(
        **_QWEN_HYBRID, family="qwen3_5", vocab_size=248_320, embed_dim=d, num_layers=n, num_heads=h, num_kv_heads=4,
        mlp_dim=f, layer_types=_qwen_hybrid_types(n), linear_value_heads=v)
       for name, d, n, h, f, v in (("qwen3.5-9b", 4096, 32, 16, 12_288, 32),
                                   ("qwen3.5-27b", 5120, 64, 24, 17_408, 48))},
    # transformers 5.12's Qwen3NextConfig defaults, which its docs name Qwen/Qwen3-Next-80B-A3B-Instruct: 512
    # experts of width 512, top 10, one shared expert, on all 48 layers (tests/test_qwen3_next.py checks the match)
    "qwen3-next-80b-a3b": ModelConfig(
        **_QWEN_HYBRID, family="qwen3_next", vocab_size=151_936, embed_dim=2048, num_layers=48, num_heads=16,
        num_kv_heads=2, mlp_dim=5632, layer_types=_qwen_hybrid_types(48), linear_value_heads=32, num_experts=512,
        experts_per_token=10, expert_mlp_dim=512, shared_expert_dim=512, norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, max_position=32_768, rope=RopeConfig(theta=1_000_000.0),
        num_experts=8, experts_per_token=2, expert_mlp_dim=14_336, router_aux_loss_coef=0.02),
    # GPT-OSS (openai/gpt-oss-20b, -120b config.json): sinks, alternating 128-token sliding / full layers, YaRN.
    **{name: ModelConfig(
        family="gpt_oss", vocab_size=201_088, embed_dim=2880, num_layers=layers, num_heads=64, num_kv_heads=8,
        head_dim=64, mlp_dim=2880, max_position=131_072, qkv_bias=True, o_bias=True, attn_sinks=True,
        sliding_window=128, layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(layers)),
        rope=RopeConfig(theta=150_000.0, kind="yarn", factor=32.0, original_max_position=4096, truncate=False),
        num_experts=experts, experts_per_token=4, expert_mlp_dim=2880, router_bias=True, expert_bias=True,
        expert_act="gpt_oss") for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
    # The demo's from-scratch model (byte tokenizer: vocab 263).
    "demo-tiny": ModelConfig(
        family="llama", vocab_size=263, embed_dim=128, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=32, mlp_dim=512, max_position=512, rope=RopeConfig(theta=10_000.0)),
    # demo-tiny as a Qwen3.5 hybrid: 3 Gated DeltaNet layers, then 1 gated full-attention layer.
    "demo-tiny-hybrid": ModelConfig(
        family="qwen3_5", vocab_size=263, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=4,
        head_dim=32, mlp_dim=512, max_position=512, norm_eps=1e-6, norm_unit_offset=True, qk_norm=True,
        attn_output_gate=True, layer_types=("linear", "linear", "linear", "full"), linear_key_heads=2,
        linear_value_heads=4, linear_key_dim=32, linear_value_dim=32,
        rope=RopeConfig(theta=10_000.0, partial=0.25)),
    # The demo's distillation student: demo-tiny with 2 layers instead of 3.
    "demo-student": ModelConfig(
        family="llama", vocab_size=263, embed_dim=128, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=32, mlp_dim=512, max_position=512, rope=RopeConfig(theta=10_000.0)),
    # Distillation in the tests: a 4-layer teacher and a 2-layer student of half its width.
    "tiny-teacher": ModelConfig(
        family="llama", vocab_size=263, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=4,
        head_dim=32, mlp_dim=512, max_position=512, rope=RopeConfig(theta=10_000.0)),
    "tiny-student": ModelConfig(
        family="llama", vocab_size=263, embed_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=32, mlp_dim=256, max_position=512, rope=RopeConfig(theta=10_000.0)),
    # The shape of the peers' benchmark checkpoint (benchmarks/bench.sh, docs/benchmarks.md): a tiny Llama 3.
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=2048, embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=4,
        head_dim=64, mlp_dim=1024, max_position=1024, rope=RopeConfig(theta=500_000.0)),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with fields replaced."""
    if name not in PRESETS:
        raise PosttrainError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
