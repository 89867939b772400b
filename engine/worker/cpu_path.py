"""The one CPU execution path of a model, chosen once at load and logged with its reason.

Three paths (DESIGN.md, "CPU execution paths"):

  torch       the torch reference: plain torch modules and the torch attention twins
              (--attention-backend torch, or kvserve's C++ ops did not load)
  layer_ops   the layers one by one from Python with kvserve's C++ ops: each layer one
              decoder_layer_ call where the C++ layer describes it and its weights have a C++
              form, else its module forward over the C++ attention and elementwise ops
  whole_step  every layer in one DecoderStack call per step, and for a decode step whose rows
              all sample, the embedding and LM head too where they fit (its team kernels, or
              the per-layer loop, are the C++'s own choice per batch)

`decide_cpu_path` is a pure function of `CpuFacts`; `choose_cpu_path` gathers them from a
loaded model, decides, logs one INFO line and installs the result in the model, whose forward
then follows it without looking at backends again. A batch past a kernel's row limit (torch's
int8/int4 matmuls) still runs layer by layer on the whole_step path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from engine.models.cpu_layer import ends_unfit, first_unfused
from engine.models.layer_desc import LayerDesc, fused_step_supports
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels import cpu_ops
from kernels.cpu_attention import CpuAttentionBackend
from kernels.torch_attention import TorchAttentionBackend

if TYPE_CHECKING:
    from engine.config import EngineArgs

logger = logging.getLogger("kvserve")


class CpuPath(str, Enum):
    """How a model's forward runs on CPU."""

    TORCH = "torch"
    LAYER_OPS = "layer_ops"
    WHOLE_STEP = "whole_step"


@dataclass(frozen=True)
class CpuFacts:
    """What the choice reads, gathered once at load (`gather_cpu_facts`)."""

    vector_isa: str | None  # the C++ ops' vector ISA ("avx2", "avx512+vnni"); None: not loaded
    attention: str  # the layers' attention: "cpu" (kvserve's C++), "torch", else class names
    forced_torch: bool  # --attention-backend torch
    dtype: torch.dtype
    quantization: str  # the method in effect ("none", "int8", "gguf", ...)
    tensor_parallel: int
    pipeline_parallel: int
    offload: bool  # --cpu-offload-gb: each layer's weights come in around its own call
    num_layers: int
    layer_desc: LayerDesc
    unfused: str | None  # why some layer's weights have no C++ form; None: every layer's do
    ends_unfit: str | None  # why the embedding/LM head stay out of the step; None: they fit


@dataclass(frozen=True)
class CpuPathDecision:
    """The path, why, and what the model installs for it."""

    path: CpuPath
    reason: str
    fused_layers: bool = False  # each layer one decoder_layer_ call where its weights allow
    step_ends: bool = False  # whole_step: decode steps from token ids to logits in one call

    def log_line(self) -> str:
        """"CPU execution path: whole_step (vector ISA avx2, bfloat16, ...)"."""
        return f"CPU execution path: {self.path.value} ({self.reason})"


def decide_cpu_path(facts: CpuFacts) -> CpuPathDecision:
    """The fastest path `facts` allow: the torch reference where no C++ ops can run, layer by
    layer where the step cannot be one call, else the whole step."""
    decision = _torch_path(facts) or _layer_path(facts) or _whole_step(facts)
    context = ", ".join((f"vector ISA {facts.vector_isa}" if facts.vector_isa else "no C++ ops",
                         str(facts.dtype).removeprefix("torch."),
                         "unquantized" if facts.quantization == "none"
                         else f"--quantization {facts.quantization}"))
    return CpuPathDecision(decision.path, f"{context}: {decision.reason}",
                           decision.fused_layers, decision.step_ends)


def _torch_path(facts: CpuFacts) -> CpuPathDecision | None:
    if facts.forced_torch:
        return CpuPathDecision(CpuPath.TORCH, "--attention-backend torch; torch ops throughout")
    if facts.vector_isa is None:
        return CpuPathDecision(CpuPath.TORCH, "kvserve's C++ ops are not loaded (see the "
                                              "warning above); torch ops throughout")
    if facts.attention == "torch":
        return CpuPathDecision(CpuPath.TORCH, "the torch attention twins; torch ops throughout")
    return None


