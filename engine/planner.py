"""`kvserve plan`: "my GPU has X GB, what should I set?", answered from the model config alone.

No weights are loaded. The budget follows vLLM's profiler:

    KV cache bytes = memory x --gpu-memory-utilization - weights - activation reserve

where the weights are num_params x dtype bytes (a GGUF is dequantized to --dtype on load), or
their codes and scales under --quantization (`engine.quantization.quantized_weight_bytes`), and the
activation reserve is an estimate of what `kvserve serve` measures at startup (see
`estimate_activation_reserve`). The cache is then split into blocks with the seed's formula and
shown as max concurrency for a few max_model_len values.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.capacity import (
    KVCachePlan,
    capacity_log_lines,
    format_gib,
    make_kv_cache_plan,
    parse_bytes,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
    triage_steps,
)
from engine.config import (
    EngineArgs,
    ModelConfig,
    add_engine_flags,
    effective_quantization,
    engine_args_from_flags,
)
from engine.distributed.parallel_state import (
    check_tensor_parallel_size,
    rank_model_config,
    vocab_per_rank,
)
from engine.quantization import quantized_weight_bytes
from engine.worker.offload import planned_layer_tensor_bytes, planned_offload_bytes

CANDIDATE_MODEL_LENS = (2048, 4096, 8192, 16384, 32768)
# Tokens in the profiling forward pass when --max-num-batched-tokens is not given: vLLM V1's
# default chunked-prefill budget for online serving.
# Device memory outside torch's tensors: CUDA context, cuBLAS workspace, allocator slack.
CUDA_OVERHEAD_BYTES = 512 * 1024**2
# Bytes per vocab entry per sequence in the sampler: fp32 logits plus fp32 probabilities.
SAMPLER_BYTES_PER_LOGIT = 8
# Without --max-model-len, recommend the longest listed length that still holds this many
# full-length requests (or --max-num-seqs, if lower).
TARGET_CONCURRENCY = 8
PLAN_DEVICE = torch.device("cuda")


@dataclass(frozen=True)
class ActivationReserve:
    """The activation estimate and the numbers that went into it (printed as its formula)."""

    profile_tokens: int
    per_token_elements: int
    dtype_bytes: int
    max_num_seqs: int
    vocab_size: int

    @property
    def total_bytes(self) -> int:
        """CUDA overhead + batch activations + sampler logits."""
        batch = self.profile_tokens * self.per_token_elements * self.dtype_bytes
        sampler = self.max_num_seqs * self.vocab_size * SAMPLER_BYTES_PER_LOGIT
        return CUDA_OVERHEAD_BYTES + batch + sampler


@dataclass(frozen=True)
class ConcurrencyRow:
    """Max concurrency at one max_model_len."""

    max_model_len: int
    blocks_per_request: int
    max_concurrency: float
    is_user_value: bool

    @property
    def fits(self) -> bool:
        """Whether at least one request of this length fits."""
        return self.max_concurrency >= 1.0


@dataclass(frozen=True)
class Recommendation:
    """The flags `kvserve plan` suggests."""

    max_model_len: int
    max_num_seqs: int


@dataclass(frozen=True)
class PlanReport:
    """Every number `kvserve plan` prints."""

    model: str
    model_config: ModelConfig
    memory_bytes: int
    args: EngineArgs
    dtype: torch.dtype
    weight_bytes: int
    activation: ActivationReserve
    kv_plan: KVCachePlan
    alt_kv_cache_dtype: str
    alt_kv_plan: KVCachePlan
    rows: tuple[ConcurrencyRow, ...]
    recommendation: Recommendation | None
    tensor_parallel_size: int = 1
    rank_config: ModelConfig | None = None  # one rank's shapes; None: the whole model
    offloaded_bytes: int = 0  # of weight_bytes, kept in CPU memory by --cpu-offload-gb

    @property
    def kv_config(self) -> ModelConfig:
        """The shapes one GPU's KV cache holds (its share of the KV heads)."""
        return self.rank_config or self.model_config

    @property
    def budget_bytes(self) -> int:
        """memory x --gpu-memory-utilization."""
        return int(self.memory_bytes * self.args.gpu_memory_utilization)

    @property
    def kv_element_bytes(self) -> int:
        """Bytes per K or V element in the cache."""
        return self.kv_plan.bytes_per_token // self.kv_config.kv_bytes_per_token(1)


