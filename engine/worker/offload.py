"""`--cpu-offload-gb G`: up to G GiB of the decoder layers' weights live in host memory and
come to the device for each layer's forward, as vLLM's `maybe_offload_to_cpu` does.

Which weights: the decoder layers in order and, within a layer, each module in turn (its
parameters, then its buffers, which hold the codes and scales of quantized layers here, then
the oneDNN-packed weight and bias a `PackedLinear` keeps as plain attributes), whole tensors
only, until the next one would take the total past G GiB. (vLLM stops once its total has
reached G, so it can overshoot by one parameter; here the budget is never exceeded.) The
embedding, the final norm and the LM head stay resident: vLLM wraps the decoder layers only.

Where they live: on CUDA in a pinned host copy, the device copy freed (with an offload budget
the model is even loaded in host memory first, so the offloaded part never occupies the GPU);
on CPU, where host and device are one memory, in a separate host copy, so the same mechanism
runs (and is tested) there with nothing to gain.

Per forward: a layer's forward is wrapped; before it runs, each offloaded tensor gets a working
copy on the device (non-blocking from pinned memory on CUDA, a clone on CPU) swapped in with
`tensor.data = copy`; afterwards `tensor.data = host` again and the copies are dropped, so no
offloaded weight stays resident between steps (on CUDA the blocks go back to torch's caching
allocator, stream-ordered after the layer's kernels). Swapping the storage of the model's own
tensor objects, rather than the modules' attributes (or vLLM's `functional_call`, which would
not reach a PackedLinear's plain attributes), keeps every holder of those objects right: the
C++ decoder layer (engine/models/cpu_layer.py) describes a layer once by its tensor objects and
reads their data pointers at each call, so it runs on the working copies with no stale capture.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig, effective_quantization
from engine.models.cpu_linear import PackedLinear
from engine.models.llama import LlamaForCausalLM
from engine.quantization import gguf_linear_bytes
from engine.quantization.methods import ApplyPlan, Int4Method

logger = logging.getLogger("kvserve")

GiB = 1024**3


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (oneDNN's opaque layout counted by shape, as
    `resident_weight_bytes` counts it)."""
    return tensor.numel() * tensor.element_size()


def budget_bytes(cpu_offload_gb: float) -> int:
    """--cpu-offload-gb in bytes."""
    return int(cpu_offload_gb * GiB)


def count_within_budget(sizes: Iterable[int], budget: int) -> int:
    """How many of `sizes`, taken in order, fit together in `budget` bytes: the walk stops at
    the first that would take the total past it (tensors are never split)."""
    total = count = 0
    for size in sizes:
        if total + size > budget:
            break
        total += size
        count += 1
    return count


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)
    if isinstance(module, PackedLinear):  # plain attributes, in oneDNN's layout
        yield "packed_weight", module.packed_weight
        yield "bias", module.bias


def layer_weight_tensors(layer: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """`layer`'s weight tensors in offload order, by qualified name: each tensor once; empty
    ones (a quantized layer's layout markers) left out."""
    seen: set[int] = set()
    found = []
    for module_name, module in layer.named_modules(prefix=prefix):
        for name, tensor in _module_tensors(module):
            if tensor is None or tensor.numel() == 0 or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            found.append((f"{module_name}.{name}", tensor))
    return found


@dataclass(frozen=True)
class OffloadedTensor:
    """One offloaded weight: the model's own tensor object, which points at `host` between
    forwards, and that host copy (pinned on CUDA)."""

    name: str
    tensor: torch.Tensor
    host: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes it no longer takes on the device."""
        return tensor_bytes(self.host)


def host_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `tensor` in host memory, in a storage of its own: pinned when `device` is CUDA
    (so the per-forward copies can be asynchronous), a plain clone on CPU (oneDNN's packed
    layout included)."""
    if device.type != "cuda":
        return tensor.detach().clone()
    host = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype,
                               device="cpu", pin_memory=True)
    return host.copy_(tensor.detach())


