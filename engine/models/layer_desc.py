"""A model-agnostic description of one decoder layer, and what kvserve's C++ step runs of it.

The fused CPU step (kernels/cpu/step/decoder_layer.cpp, DecoderStack) computes one layer shape:
pre-norm RMSNorm, a fused q/k/v projection, half-split rotary from cos/sin tables, paged
attention, o_proj, a second RMSNorm, SiLU(gate) x up and down_proj. A model family fills a
`LayerDesc` from its config; where `fused_step_supports` accepts it, that family gets the fast
path with no new C++, and where it does not the worker runs it layer by layer and logs why
(engine/worker/cpu_path.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

from engine.config import ModelConfig

NormKind = Literal["rms", "rms_one_plus"]  # rms_one_plus: Gemma's x * (1 + w)
Activation = Literal["silu", "gelu_tanh", "swiglu_clamped"]
Rotary = Literal["default", "llama3", "yarn", "linear", "dynamic", "partial", "none"]

# Rotary variants whose cos/sin tables are fixed at load and cover the whole head, computed in
# Python: the C++ layer only reads the tables, so any of these runs in it unchanged.
TABLE_ROTARIES: frozenset[str] = frozenset({"default", "llama3", "yarn", "linear"})
# Why the others do not.
_ROTARY_WHY = {
    "dynamic": "its tables change with the sequence length, the C++ step reads fixed ones",
    "partial": "it rotates part of each head, the C++ rotary rotates all of it",
    "none": "the C++ layer always rotates q and k",
}


@dataclass(frozen=True)
class LayerDesc:
    """What a decoder layer computes, beyond its weights."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    norm: NormKind = "rms"
    qk_norm: bool = False  # a norm on q and k per head before the rotation (Qwen3, Gemma3)
    activation: Activation = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rotary: Rotary = "default"

    @property
    def has_bias(self) -> bool:
        """Whether any linear of the layer adds a bias."""
        return self.qkv_bias or self.o_bias or self.mlp_bias


def rotary_kind(cfg: ModelConfig) -> Rotary:
    """The checkpoint's rope_scaling type as a `Rotary` variant ("default" without one)."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in get_args(Rotary):  # rope.py refuses such a checkpoint before this
        raise ValueError(f"rope scaling type {kind!r} has no layer description")
    return cast(Rotary, kind)


def describe_llama(cfg: ModelConfig) -> LayerDesc:
    """Llama, Mistral and Qwen2's layer (Qwen2 and attention_bias checkpoints: q/k/v bias)."""
    return LayerDesc(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
        qkv_bias=cfg.attention_bias, sliding_window=cfg.sliding_window,
        rotary=rotary_kind(cfg))


def fused_step_supports(desc: LayerDesc) -> tuple[bool, str]:
    """Whether kvserve's C++ layer (decoder_layer_, and DecoderStack built of it) computes
    `desc`, and why not where it does not. It takes a bias on every linear and one sliding
    window per step; it has no q/k norms, no soft-caps, and only RMSNorm and SiLU."""
    if desc.norm != "rms":
        return False, f"norm {desc.norm}: the C++ layer's RMSNorm scales by w, not 1 + w"
    if desc.qk_norm:
        return False, "q/k norm: the C++ layer has no norm between q/k/v and the rotation"
    if desc.activation != "silu":
        return False, f"activation {desc.activation}: the C++ layer's MLP is SiLU(gate) x up"
    if desc.attn_logit_softcap is not None:
        return False, "attention logit soft-cap: the C++ attention has none"
    if desc.final_logit_softcap is not None:
        return False, "final logit soft-cap: the C++ step's LM head has none"
    if desc.rotary not in TABLE_ROTARIES:
        return False, f"rotary {desc.rotary}: {_ROTARY_WHY[desc.rotary]}"
    return True, "RMSNorm, SiLU, table rotary: the C++ layer's shape"
