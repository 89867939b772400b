"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat variable-length token batch.

Attention goes through `kernels/` ops on a paged KV cache. On CPU, with kvserve's C++ ops
loaded (the `cpu` attention backend's `ops`), the layer's elementwise work runs fused through
them too (RMSNorm, residual add + RMSNorm, SiLU x up, rotary): one call each instead of 4-8 torch
ops, rounding where the torch formulation rounds; elsewhere everything else is plain torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.cpu_layer import (
    FusedLayer,
    FusedStack,
    fused_layer,
    fused_stack,
    note_backend_change,
)
from engine.models.rope import RotaryEmbedding
from kernels.metadata import AttentionBackend, AttentionMetadata


def cpu_ops_of(backend: AttentionBackend) -> Any:
    """The C++ CPU ops when the backend is the `cpu` one (kernels/cpu_attention.py), else None."""
    return getattr(backend, "ops", None)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers' LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float, ops: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops  # kvserve's CPU ops, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.is_cpu:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # torch's fused F.rms_norm measured 10x slower than this on CPU (torch 2.13).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention with fused q/k/v projection."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend
        self.ops = cpu_ops_of(backend)
        self.scale = self.head_dim**-0.5
        # Dequantization scales of an fp8 KV cache (stored = value / scale). 1.0 is vLLM's
        # default without calibration: SmolLM2's K/V stay within |18|, far inside e4m3's 448.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def backend(self) -> AttentionBackend:
        """The attention ops this layer calls (a fused C++ stack runs the one it was built
        with, and checks again after any layer's is set: cpu_layer.backend_changes)."""
        return self._backend

    @backend.setter
    def backend(self, backend: AttentionBackend) -> None:
        self._backend = backend
        note_backend_change()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k heads together: one set of rotary ops per layer instead of two.
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.ops is not None and x.is_cpu:
            self.ops.rotary_(qk, cos, sin)  # in place: qk is a view of qkv
        else:
            qk = RotaryEmbedding.apply(qk, cos, sin)  # [T, heads + kv_heads, head_dim]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        self.backend.reshape_and_cache(k, v, k_cache, v_cache, meta, self.k_scale, self.v_scale)
        out = self.backend.attention(q, k_cache, v_cache, meta, self.scale,
                                     self.k_scale, self.v_scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU with fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, ops: Any = None) -> None:
        super().__init__()
        self.ops = ops  # kvserve's CPU ops, or None
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.is_cpu:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.ops = cpu_ops_of(backend)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops)
        self.mlp = MLP(cfg, self.ops)
        # The C++ decode layer (engine/models/cpu_layer.py), described on first use: by then
        # the weights are loaded, quantized and packed. False: this layer has none.
        self._fused: FusedLayer | Literal[False] | None = None

    def fused(self) -> FusedLayer | None:
        """This layer as one C++ op (built on first use), or None where it has none."""
        if self.ops is None:
            return None
        if self._fused is None:
            self._fused = fused_layer(self) or False
        return self._fused or None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        if x.is_cpu:
            fused = self.fused()
            if fused is not None and fused.serves(x, meta):
                return fused(x, cos, sin, kv_cache, meta)
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        if self.ops is not None and x.is_cpu:
            # x += h and h = norm(x) in one pass; x is this forward's own residual stream.
            norm = self.post_attention_layernorm
            self.ops.add_rms_norm_(h, x, norm.weight, norm.eps)
            return x.add_(self.mlp(h))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The whole decoder; `forward` returns final hidden states, `compute_logits` the logits."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_model_len: int,
                 device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cpu_ops_of(backend))
        self.rotary = RotaryEmbedding(cfg, max_model_len, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Every layer in one C++ call on CPU (engine/models/cpu_layer.py), built on first use.
        self._fused_stack: FusedStack | Literal[False] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        stack = self._stack(x)
        if stack is not None and stack.serves(x, meta):  # every layer in one C++ call
            return self.norm(stack(x, cos, sin, kv_caches, meta))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def _stack(self, x: torch.Tensor) -> FusedStack | None:
        """All layers as one C++ object on CPU (built on first use), or None."""
        if not x.is_cpu:
            return None
        if self._fused_stack is None:
            self._fused_stack = fused_stack(list(self.layers)) or False  # type: ignore[arg-type]
            if self._fused_stack and self._ends_are_plain():
                self._fused_stack.set_ends(self.rotary, self.norm.weight, self.norm.eps,
                                           self.lm_head)
        return self._fused_stack or None

    def _ends_are_plain(self) -> bool:
        """Whether the embedding is the LM head's int8 rows and this class's own forward and
        compute_logits stand (subclasses for tensor and pipeline parallel replace them)."""
        from engine.quantization.embedding import Int8Embedding

        cls = type(self)
        return (cls.forward is LlamaForCausalLM.forward
                and cls.compute_logits is LlamaForCausalLM.compute_logits
                and isinstance(self.embed_tokens, Int8Embedding)
                and self.embed_tokens.head[0] is self.lm_head
                and self.embed_tokens.dtype == self.norm.weight.dtype)

    def decode_logits(self, rows: tuple[list[int], list[int], list[int]],
                      block_ids: Sequence[Sequence[int]],
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      sliding_window: int | None, argmax: bool = False) -> torch.Tensor | None:
        """`compute_logits(forward(...))` of a decode step in which every row samples one token
        (`rows`: their token ids, positions and cache slots; `block_ids`: their block tables),
        in one C++ call on CPU where the fused stack can run the whole step
        (engine/models/cpu_layer.py: FusedStack.decode_logits), or with `argmax` each row's
        argmax of them; None otherwise, having run nothing."""
        stack = self._stack(self.rotary.cos_table)
        return None if stack is None else stack.decode_logits(rows, block_ids, kv_caches,
                                                              sliding_window, argmax)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        return self.lm_head(hidden).float()

    def greedy_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits with compute_logits' argmax, in the model's dtype where they can be: the LM
        head's output before compute_logits widens it to float32 (exactly: the same argmax).
        At 64 rows of SmolLM2 in bfloat16 the widening wrote 12.6 MB a step. A subclass's own
        compute_logits (tensor, pipeline parallel) is used as it is."""
        if type(self).compute_logits is LlamaForCausalLM.compute_logits:
            return self.lm_head(hidden)
        return self.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors in, fusing q/k/v and gate/up on the way."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target, offset = self._map_name(hf_name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in the model")
            param = params[target]
            rows = tensor.shape[0]
            with torch.no_grad():
                param.data[offset:offset + rows].copy_(tensor.to(param.dtype))
            loaded.add(f"{target}@{offset}")
        self._check_complete(loaded)

    def _map_name(self, hf_name: str) -> tuple[str | None, int]:
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            return None, 0
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None, 0
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q),
                 "v_proj": ("qkv_proj", q + kv), "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", cfg.intermediate_size)}
        for part, (fused_name, offset) in fused.items():
            if f".{part}." in name:
                return name.replace(part, fused_name), offset
        return name, 0

    def _check_complete(self, loaded: set[str]) -> None:
        names = {n for n, _ in self.named_parameters()}
        loaded_names = {key.split("@")[0] for key in loaded}
        missing = sorted(names - loaded_names)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        expected_parts = 3 * len(self.layers) * (2 if self.config.attention_bias else 1)
        fused_parts = sum(1 for key in loaded if "qkv_proj" in key)
        if fused_parts != expected_parts:
            raise ValueError("checkpoint lacks some q/k/v projection weights")
