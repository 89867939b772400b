"""A decoder layer as one C++ op on CPU (kernels/cpu/decoder_layer.cpp).

At batch 1 on a small model the eager layer's ~25 torch calls and ~10 module calls cost as much
as its matmuls (SmolLM2-135M: ~4 ms of Python per token beside ~5 ms of matmuls). `FusedLayer`
describes the layer's weights once and runs the same kernels and the same torch matmuls from
C++ in one call, for decode batches and mixed ones alike (prefill chunks beside decodes: the
attention is then the backend's varlen kernel, as in the Python forward). Tensor-parallel
layers and weight formats it does not know keep the Python forward; outputs match the eager
layer's to the last rounding: the test suite holds them to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.models.cpu_linear import PackedLinear
from engine.quantization.blocks import U5BlockMethod, U8BlockMethod
from engine.quantization.methods import Int4Method, Int8Method, QuantizedLinear
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.models.llama import DecoderLayer
    from engine.models.rope import RotaryEmbedding

# Times an Attention layer's backend was set (engine/models/llama.py: Attention.backend), so
# that FusedStack checks its layers' backends again only after one changed (tests swap in
# wrappers): the check over 30 layers cost ~30 us of every batch-1 decode step.
backend_changes = 0


def note_backend_change() -> None:
    """Called by Attention each time its backend is set."""
    global backend_changes
    backend_changes += 1


# Linear kinds as decoder_layer.cpp numbers them.
DENSE, PACKED, INT4, INT8, INT4_TILES, INT8_TILES, U8_TILES, U5_TILES = range(8)


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer as the C++ op reads it."""

    kind: int
    param: int  # the int4 group size, else 0
    tensors: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    max_rows: int | None  # above this many rows the Python layer takes another kernel


def linear_spec(module: nn.Module, dtype: torch.dtype) -> LinearSpec | None:
    """How `module` computes for activations of `dtype`, or None where the C++ layer cannot
    reproduce its forward exactly (a dequantizing layer, another compute dtype)."""
    if type(module) is nn.Linear:
        return LinearSpec(DENSE, 0, (module.weight, None, module.bias), None) \
            if module.weight.dtype == dtype else None
    if isinstance(module, PackedLinear):
        return LinearSpec(PACKED, 0, (module.packed_weight, None, module.bias), None) \
            if module.packed_weight.dtype == dtype else None
    if not isinstance(module, QuantizedLinear) or not module.fused:
        return None
    method = module.method
    tensors = module.tensors()
    if "layout_tiles" in tensors:  # the tile kernels take activations of any float dtype
        kind, scales = ((INT4_TILES, tensors["scale_mins"]) if isinstance(method, Int4Method)
                        else (U8_TILES, tensors["scale_mins"])
                        if isinstance(method, U8BlockMethod)
                        else (U5_TILES, tensors["scale_mins"])
                        if isinstance(method, U5BlockMethod)
                        else (INT8_TILES, tensors["scales"]))
        return LinearSpec(kind, 0, (tensors["qweight"], scales, module.bias),
                          method.fused_rows_limit(tensors))
    if method.plan.compute_dtype != dtype:
        return None
    if isinstance(method, Int4Method) and "layout_kernel" in tensors:
        group = module.in_features // tensors["scale_zeros"].shape[0]
        return LinearSpec(INT4, group, (tensors["qweight"], tensors["scale_zeros"], module.bias),
                          method.max_fused_rows)
    if isinstance(method, Int8Method):
        return LinearSpec(INT8, 0, (tensors["qweight"], tensors["scales"], module.bias),
                          method.max_fused_rows)
    return None