def load_model_config(model: str | None) -> tuple[ModelConfig, str]:
    """ModelConfig from an HF folder (config.json) or a GGUF file; None = the embedded default."""
    if model is not None and Path(model).is_dir():
        return ModelConfig.from_folder(model), model
    from engine.model_loader.gguf.weights import default_model_path, is_gguf_file, read_gguf_config

    path = Path(model) if model is not None else default_model_path()
    if path.is_file() and is_gguf_file(path):
        return read_gguf_config(path), str(path)
    raise ValueError(f"{path} is neither a model folder with config.json nor a .gguf file")


def estimate_activation_reserve(cfg: ModelConfig, dtype_bytes: int, profile_tokens: int,
                                max_num_seqs: int) -> ActivationReserve:
    """Peak non-KV memory of one forward pass over `profile_tokens` tokens plus sampling.

    Per token: residual, normed input, attention output and MLP output (4 x hidden), gate_up and
    the activated product (3 x intermediate), the qkv projection and attention result
    (2 x (q + kv)); plus fp32 logits and probabilities for max_num_seqs sequences, plus
    CUDA_OVERHEAD_BYTES.
    """
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_token = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + 2 * (q + kv)
    return ActivationReserve(profile_tokens, per_token, dtype_bytes, max_num_seqs, cfg.vocab_size)


def candidate_model_lens(max_position_embeddings: int, user_len: int | None) -> list[int]:
    """The listed lengths up to the model's limit, the limit itself if short, the user's value."""
    lens = {n for n in CANDIDATE_MODEL_LENS if n <= max_position_embeddings}
    if max_position_embeddings < CANDIDATE_MODEL_LENS[-1]:
        lens.add(max_position_embeddings)
    if user_len is not None:
        lens.add(user_len)
    return sorted(lens)


def concurrency_rows(plan: KVCachePlan, lens: list[int],
                     user_len: int | None) -> tuple[ConcurrencyRow, ...]:
    """One row per max_model_len."""
    return tuple(ConcurrencyRow(n, plan.blocks_per_request(n), plan.max_concurrency(n),
                                n == user_len) for n in lens)


def choose_model_len(rows: tuple[ConcurrencyRow, ...], max_num_seqs: int) -> int | None:
    """The longest length holding TARGET_CONCURRENCY requests, else the one holding the most."""
    fitting = [r for r in rows if r.fits and not r.is_user_value]
    target = min(TARGET_CONCURRENCY, max_num_seqs)
    preferred = [r.max_model_len for r in fitting if math.floor(r.max_concurrency) >= target]
    if preferred:
        return max(preferred)
    return min((r.max_model_len for r in fitting), default=None)


def recommend(rows: tuple[ConcurrencyRow, ...], max_num_seqs: int) -> Recommendation | None:
    """The user's --max-model-len if it fits, else `choose_model_len`; seqs the cache holds."""
    user = next((r for r in rows if r.is_user_value), None)
    length = user.max_model_len if user is not None and user.fits else choose_model_len(
        rows, max_num_seqs)
    if length is None:
        return None
    row = next(r for r in rows if r.max_model_len == length)
    return Recommendation(length, min(max_num_seqs, math.floor(row.max_concurrency)))


def build_plan(args: EngineArgs, memory_bytes: int,
               model_config: ModelConfig | None = None) -> PlanReport:
    """Plans the KV cache for `args.model` on a GPU of `memory_bytes`, without loading weights.

    `model_config` skips reading args.model (for callers that already have one).
    """
    args.validate()
    cfg, label = (model_config, args.model or "model") if model_config is not None else \
        load_model_config(args.model)
    user_len = resolve_max_model_len(cfg, args) if args.max_model_len is not None else None
    dtype = args.resolved_dtype(PLAN_DEVICE)
    tp = args.tensor_parallel_size  # every figure below is one GPU's (one rank's shard)
    check_tensor_parallel_size(cfg, tp)
    rank = rank_model_config(cfg, tp)
    weight_bytes = quantized_weight_bytes(rank_weight_config(cfg, tp), args.quantization, dtype,
                                          args.quantization_group_size)
    offloaded, _ = planned_offload_bytes(rank, args.cpu_offload_gb, planned_layer_tensor_bytes(
        rank, args.quantization, dtype, args.quantization_group_size))
    # The same step budget `serve` would use for these flags (and so the same activation peak).
    step_tokens = resolve_max_num_batched_tokens(args, user_len or cfg.max_position_embeddings)
    activation = estimate_activation_reserve(rank, dtype.itemsize, step_tokens, args.max_num_seqs)
    available = (int(memory_bytes * args.gpu_memory_utilization) - weight_bytes + offloaded
                 - activation.total_bytes)
    plan = make_kv_cache_plan(rank, args.kv_cache_dtype, dtype, args.block_size, available)
    alt_dtype = "fp8_e4m3" if args.kv_cache_dtype == "auto" else "auto"
    alt_plan = make_kv_cache_plan(rank, alt_dtype, dtype, args.block_size, available)
    rows = concurrency_rows(plan, candidate_model_lens(cfg.max_position_embeddings, user_len),
                            user_len)
    return PlanReport(label, cfg, memory_bytes, args, dtype, weight_bytes, activation, plan,
                      alt_dtype, alt_plan, rows, recommend(rows, args.max_num_seqs), tp,
                      rank if tp > 1 else None, offloaded)


