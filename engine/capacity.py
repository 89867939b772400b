"""KV cache capacity: how many bytes the cache gets, how many blocks and tokens that buys.

The arithmetic is the seed tutorials' formula and vLLM V1's:

    bytes per token = 2 (K and V) x layers x KV heads x head_dim x element bytes
    num_blocks      = available_bytes // (bytes per token x block_size)
    max concurrency = num_blocks / ceil(max_model_len / block_size)

and the startup log lines use vLLM's exact wording, so an operator reading
"GPU KV cache size: 74,096 tokens" here means what it means there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, ModelConfig

GiB = 1024**3
MEMINFO_PATH = Path("/proc/meminfo")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# On CPU the KV cache never takes more than this share of the RAM that is free right now, so the
# OS, the tokenizer and the HTTP server keep room even when DEFAULT_CPU_KV_CACHE_BYTES is larger.
CPU_MAX_AVAILABLE_RAM_FRACTION = 0.5
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV cache budget splits into blocks of `block_size` tokens."""

    available_bytes: int
    bytes_per_token: int
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        """Tokens the whole cache holds: num_blocks x block_size (vLLM's "KV cache size")."""
        return self.num_blocks * self.block_size

    def blocks_per_request(self, max_model_len: int) -> int:
        """Blocks one request of `max_model_len` tokens needs (the last one may be part-filled)."""
        return math.ceil(max_model_len / self.block_size)

    def max_concurrency(self, max_model_len: int) -> float:
        """Full-length requests the cache holds at once, as vLLM V1 computes it."""
        return self.num_blocks / self.blocks_per_request(max_model_len)

    def max_fitting_model_len(self) -> int:
        """The largest max_model_len one request can hold: every token of the cache."""
        return self.num_tokens


