"""A decoder layer as one C++ op on CPU (kernels/cpu/step/decoder_layer.cpp), and every layer in one.

At batch 1 on a small model the eager layer's ~25 torch calls and ~10 module calls cost as much
as its matmuls (SmolLM2-135M: ~4 ms of Python per token beside ~5 ms of matmuls). `FusedLayer`
describes the layer's weights once and runs the same kernels and the same torch matmuls from
C++ in one call, for decode batches and mixed ones alike (prefill chunks beside decodes: the
attention is then the backend's varlen kernel, as in the Python forward); `FusedStack` runs
every layer's in one call, and where the ends fit, the whole decode step. Which of them a model
uses is the worker's choice at load (engine/worker/cpu_path.py); outputs match the eager
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
    from engine.models.llama import DecoderLayer, LlamaForCausalLM

# Linear kinds as decoder_layer.cpp numbers them.
DENSE, PACKED, INT4, INT8, INT4_TILES, INT8_TILES, U8_TILES, U5_TILES = range(8)
# Activation dtypes decoder_layer_ computes in.
LAYER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        self.norm1 = layer.input_layernorm.weight
        self.norm2 = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.kinds = [s.kind for s in specs]
        self.params = [s.param for s in specs]
        self.linears = [t for s in specs for t in s.tensors]
        limits = [s.max_rows for s in specs if s.max_rows is not None]
        self.max_rows = min(limits) if limits else None
        self.heads = [attn.num_heads, attn.num_kv_heads, attn.head_dim]

    def serves(self, num_rows: int) -> bool:
        """Whether a batch of `num_rows` rows is one the op computes: few enough rows for its
        kernels (torch's int8/int4 matmuls hand larger batches to another kernel)."""
        return self.max_rows is None or num_rows <= self.max_rows

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

    def set_ends(self, model: LlamaForCausalLM) -> None:
        """Hands the model's embedding, final norm, LM head and rotary tables to the C++ stack,
        so that decode_logits runs a whole decode step; check `ends_unfit(model)` first."""
        spec = linear_spec(model.lm_head, model.norm.weight.dtype)
        assert spec is not None and spec.tensors[1] is not None
        rotary = model.rotary
        self.stack.set_ends(rotary.cos_table, rotary.sin_table, model.norm.weight,
                            model.norm.eps, spec.tensors[0], spec.tensors[1])
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
        if not self.has_ends or not self.serves(len(token_ids)):
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

    def serves(self, num_rows: int) -> bool:
        """Whether every layer's op computes a batch of `num_rows` rows (each layer's
        `serves`): past a kernel's row limit the layers run one by one."""
        return self.max_rows is None or num_rows <= self.max_rows

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                 ) -> torch.Tensor:
        self.stack.forward(
            x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.sliding_window or 0,
            None if meta.num_seqs == x.shape[0] else meta.query_start_loc)
        return x


def layer_specs(layer: DecoderLayer) -> list[LinearSpec] | str:
    """The C++ form of `layer`'s four linears, or why it has none (tensor-parallel blocks, a
    weight format the op does not run, norms in another dtype)."""
    from engine.models.llama import MLP, Attention

    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not MLP:
        return f"{type(attn).__name__}/{type(mlp).__name__} blocks are not the C++ layer's"
    dtype = layer.input_layernorm.weight.dtype
    if layer.post_attention_layernorm.weight.dtype != dtype or dtype not in LAYER_DTYPES:
        return f"norms in {str(dtype).removeprefix('torch.')}"
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    specs = [linear_spec(m, dtype) for m in modules]
    for name, module, spec in zip(names, modules, specs, strict=True):
        if spec is None:
            return f"{name} ({type(module).__name__}) has no C++ form in this dtype"
    return [s for s in specs if s is not None]


def fused_layer(layer: DecoderLayer, ops: Any) -> FusedLayer | None:
    """The C++ form of `layer` over `ops`, or None where it has none (`layer_specs`)."""
    specs = layer_specs(layer)
    return None if isinstance(specs, str) else FusedLayer(layer, ops, specs)


def first_unfused(layers: Sequence[DecoderLayer]) -> str | None:
    """Why the first layer without a C++ form has none ("layer 3: ..."), or None."""
    for i, layer in enumerate(layers):
        specs = layer_specs(layer)
        if isinstance(specs, str):
            return f"layer {i}: {specs}"
    return None


def ends_unfit(model: LlamaForCausalLM) -> str | None:
    """Why the model's embedding and LM head cannot join the C++ decode step, or None where
    they can: it takes an LM head of int8 tiles without bias whose rows are also the embedding
    (the tied Int8Embedding), a float32 or bfloat16 final norm in the embedding's dtype, and
    float32 rotary tables on CPU."""
    from engine.quantization.embedding import Int8Embedding

    norm = getattr(model.norm, "weight", None)
    if not isinstance(norm, torch.Tensor):
        return "no final norm here (an earlier pipeline stage)"
    spec = linear_spec(model.lm_head, norm.dtype)
    embed = model.embed_tokens
    if (spec is None or spec.kind != INT8_TILES or spec.tensors[2] is not None
            or not isinstance(embed, Int8Embedding) or embed.head[0] is not model.lm_head):
        return "the LM head is not tied int8 tiles"
    if norm.dtype not in (torch.float32, torch.bfloat16) or embed.dtype != norm.dtype:
        return f"a final norm in {str(norm.dtype).removeprefix('torch.')}"
    table = model.rotary.cos_table
    if table.dtype != torch.float32 or not table.is_cpu or not norm.is_cpu:
        return "rotary tables or norm not float32 on CPU"
    return None