def rank_weight_config(cfg: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The shapes of one rank's weights: its heads, MLP slice and vocab slice."""
    return dataclasses.replace(rank_model_config(cfg, tensor_parallel_size),
                               vocab_size=vocab_per_rank(cfg.vocab_size, tensor_parallel_size))


def _dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def _model_lines(r: PlanReport) -> list[str]:
    """The model's shape."""
    c = r.model_config
    return [f"Model: {r.model} ({c.architecture})",
            f"  {c.num_hidden_layers} layers, {c.num_attention_heads} heads / "
            f"{c.num_key_value_heads} KV heads, head_dim {c.head_dim}, hidden {c.hidden_size:,}, "
            f"vocab {c.vocab_size:,}, max_position_embeddings {c.max_position_embeddings:,}"] + ([
            f"  --tensor-parallel-size {r.tensor_parallel_size}: each GPU holds "
            f"{r.kv_config.num_attention_heads} heads / {r.kv_config.num_key_value_heads} KV "
            f"heads, 1/{r.tensor_parallel_size} of the MLP and vocab; figures below are per GPU"]
            if r.rank_config is not None else [])


def _memory_lines(r: PlanReport) -> list[str]:
    """Where the memory goes: budget, weights, activation reserve, KV cache."""
    a = r.activation
    params = rank_weight_config(r.model_config, r.tensor_parallel_size).num_params()
    lines = [
        f"Memory{' per GPU' if r.rank_config else ''}: {format_gib(r.memory_bytes)} x "
        f"--gpu-memory-utilization "
        f"{r.args.gpu_memory_utilization} = {format_gib(r.budget_bytes)}",
        f"  weights             {format_gib(r.weight_bytes):>11}  = "
        f"{params:,} params x {r.dtype.itemsize} B ({_dtype_name(r.dtype)})"
        if effective_quantization(r.args.quantization, r.model_config) == "none" else
        f"  weights             {format_gib(r.weight_bytes):>11}  = {params:,}"
        f" params, --quantization "
        f"{effective_quantization(r.args.quantization, r.model_config)} (codes and scales; "
        f"the rest in "
        f"{_dtype_name(r.dtype)})",
        f"  activation reserve  {format_gib(a.total_bytes):>11}  = "
        f"{CUDA_OVERHEAD_BYTES // 1024**2} MiB (CUDA context, cuBLAS) + {a.profile_tokens:,} "
        f"batched tokens x {a.per_token_elements:,} (4 x hidden + 3 x intermediate + "
        f"2 x (q + kv)) x {a.dtype_bytes} B + {a.max_num_seqs} seqs x {a.vocab_size:,} vocab x "
        f"{SAMPLER_BYTES_PER_LOGIT} B (fp32 logits + probs)",
        f"  KV cache            {format_gib(r.kv_plan.available_bytes):>11}  = budget - weights "
        f"{'+ CPU offload ' if r.offloaded_bytes else ''}- activation reserve (kvserve serve "
        "measures the real activation peak at startup)",
    ]
    if r.offloaded_bytes:  # whole tensors of the decoder layers, in order, as serve moves them
        lines.insert(2, f"  CPU offload         {format_gib(r.offloaded_bytes):>11}  of those "
                     f"weights in CPU memory, not on the GPU: --cpu-offload-gb "
                     f"{r.args.cpu_offload_gb:g}, whole decoder-layer tensors in order")
    return lines


def _kv_lines(r: PlanReport) -> list[str]:
    """Bytes per token with the seed's formula, tokens, and the fp8 / 16-bit comparison."""
    c, p, alt = r.kv_config, r.kv_plan, r.alt_kv_plan
    ratio = alt.num_tokens / p.num_tokens if p.num_tokens else 0.0
    return [
        f"KV cache: --kv-cache-dtype {r.args.kv_cache_dtype}, block size {p.block_size}",
        f"  bytes per token     {p.bytes_per_token:,} B = 2 x {c.num_hidden_layers} layers x "
        f"{c.num_key_value_heads} KV heads x {c.head_dim} head_dim x {r.kv_element_bytes} B",
        f"  KV cache size       {p.num_tokens:,} tokens ({p.num_blocks:,} blocks)",
        f"  with --kv-cache-dtype {r.alt_kv_cache_dtype}: {alt.bytes_per_token:,} B per token -> "
        f"{alt.num_tokens:,} tokens ({ratio:.2f}x)",
    ]


def _table_lines(r: PlanReport) -> list[str]:
    """max_model_len -> blocks per request -> max concurrency."""
    lines = ["Max concurrency (full-length requests the cache holds at once):",
             f"  {'max_model_len':>13}  {'blocks/request':>14}  {'max concurrency':>15}"]
    for row in r.rows:
        note = "  (your --max-model-len)" if row.is_user_value else ""
        note += "" if row.fits else "  does not fit"
        lines.append(f"  {row.max_model_len:>13,}  {row.blocks_per_request:>14,}  "
                     f"{row.max_concurrency:>14.2f}x{note}")
    return lines


def _recommendation_lines(r: PlanReport) -> list[str]:
    """The "Recommended flags" line, or the triage steps when nothing fits."""
    rec, args = r.recommendation, r.args
    user = next((row for row in r.rows if row.is_user_value), None)
    lines = []
    if user is not None and not user.fits:
        lines.append(f"--max-model-len {user.max_model_len} does not fit: the cache holds "
                     f"{r.kv_plan.num_tokens:,} tokens, the largest max_model_len that fits is "
                     f"{r.kv_plan.max_fitting_model_len():,}.")
    if rec is None:
        fitting = r.kv_plan.max_fitting_model_len()
        return lines + [f"Nothing fits: not even one {r.rows[0].max_model_len:,}-token request "
                        "fits in the KV cache. Fix in this order:"] + [
            f"  {step}" for step in triage_steps(PLAN_DEVICE, fitting or None)]
    log = capacity_log_lines(r.kv_plan, PLAN_DEVICE, rec.max_model_len, r.tensor_parallel_size,
                             weight_bytes=r.weight_bytes - r.offloaded_bytes,
                             offloaded_bytes=r.offloaded_bytes)
    return lines + ["Expected startup log of kvserve serve with these flags:"] + [
        f"  {line}" for line in log] + [
        f"Recommended flags: --max-model-len {rec.max_model_len} --gpu-memory-utilization "
        f"{args.gpu_memory_utilization} --max-num-seqs {rec.max_num_seqs} --kv-cache-dtype "
        f"{args.kv_cache_dtype}",
        "  (--max-num-seqs is capped at the full-length requests the cache holds, so none is "
        "preempted; raise it if most requests are much shorter)"]


def format_plan(report: PlanReport) -> str:
    """The readable plan: model, memory split, KV cache, concurrency table, recommended flags."""
    sections = [_model_lines(report), _memory_lines(report), _kv_lines(report),
                _table_lines(report), _recommendation_lines(report)]
    return "\n\n".join("\n".join(lines) for lines in sections)


def _memory_arg(text: str) -> int:
    """argparse type for --memory."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvserve plan`: the engine flags that shape the cache, plus --memory."""
    add_engine_flags(parser, "plan")
    parser.add_argument("--memory", type=_memory_arg, default=None,
                        help="GPU memory, e.g. 24GiB or 24GB (default: this machine's GPU)")


def _resolve_memory(memory: int | None) -> int:
    """--memory, else the total memory of this machine's GPU."""
    if memory is not None:
        return memory
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1]
    raise ValueError("no GPU here to measure: pass --memory, e.g. --memory 24GiB")


def run_plan(ns: argparse.Namespace) -> int:
    """Prints the plan; 0 when a recommendation exists, 1 when nothing fits, 2 on bad input."""
    try:
        args = engine_args_from_flags(ns, "plan")
        report = build_plan(args, _resolve_memory(ns.memory))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(report))
    return 0 if report.recommendation is not None else 1