class FusedLayer:
    """One DecoderLayer's weights, described for `ops.decoder_layer_`."""

    def __init__(self, layer: DecoderLayer, ops: Any, specs: list[LinearSpec]) -> None:
        attn = layer.self_attn
        self.ops = ops
        self.attn = attn
        self.backend = attn.backend  # the op runs this backend's kernels: none other
        self.norm1 = layer.input_layernorm.weight
        self.norm2 = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.kinds = [s.kind for s in specs]
        self.params = [s.param for s in specs]
        self.linears = [t for s in specs for t in s.tensors]
        limits = [s.max_rows for s in specs if s.max_rows is not None]
        self.max_rows = min(limits) if limits else None
        self.heads = [attn.num_heads, attn.num_kv_heads, attn.head_dim]

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this batch is one the op computes: few enough rows for its kernels."""
        rows = x.shape[0]
        return (self.max_rows is None or rows <= self.max_rows) and \
            self.attn.backend is self.backend

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                 ) -> torch.Tensor:
        attn = self.attn
        self.ops.decoder_layer_(
            x, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables,
            meta.seq_lens, self.norm1, self.norm2, self.eps, self.kinds, self.params,
            self.linears, self.heads, attn.scale, meta.sliding_window or 0, attn.k_scale,
            attn.v_scale, None if meta.num_seqs == x.shape[0] else meta.query_start_loc)
        return x


class FusedStack:
    """Every layer's FusedLayer in one C++ object (`DecoderStack`), run in one call per step:
    from Python each layer's call cost ~14 us in argument conversion and module calls (0.4 ms
    of a 5 ms SmolLM2 token at batch 1). The same decoder_layer_ runs for each layer, so the
    outputs are the per-layer path's bit for bit."""

    def __init__(self, layers: list[FusedLayer]) -> None:
        self.layers = layers
        limits = [f.max_rows for f in layers if f.max_rows is not None]
        self.max_rows = min(limits) if limits else None
        self.stack = torch.classes.kvserve_cpu.DecoderStack()
        for f in layers:
            self.stack.add_layer(f.norm1, f.norm2, f.eps, f.kinds, f.params, f.linears, f.heads,
                                 f.attn.scale, f.attn.k_scale, f.attn.v_scale)
        self.has_ends = False  # set_ends: decode_logits can run a whole decode step
        self._backends_checked = -1  # the backend_changes count serves_rows last checked at
        self._backends_kept = False  # whether every layer kept its backend then

    def set_ends(self, rotary: RotaryEmbedding, norm_weight: torch.Tensor, eps: float,
                 lm_head: nn.Module) -> None:
        """Hands the model's ends to the C++ stack where it can run them in its decode step:
        an LM head of int8 tiles without bias whose rows are also the embedding (the tied
        Int8Embedding), a float32 or bfloat16 final norm (the layers' dtype: the C++ step
        checks) and float32 rotary tables on CPU."""
        spec = linear_spec(lm_head, norm_weight.dtype)
        if (spec is None or spec.kind != INT8_TILES or spec.tensors[2] is not None
                or norm_weight.dtype not in (torch.float32, torch.bfloat16)
                or not norm_weight.is_cpu
                or rotary.cos_table.dtype != torch.float32 or not rotary.cos_table.is_cpu):
            return
        self.stack.set_ends(rotary.cos_table, rotary.sin_table, norm_weight, eps,
                            spec.tensors[0], spec.tensors[1])
        self.has_ends = True

    def decode_logits(self, rows: tuple[list[int], list[int], list[int]],
                      block_ids: Sequence[Sequence[int]],
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      sliding_window: int | None, argmax: bool = False) -> torch.Tensor | None:
        """float32 logits [rows, vocab] of a decode step in which every row samples one token
        (`rows`: their token ids, positions and cache slots; `block_ids`: their block tables),
        in one C++ call (embedding, layers, final norm, LM head in one parallel region: at
        batch 1 on SmolLM2 the four calls around the layers cost ~0.15 ms of a 4 ms token; a
        bfloat16 model's head output widened to float32 as compute_logits does), or None where
        that step does not take the batch (nothing has run then).
        With `argmax`, each row's argmax of those logits instead (int64 [rows]), found by each
        thread in the part of the head it computed: reading the whole row afterwards, half of
        it from the other core's cache, and widening it took ~0.1 ms of a 4 ms token.
        The rows go to C++ as lists: tensors of them built here cost ~0.1 ms a step."""
        token_ids, positions, slots = rows
        if not self.has_ends or not self.serves_rows(len(token_ids)):
            return None
        width = max(len(ids) for ids in block_ids)
        tables: list[int] = []
        for ids in block_ids:
            tables.extend(ids)
            tables.extend([0] * (width - len(ids)))
        run = self.stack.forward_argmax if argmax else self.stack.forward_logits
        out: torch.Tensor | None = run(
            token_ids, positions, [k for k, _ in kv_caches], [v for _, v in kv_caches], slots,
            tables, sliding_window or 0)
        return out

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether every layer's op computes this batch."""
        return self.serves_rows(x.shape[0])

    def serves_rows(self, num_rows: int) -> bool:
        """Whether every layer's op computes a batch of `num_rows` rows (each layer's
        `serves`, its backends looked at again only after some Attention's was set)."""
        if self._backends_checked != backend_changes:
            self._backends_kept = all(f.attn.backend is f.backend for f in self.layers)
            self._backends_checked = backend_changes
        return self._backends_kept and (self.max_rows is None or num_rows <= self.max_rows)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                 ) -> torch.Tensor:
        self.stack.forward(
            x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.sliding_window or 0,
            None if meta.num_seqs == x.shape[0] else meta.query_start_loc)
        return x


def fused_stack(layers: list[DecoderLayer]) -> FusedStack | None:
    """The C++ form of all `layers` in one object, or None unless each has a FusedLayer and
    nothing wraps a layer's call (--cpu-offload-gb swaps a layer's forward for one that brings
    its weights in: such layers must be called one by one)."""
    if any("forward" in vars(layer) or layer._forward_hooks or layer._forward_pre_hooks
           for layer in layers):
        return None
    fused = [layer.fused() for layer in layers]
    if not fused or any(f is None for f in fused):
        return None
    return FusedStack([f for f in fused if f is not None])


def fused_layer(layer: DecoderLayer) -> FusedLayer | None:
    """The C++ form of `layer`, or None where it has none (no CPU ops, tensor-parallel
    layers, a weight format the op does not run, norms in another dtype)."""
    from engine.models.llama import MLP, Attention

    ops = layer.ops
    attn, mlp = layer.self_attn, layer.mlp
    if ops is None or type(attn) is not Attention or type(mlp) is not MLP:
        return None
    dtype = layer.input_layernorm.weight.dtype
    if layer.post_attention_layernorm.weight.dtype != dtype or dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        return None
    specs = [linear_spec(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                              mlp.down_proj)]
    if any(s is None for s in specs):
        return None
    return FusedLayer(layer, ops, [s for s in specs if s is not None])
