"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat variable-length token batch.

Attention goes through `kernels/` ops on a paged KV cache. On CPU the worker picks one
execution path at load (engine/worker/cpu_path.py) and installs it with `use_cpu_path`: the
torch reference (plain torch modules, as on CUDA), the layers one by one with kvserve's C++ ops
(each layer one decoder_layer_ call where it can be, else its elementwise work fused: RMSNorm,
residual add + RMSNorm, SiLU x up, rotary, one call each instead of 4-8 torch ops, rounding
where the torch formulation rounds), or every layer, and where it fits the whole decode step,
in one C++ call (engine/models/cpu_layer.py). The forward follows what was installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.cpu_layer import FusedLayer, FusedStack, fused_layer
from engine.models.layer_desc import LayerDesc, describe_llama
from engine.models.rope import RotaryEmbedding
from kernels.metadata import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers' LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops: Any = None  # kvserve's CPU ops where the worker's CPU path uses them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
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
        self.ops: Any = None  # kvserve's CPU ops where the worker's CPU path uses them
        self.scale = self.head_dim**-0.5
        # Dequantization scales of an fp8 KV cache (stored = value / scale). 1.0 is vLLM's
        # default without calibration: SmolLM2's K/V stay within |18|, far inside e4m3's 448.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k heads together: one set of rotary ops per layer instead of two.
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.ops is not None:
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

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ops: Any = None  # kvserve's CPU ops where the worker's CPU path uses them
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.ops: Any = None  # kvserve's CPU ops where the worker's CPU path uses them
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # This layer as one C++ op (engine/models/cpu_layer.py) where the CPU path runs it so.
        self._fused: FusedLayer | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        fused = self._fused
        if fused is not None and fused.serves(x.shape[0]):
            return fused(x, cos, sin, kv_cache, meta)
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        if self.ops is not None:
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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_model_len, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Every layer in one C++ call where the CPU path is the whole step (use_cpu_path).
        self._fused_stack: FusedStack | None = None

    def layer_desc(self) -> LayerDesc:
        """What each decoder layer computes beyond its weights (engine/models/layer_desc.py):
        the worker's CPU path choice reads it."""
        return describe_llama(self.config)

    def use_cpu_path(self, ops: Any, fused_layers: bool, whole_step: bool, step_ends: bool
                     ) -> None:
        """Installs the worker's CPU execution path (engine/worker/cpu_path.py), after the
        weights are loaded, quantized and packed: `ops`, kvserve's C++ ops for the elementwise
        work (None: torch's); `fused_layers`, each layer as one decoder_layer_ call where its
        weights have a C++ form; `whole_step`, every layer in one DecoderStack call; and
        `step_ends`, the embedding and LM head in that call too for decode steps."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, DecoderLayer)):
                module.ops = ops
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        for layer in layers:
            layer._fused = fused_layer(layer, ops) if fused_layers and ops is not None else None
        fused = [layer._fused for layer in layers if layer._fused is not None]
        self._fused_stack = None
        if whole_step:
            assert len(fused) == len(self.layers), "the whole step runs every layer fused"
            self._fused_stack = FusedStack(fused)
            if step_ends:
                self._fused_stack.set_ends(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        stack = self._fused_stack
        if stack is not None and stack.serves(x.shape[0]):  # every layer in one C++ call
            return self.norm(stack(x, cos, sin, kv_caches, meta))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def decode_logits(self, rows: tuple[list[int], list[int], list[int]],
                      block_ids: Sequence[Sequence[int]],
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      sliding_window: int | None, argmax: bool = False) -> torch.Tensor | None:
        """`compute_logits(forward(...))` of a decode step in which every row samples one token
        (`rows`: their token ids, positions and cache slots; `block_ids`: their block tables),
        in one C++ call on CPU where the whole step was installed with its ends
        (engine/models/cpu_layer.py: FusedStack.decode_logits), or with `argmax` each row's
        argmax of them; None otherwise, having run nothing."""
        stack = self._fused_stack
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