def _layer_path(facts: CpuFacts) -> CpuPathDecision | None:
    """Layer by layer: without decoder_layer_ where the C++ layer cannot compute a layer (its
    attention is not the C++ one, tensor-parallel collectives sit inside it, or its description
    is outside the C++ shape), with it where only the step as one call is ruled out."""
    python = "each layer's module forward over the C++ ops"
    supported, why = fused_step_supports(facts.layer_desc)
    if facts.attention != "cpu":
        return CpuPathDecision(CpuPath.LAYER_OPS, f"attention through {facts.attention}, not "
                                                  f"the C++ backend; {python}")
    if facts.tensor_parallel > 1:
        return CpuPathDecision(CpuPath.LAYER_OPS, f"--tensor-parallel-size "
                               f"{facts.tensor_parallel}, all-reduces inside each layer; {python}")
    if not supported:
        return CpuPathDecision(CpuPath.LAYER_OPS, f"{why}; {python}")
    one_each = f"{facts.num_layers} layers, one C++ call each"
    if facts.pipeline_parallel > 1:
        return CpuPathDecision(CpuPath.LAYER_OPS, f"--pipeline-parallel-size "
                               f"{facts.pipeline_parallel}; this stage's {one_each}", True)
    if facts.offload:
        return CpuPathDecision(CpuPath.LAYER_OPS, f"--cpu-offload-gb brings each layer's "
                               f"weights in around its call; {one_each}", True)
    if facts.unfused is not None:
        return CpuPathDecision(CpuPath.LAYER_OPS, f"{facts.unfused}; {one_each} where its "
                               "weights allow", True)
    return None


def _whole_step(facts: CpuFacts) -> CpuPathDecision:
    layers = f"{facts.num_layers} layers"
    outside = facts.ends_unfit
    if outside is None and facts.layer_desc.has_bias:  # the team kernels take no bias
        outside = "biased linears"
    if outside is None:
        return CpuPathDecision(CpuPath.WHOLE_STEP, f"{layers} and the LM head in one C++ call "
                               "per decode step", True, True)
    return CpuPathDecision(CpuPath.WHOLE_STEP, f"{layers} in one C++ call per step, the "
                           f"embedding and LM head in torch ({outside})", True)


def gather_cpu_facts(model: LlamaForCausalLM, args: EngineArgs, dtype: torch.dtype,
                     quantization: str, offload: bool) -> CpuFacts:
    """The facts of a loaded model (weights quantized and packed) and its engine arguments."""
    forced_torch = args.attention_backend == "torch"
    ops = None if forced_torch else cpu_ops.load()  # loaded already with the backend
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    return CpuFacts(
        vector_isa=None if ops is None else _vector_isa(ops),
        attention=_attention_kind([layer.self_attn.backend for layer in layers]),
        forced_torch=forced_torch, dtype=dtype, quantization=quantization,
        tensor_parallel=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel=getattr(args, "pipeline_parallel_size", 1), offload=offload,
        num_layers=len(layers), layer_desc=model.layer_desc(),
        unfused=first_unfused(layers),
        ends_unfit=ends_unfit(model))


def choose_cpu_path(model: LlamaForCausalLM, args: EngineArgs, dtype: torch.dtype,
                    quantization: str, offload: bool) -> CpuPathDecision:
    """Decides `model`'s CPU path, logs it once and installs it in the model."""
    decision = decide_cpu_path(gather_cpu_facts(model, args, dtype, quantization, offload))
    logger.info("%s", decision.log_line())
    whole_step = decision.path is CpuPath.WHOLE_STEP
    ops = None if decision.path is CpuPath.TORCH else cpu_ops.loaded()
    model.use_cpu_path(ops, decision.fused_layers, whole_step, decision.step_ends)
    return decision


def _vector_isa(ops: Any) -> str:
    """The vector ISA the C++ ops were built for; "unknown" from a build without the op."""
    isa = getattr(ops, "vector_isa", None)
    return "unknown" if isa is None else str(isa())


def _attention_kind(backends: list[Any]) -> str:
    """"cpu" where every layer attends through kvserve's C++ backend, "torch" through the
    torch twins, else the classes they use (a test's wrapper, say)."""
    kinds = {type(b) for b in backends}
    if kinds == {CpuAttentionBackend}:
        return "cpu"
    if kinds == {TorchAttentionBackend}:
        return "torch"
    return ", ".join(sorted(kind.__name__ for kind in kinds))
