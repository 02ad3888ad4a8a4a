"""ModelConfig: every architectural choice of the one decoder-only Transformer, and named presets.

Families (Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, and the mixture-of-experts
Qwen3-MoE and Mixtral) differ only in the fields below; there is no second model class. A
mixture-of-experts model (num_experts > 0) swaps the gated MLP of its sparse layers for the routed
block of `models/moe.py`; `dense_layers` keep the dense MLP of width `mlp_dim`. `hf.py`
translates a Hugging Face config.json into a ModelConfig; `PRESETS` holds the published shapes
(used for memory planning and `eval_shape` parameter counts, never downloaded). Numbers are from
each model's published config.json.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from posttrain.errors import PosttrainError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding of one attention kind (HF `rope_parameters`)."""

    theta: float = 10_000.0  # base frequency
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0  # linear / llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only: pre-training context length

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3"):
            raise PosttrainError(
                f"unsupported rope type {self.kind!r}; posttrain supports default, linear and llama3"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Transformer (HF-style names)."""

    family: str = "llama"  # informational: llama | qwen2 | qwen3 | mistral | gemma[2|3] | qwen3_moe | mixtral
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
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding"; () = all full
    rope: RopeConfig = RopeConfig()  # RoPE of full-attention layers
    rope_local: Optional[RopeConfig] = None  # RoPE of sliding layers (Gemma 3); None = `rope`
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of parameters
    remat: bool = False  # recompute each layer's activations in the backward pass (saves memory)
    # Mixture of experts (models/moe.py); num_experts = 0 is a dense model and ignores the rest.
    num_experts: int = 0  # E, routed experts per sparse layer
    experts_per_token: int = 0  # top-k experts each token is sent to
    expert_mlp_dim: int = 0  # gated MLP inner size of one expert (Qwen3-MoE moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum 1 (Mixtral: always)
    dense_layers: tuple[int, ...] = ()  # layer indices that keep the dense MLP (Qwen3-MoE mlp_only_layers)
    router_aux_loss_coef: float = 0.001  # load-balancing loss weight added by the train step (HF's name)
    router_z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE: mean logsumexp(router logits)^2)

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
        if self.activation not in ("silu", "gelu_tanh"):
            raise PosttrainError(f"model config: activation {self.activation!r} is not silu or gelu_tanh")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise PosttrainError(
                    f"model config: layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_layers} layers"
                )
            bad = set(self.layer_types) - {"full", "sliding"}
            if bad:
                raise PosttrainError(f"model config: unknown layer types {sorted(bad)}; use full|sliding")
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
            if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
                raise PosttrainError("model config: router_aux_loss_coef and router_z_loss_coef must be >= 0")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i routes over experts (models/moe.py) instead of the dense MLP."""
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
    # Mixture of experts: Qwen3-30B-A3B (128 experts of width 768, top 8) and Mixtral 8x7B (8 of 14336, top 2).
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151_936, embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, mlp_dim=6144, max_position=40_960, norm_eps=1e-6, qk_norm=True,
        rope=RopeConfig(theta=1_000_000.0), num_experts=128, experts_per_token=8, expert_mlp_dim=768,
        norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, max_position=32_768, rope=RopeConfig(theta=1_000_000.0),
        num_experts=8, experts_per_token=2, expert_mlp_dim=14_336, router_aux_loss_coef=0.02),
    # The demo's from-scratch model (byte tokenizer: vocab 263).
    "demo-tiny": ModelConfig(
        family="llama", vocab_size=263, embed_dim=128, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=32, mlp_dim=512, max_position=512, rope=RopeConfig(theta=10_000.0)),
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
    # The anchor benchmark shape (../shared/anchors): a tiny Llama 3.
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=2048, embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=4,
        head_dim=64, mlp_dim=1024, max_position=1024, rope=RopeConfig(theta=500_000.0)),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with fields replaced."""
    if name not in PRESETS:
        raise PosttrainError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