def kv_cache_element_bytes(kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes per K or V element: `auto` stores the model dtype, `fp8_*` one byte."""
    if kv_cache_dtype == "auto":
        return model_dtype.itemsize
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return 1
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use auto, fp8_e4m3 or fp8_e5m2")


def parse_bytes(text: str) -> int:
    """Parses "24GiB", "24GB" (GB = 1e9, GiB = 2**30), "512MiB", "4e9" or a plain int."""
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"cannot read {text!r} as a byte count; write e.g. 24GiB (2**30), "
                         "24GB (10**9), 512MiB or a plain number of bytes")
    value = float(match.group(1)) * _BYTE_UNITS[unit]
    if not math.isfinite(value) or (unit in ("", "b") and value != int(value)):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_gib(num_bytes: float) -> str:
    """Bytes as vLLM prints them: "8.42 GiB"."""
    return f"{num_bytes / GiB:.2f} GiB"


def triage_steps(device: torch.device, fitting_len: int | None) -> list[str]:
    """The seed's OOM triage order, phrased for a KV cache that is too small.

    `fitting_len` is the largest max_model_len that fits, or None when nothing is left for the
    cache at all (the seed's "OOM at startup" case, where step 1 cannot help).
    """
    if fitting_len is None:
        step1 = ("1) --max-model-len: lowering it cannot help, not even one KV block fits (the "
                 "'OOM at startup' case: weights plus the activation peak fill the budget)")
    else:
        step1 = f"1) lower --max-model-len to <= {fitting_len} (most effective)"
    if device.type == "cuda":
        step2 = ("2) raise --gpu-memory-utilization (keep headroom: 0.9 is safe, 0.98+ is a red "
                 "flag) or give the cache an explicit --kv-cache-memory-bytes")
    else:
        step2 = (f"2) raise --kv-cache-memory-bytes (the CPU default is "
                 f"{format_gib(DEFAULT_CPU_KV_CACHE_BYTES)}, capped at half of the free RAM)")
    return [
        step1,
        step2,
        "3) lower --max-num-seqs (a smaller batch peaks at less activation memory and keeps "
        "fewer requests' KV blocks alive)",
        "4) use a smaller or quantized model, or --kv-cache-dtype fp8_e4m3 (1 byte per element: "
        "half the KV bytes per token of 16-bit, twice the tokens)",
    ]


def read_mem_available_bytes(meminfo: Path = MEMINFO_PATH) -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where there is no such file (non-Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def cpu_kv_cache_bytes(mem_available: int | None) -> int:
    """DEFAULT_CPU_KV_CACHE_BYTES, but never more than half of the RAM available right now.

    Called after the weights are loaded, so MemAvailable already excludes them.
    """
    if mem_available is None:
        return DEFAULT_CPU_KV_CACHE_BYTES
    return min(DEFAULT_CPU_KV_CACHE_BYTES, int(mem_available * CPU_MAX_AVAILABLE_RAM_FRACTION))


def cuda_non_torch_bytes(device: torch.device) -> int:
    """Device memory used outside torch's allocator: CUDA context, cuBLAS, other processes."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def cuda_kv_cache_bytes(args: EngineArgs, device: torch.device, weight_bytes: int,
                        peak_activation_bytes: int) -> int:
    """vLLM's profiler budget: total x utilization - weights - activation peak - non-torch."""
    _, total = torch.cuda.mem_get_info(device)
    requested = int(total * args.gpu_memory_utilization)
    return requested - weight_bytes - peak_activation_bytes - cuda_non_torch_bytes(device)


def available_kv_cache_bytes(args: EngineArgs, device: torch.device, weight_bytes: int,
                             peak_activation_bytes: int) -> int:
    """Bytes the KV cache may take on `device`.

    --kv-cache-memory-bytes overrides everything. On CUDA it is the profiler's budget
    (`cuda_kv_cache_bytes`, with weights and the measured activation peak subtracted). On CPU it
    is DEFAULT_CPU_KV_CACHE_BYTES capped at half of /proc/meminfo's MemAvailable. Raises
    ValueError with the triage steps when nothing is left.
    """
    if args.kv_cache_memory_bytes is not None:
        available = args.kv_cache_memory_bytes
    elif device.type == "cuda":
        available = cuda_kv_cache_bytes(args, device, weight_bytes, peak_activation_bytes)
    else:  # the host's budget, shared by its tensor- or pipeline-parallel ranks (one RAM)
        available = cpu_kv_cache_bytes(read_mem_available_bytes()) // (
            args.tensor_parallel_size * args.pipeline_parallel_size)
    if available <= 0:
        steps = "\n  ".join(triage_steps(device, None))
        raise ValueError(
            f"no memory left for the KV cache on {device} ({format_gib(available)}): weights take "
            f"{format_gib(weight_bytes)} and the activation peak {format_gib(peak_activation_bytes)}"
            f". Fix in this order:\n  {steps}")
    return available


def make_kv_cache_plan(model_config: ModelConfig, kv_cache_dtype: str, model_dtype: torch.dtype,
                       block_size: int, available_bytes: int) -> KVCachePlan:
    """Splits `available_bytes` into whole blocks for this model's KV shape (no device needed)."""
    bytes_per_token = model_config.kv_bytes_per_token(
        kv_cache_element_bytes(kv_cache_dtype, model_dtype))
    num_blocks = max(0, available_bytes) // (bytes_per_token * block_size)
    return KVCachePlan(available_bytes, bytes_per_token, block_size, num_blocks)