class OffloadedLayer:
    """A layer's forward that brings its offloaded weights to the device for the call only."""

    def __init__(self, layer: nn.Module, tensors: list[OffloadedTensor], device: torch.device,
                 on_copy: Callable[[torch.Tensor], None]) -> None:
        self.tensors = tensors
        self.device = device
        self.on_copy = on_copy
        self.forward: Callable[..., Any] = layer.forward
        object.__setattr__(layer, "forward", self)  # nn.Module.__call__ reads this attribute

    def _working_copy(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return host.to(self.device, non_blocking=True)
        return host.clone()  # on CPU: a fresh copy, as a transfer would make

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Normal tensors, not inference ones: `.data =` refuses to mix the two for oneDNN's
        # tensors, and the model's own weights were made outside inference mode.
        with torch.inference_mode(False):
            copies = [self._working_copy(t.host) for t in self.tensors]
        try:
            for offloaded, copy in zip(self.tensors, copies, strict=True):
                self.on_copy(copy)
                offloaded.tensor.data = copy
            return self.forward(*args, **kwargs)
        finally:
            for offloaded in self.tensors:
                offloaded.tensor.data = offloaded.host
            del copies


class CPUOffload:
    """What --cpu-offload-gb moved to host memory, and the wrapped layers that bring it back."""

    def __init__(self, cpu_offload_gb: float, device: torch.device) -> None:
        self.cpu_offload_gb = cpu_offload_gb
        self.budget_bytes = budget_bytes(cpu_offload_gb)
        self.device = device
        self.tensors: list[OffloadedTensor] = []
        self.num_layer_tensors = 0  # every decoder-layer weight tensor, offloaded or not
        self.next_tensor: tuple[str, int] | None = None  # the first one that did not fit
        self.layers: dict[int, OffloadedLayer] = {}
        self.num_copies = 0  # working copies made, one per offloaded tensor per layer call
        self._live_copies = 0

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of weights kept in host memory instead of on the device."""
        return sum(t.nbytes for t in self.tensors)

    def live_copies(self) -> int:
        """Working copies alive right now: 0 between forwards."""
        return self._live_copies

    def _count_copy(self, copy: torch.Tensor) -> None:
        self.num_copies += 1
        self._live_copies += 1
        weakref.finalize(copy, self._drop_copy)

    def _drop_copy(self) -> None:
        self._live_copies -= 1

    def describe(self) -> str:
        """The startup line: what was offloaded, out of which budget."""
        layers = sorted({_layer_index(t.name) for t in self.tensors})
        where = "no layer" if not layers else f"layer {layers[0]}" if len(layers) == 1 else \
            f"layers {layers[0]}-{layers[-1]}"
        if layers and self.next_tensor and _layer_index(self.next_tensor[0]) == layers[-1]:
            where += " in part" if len(layers) == 1 else ", the last in part"
        stop = ("every decoder-layer weight fit" if self.next_tensor is None else
                f"the next, {self.next_tensor[0]} ({format_size(self.next_tensor[1])}), would "
                "exceed it")
        memory = "pinned host memory" if self.device.type == "cuda" else \
            "a separate host copy (on CPU this frees nothing: host and device are one memory)"
        return (f"CPU offload: {len(self.tensors)} of {self.num_layer_tensors} decoder-layer "
                f"weight tensors, {format_size(self.offloaded_bytes)} ({where}), moved to "
                f"{memory}, of the --cpu-offload-gb {self.cpu_offload_gb:g} budget "
                f"({format_size(self.budget_bytes)}); {stop}; each forward copies them to "
                f"{self.device.type} per layer")


def _layer_index(name: str) -> int:
    """3 for "layers.3.mlp.down_proj.weight"."""
    return int(name.split(".")[1])


def format_size(num_bytes: int) -> str:
    """GiB, or MiB below a hundredth of a GiB (a tiny model's weights)."""
    if num_bytes >= GiB // 100:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / 2**20:.2f} MiB"


def offload_to_cpu(model: LlamaForCausalLM, cpu_offload_gb: float, device: torch.device
                   ) -> CPUOffload:
    """Moves up to `cpu_offload_gb` GiB of `model.layers`' weights to host memory, wraps their
    layers' forwards, then puts every other weight on `device` (the model may have been loaded
    in host memory). Call once, after the weights are loaded, quantized and packed."""
    offload = CPUOffload(cpu_offload_gb, device)
    candidates = [(index, name, tensor) for index, layer in enumerate(model.layers)
                  for name, tensor in layer_weight_tensors(layer, f"layers.{index}")]
    offload.num_layer_tensors = len(candidates)
    count = count_within_budget((tensor_bytes(t) for _, _, t in candidates),
                                offload.budget_bytes)
    if count < len(candidates):
        _, name, tensor = candidates[count]
        offload.next_tensor = (name, tensor_bytes(tensor))
    per_layer: dict[int, list[OffloadedTensor]] = {}
    with torch.no_grad():
        for index, name, tensor in candidates[:count]:
            host = host_copy(tensor, device)
            tensor.data = host  # the device (or loaded) copy is freed here
            per_layer.setdefault(index, []).append(OffloadedTensor(name, tensor, host))
        place_on_device(model, device, {id(t) for _, _, t in candidates[:count]})
    for index, tensors in per_layer.items():
        offload.tensors.extend(tensors)
        offload.layers[index] = OffloadedLayer(model.layers[index], tensors, device,
                                               offload._count_copy)
    logger.info("%s", offload.describe())
    return offload


def place_on_device(model: nn.Module, device: torch.device,
                    offloaded: frozenset[int] | set[int] = frozenset()) -> None:
    """Moves every weight not offloaded (by id) onto `device` (a no-op where it is there
    already): after a model loaded in host memory was quantized or partly offloaded."""
    seen: set[int] = set()
    for module in model.modules():
        for _, tensor in _module_tensors(module):
            if tensor is None or id(tensor) in offloaded or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if tensor.device != device:
                tensor.data = tensor.data.to(device)


def planned_layer_tensor_bytes(cfg: ModelConfig, method: str, dtype: torch.dtype,
                               group_size: int | None = None,
                               compute_dtype: torch.dtype | None = None) -> list[int]:
    """One decoder layer's weight tensors in offload order, in bytes, from the config alone
    (`kvserve plan`, whose device is CUDA: quantized layers keep int8 scales then codes, or
    int4 nibble codes then scales and zeros, scales and biases in `compute_dtype`). Their sum
    is the layer's share of `quantized_weight_bytes`."""
    method = effective_quantization(method, cfg, "gguf" if method == "gguf" else "hf")
    if method in ("awq", "gptq"):
        assert cfg.checkpoint_quantization is not None
        method, group_size = "int4", cfg.checkpoint_quantization[1]
    code_bits = cfg.gguf_code_bits if method == "gguf" else None
    if method == "gguf":
        method, group_size = "int4", 32  # the file's blocks of 32
    b, sb = dtype.itemsize, (compute_dtype or dtype).itemsize
    bias_bytes = b if method == "none" else sb
    widths = iter(code_bits or ())

    def linear(n: int, k: int, bias: bool = False) -> list[int]:
        bits = next(widths, None)
        if method == "none":
            parts = [n * k * b]
        elif method == "int8":
            parts = [n * sb, n * k]
        elif bits is not None:  # a GGUF file's codes, 4, 5 or 8 bits (mean over the layers)
            codes = round(n * k * bits / 8)
            parts = [codes, gguf_linear_bytes(n, k, bits) - codes]
        else:
            group = k if group_size == -1 else Int4Method(
                ApplyPlan("dequant", torch.float32), group_size).layer_group_size(k)
            parts = [n * k // 2, (k // group) * n * 2 * sb]
        return parts + ([n * bias_bytes] if bias else [])

    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [h * b, *linear(q + 2 * kv, h, cfg.attention_bias), *linear(h, q), h * b,
            *linear(2 * inter, h), *linear(h, inter)]


def planned_offload_bytes(cfg: ModelConfig, cpu_offload_gb: float,
                          layer_tensors: list[int]) -> tuple[int, int]:
    """(bytes, tensors) --cpu-offload-gb would move for `cfg.num_hidden_layers` layers of
    `layer_tensors` each, walked as the engine walks them."""
    if cpu_offload_gb <= 0:
        return 0, 0
    sizes = layer_tensors * cfg.num_hidden_layers
    count = count_within_budget(sizes, budget_bytes(cpu_offload_gb))
    return sum(sizes[:count]), count