def plan_kv_cache(model_config: ModelConfig, args: EngineArgs, device: torch.device,
                  model_dtype: torch.dtype, weight_bytes: int,
                  peak_activation_bytes: int = 0, max_model_len: int | None = None
                  ) -> KVCachePlan:
    """Sizes the KV cache for the engine: the budget on `device`, split into blocks.

    With `max_model_len`, the CPU default budget is also capped at what `max_num_seqs`
    requests of that length could use.
    """
    available = available_kv_cache_bytes(args, device, weight_bytes, peak_activation_bytes)
    if max_model_len is not None and device.type == "cpu" and args.kv_cache_memory_bytes is None:
        # On CPU a zeroed cache costs real RAM and startup time: never take more than
        # max_num_seqs full-length requests could ever use.
        per_request = -(-max_model_len // args.block_size) * args.block_size
        bytes_per_token = model_config.kv_bytes_per_token(
            kv_cache_element_bytes(args.kv_cache_dtype, model_dtype))
        available = min(available, args.max_num_seqs * per_request * bytes_per_token)
    return make_kv_cache_plan(model_config, args.kv_cache_dtype, model_dtype, args.block_size,
                              available)


def resolve_max_num_batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    """The per-step token budget: --max-num-batched-tokens, else the adaptive budget's ceiling
    (engine/core/step_budget.py): 2048, raised to max_model_len (up to 8192) so a long prompt
    needs fewer chunks when nothing decodes, and to max_num_seqs (vLLM's rule) so every running
    request's decode fits in one step. `serve` sizes its activation peak and `plan` its
    activation reserve from this one value."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, min(max_model_len, 8192), args.max_num_seqs)


def resolve_max_model_len(model_config: ModelConfig, args: EngineArgs) -> int:
    """--max-model-len, else the model's max_position_embeddings; more than that is refused."""
    limit = model_config.max_position_embeddings
    if args.max_model_len is None:
        return limit
    if args.max_model_len > limit:
        raise ValueError(
            f"max_model_len {args.max_model_len:,} is greater than the model's "
            f"max_position_embeddings {limit:,}; lower --max-model-len to <= {limit}")
    return args.max_model_len


def check_max_model_len_fits(plan: KVCachePlan, max_model_len: int, device: torch.device) -> None:
    """Raises ValueError when one request of `max_model_len` tokens cannot fit in the cache."""
    if plan.max_concurrency(max_model_len) >= 1.0:
        return
    fitting = plan.max_fitting_model_len()
    needed = plan.blocks_per_request(max_model_len) * plan.block_size * plan.bytes_per_token
    steps = "\n  ".join(triage_steps(device, fitting or None))
    raise ValueError(
        f"max_model_len {max_model_len:,} does not fit: one request of {max_model_len:,} tokens "
        f"needs {format_gib(needed)} of KV cache, but the {_device_label(device)} KV cache holds "
        f"only {plan.num_tokens:,} tokens ({format_gib(plan.available_bytes)}). The largest "
        f"max_model_len that fits is {fitting:,}. Fix in this order:\n  {steps}")


def _device_label(device: torch.device) -> str:
    """"GPU" on CUDA, "CPU" otherwise, as in vLLM's "GPU KV cache size" line."""
    return "GPU" if device.type == "cuda" else "CPU"


def capacity_log_lines(plan: KVCachePlan, device: torch.device, max_model_len: int,
                       tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, *,
                       weight_bytes: int = 0, offloaded_bytes: int = 0) -> list[str]:
    """vLLM's three capacity lines: available memory, KV cache size, maximum concurrency. With
    tensor and/or pipeline parallelism `plan` is one rank's (its share of the KV heads of its
    stage's layers): the memory is per rank, while every rank holds all the tokens, as vLLM counts them. With --cpu-offload-gb a fourth
    says where the weights are: `weight_bytes` on the device (what the budget subtracted),
    `offloaded_bytes` in CPU memory."""
    # Each stage holds the KV of its layers and each tensor rank its share of their KV heads,
    # for every token: the memory is per rank, the tokens the whole engine's.
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    sizes = " x ".join(f"{name} parallel size {n}" for name, n in
                       (("tensor", tp), ("pipeline", pp)) if n > 1)
    per_rank = "" if tp * pp == 1 else \
        f" per {'stage' if tp == 1 else 'rank'} ({sizes}, " \
        f"{format_gib(plan.available_bytes * tp * pp)} in all)"
    return [
        f"Available KV cache memory: {format_gib(plan.available_bytes)}{per_rank}",
        f"{_device_label(device)} KV cache size: {plan.num_tokens:,} tokens",
        f"Maximum concurrency for {max_model_len:,} tokens per request: "
        f"{plan.max_concurrency(max_model_len):.2f}x",
    ] + ([f"Model weights on {_device_label(device)}: {format_gib(weight_bytes)}, CPU offload "
          f"(--cpu-offload-gb): {format_gib(offloaded_bytes)} in CPU memory, not counted "
          "against the KV budget"] if offloaded_bytes > 0 else [])
