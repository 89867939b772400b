"""Ahead-of-time compilation of the Triton kernels for real GPU targets, with no GPU: the
launchers' real calls are captured (each grid launch is recorded instead of run), turned into
the kernels' signatures and constexprs, compiled for each target with the ptxas inside the
triton wheel, and the cubin's resources (registers, local memory for spills, shared memory)
read back with the wheel's cuobjdump.

Run it in a process where Triton is not in interpreter mode (the kernel tests switch theirs):
`python -m tests.support.triton_targets` prints every specialization's resources per target.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.worker.cuda_graphs import _StaticBuffers, capture_sizes
from kernels.metadata import AttentionMetadata
from kernels.selector import check_triton_support

ARCHS = (80, 89, 90)
# Largest shared memory one block may use (opt-in), bytes: A100, Ada, H100/H200.
SHARED_LIMIT = {80: 166912, 89: 101376, 90: 232448}
MAX_REGISTERS = 255
MAX_SPILL_BYTES = 8  # local memory per thread a kernel may use before it counts as spilling
KERNELS = ("_cache_kernel", "_attention_kernel", "_reduce_kernel")
QUANT_KERNELS = ("_quant_linear_kernel", "_dequant_int4_kernel",  # triton_quant_linear.py
                 "_dequant_tinygemm_kernel")
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int32: "i32",
                torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8"}


@dataclass(frozen=True)
class Launch:
    """One kernel specialization as a launcher produced it."""

    kernel: str
    signature: tuple[tuple[str, str], ...]  # (argument, Triton type or "constexpr")
    constexprs: tuple[tuple[str, Any], ...]
    kv_dtype: str  # the KV cache's element type (what the guards look at)
    block_size: int

    def label(self) -> str:
        """The constexprs that tell specializations apart, and the pointer types."""
        ptrs = sorted({t for _, t in self.signature if t.startswith("*")})
        return f"{self.kernel}({', '.join(ptrs)}; " + ", ".join(
            f"{k}={v}" for k, v in self.constexprs) + ")"


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **constexprs)` records a Launch."""

    def __init__(self, name: str, jit: Any, sink: list[Launch], kv: torch.Tensor) -> None:
        self.name, self.jit, self.sink, self.kv = name, jit, sink, kv

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **constexprs: Any) -> None:
            names = self.jit.arg_names
            signature = [(n, _arg_type(a)) for n, a in zip(names, args, strict=False)]
            signature += [(n, "constexpr") for n in names[len(args):]]
            # the launch options (warps, pipeline stages) ride along as constexprs
            options = tuple((k, constexprs[k]) for k in ("num_warps", "num_stages")
                            if k in constexprs)
            self.sink.append(Launch(self.name, tuple(signature),
                                    tuple((n, constexprs[n]) for n in names[len(args):])
                                    + options,
                                    TRITON_TYPES[self.kv.dtype], int(self.kv.shape[1])))
        return launch


@dataclass(frozen=True)
class Shape:
    """One model's attention shape and cache."""

    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None  # None: the model dtype
    head_dim: int = 128
    block_size: int = 16
    group: int = 4
    num_kv_heads: int = 8
    window: int | None = None


def _metadata(query_lens: list[int], seq_lens: list[int], shape: Shape) -> AttentionMetadata:
    bs, starts = shape.block_size, [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    max_blocks = max(-(-s // bs) for s in seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32),
        query_lens_list=query_lens, seq_lens_list=seq_lens, block_size=bs,
        sliding_window=shape.window)


# (query lens, sequence lens): decodes, a prefill, decodes mixed with a chunk after a cached
# prefix, and long decodes that split the context into segments (flash-decoding).
BATCHES = {"decode": ([1] * 4, [100] * 4), "prefill": ([300], [300]),
           "mixed": ([1, 1, 50], [90, 130, 250]), "split": ([1, 1], [8192, 6000])}


def _run_launchers(shape: Shape, meta: AttentionMetadata, max_seq_len: int | None = None
                   ) -> list[Launch]:
    from kernels import triton_attention as ta

    num_tokens = meta.slot_mapping.shape[0]
    heads, kv_heads, dim = shape.num_kv_heads * shape.group, shape.num_kv_heads, shape.head_dim
    kv_dtype = shape.kv_dtype or shape.dtype
    k_cache = torch.empty(1, shape.block_size, kv_heads, dim, dtype=kv_dtype)
    kv = torch.empty(num_tokens, kv_heads, dim, dtype=shape.dtype)
    query = torch.empty(num_tokens, heads, dim, dtype=shape.dtype)
    launches: list[Launch] = []
    originals = {name: getattr(ta, name) for name in KERNELS}
    try:
        for name, jit in originals.items():
            setattr(ta, name, _Recorder(name, jit, launches, k_cache))
        ta.reshape_and_cache(kv, kv, k_cache, k_cache, meta.slot_mapping, 0.5, 0.5)
        ta.unified_attention(query, k_cache, k_cache, meta, dim ** -0.5, 0.5, 0.5,
                             max_seq_len=max_seq_len)
    finally:
        for name, jit in originals.items():
            setattr(ta, name, jit)
    return launches


def shapes() -> Iterator[Shape]:
    """The base shape, then one dimension varied at a time."""
    yield Shape()
    for dtype in (torch.float16, torch.float32):
        yield Shape(dtype=dtype)
    for dtype in (torch.bfloat16, torch.float16):
        for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
            yield Shape(dtype=dtype, kv_dtype=kv)
    for head_dim in (64, 80, 96, 256):
        yield Shape(head_dim=head_dim)
    for block_size in (1, 2, 4, 8, 32, 64, 128):
        yield Shape(block_size=block_size)
    for group in (1, 8):
        yield Shape(group=group)
    yield Shape(window=4096)


# The quantized linears' launches: each tiling `pick_config` gives (rows up to 16, 32, 64 and
# past 64; split or not), for int8 and int4 codes, activations in each dtype.
QUANT_ROWS = (1, 24, 64, 256)


def _quant_launches() -> list[Launch]:
    from kernels import triton_quant_linear as tq

    launches: list[Launch] = []
    originals = {name: getattr(tq, name) for name in QUANT_KERNELS}
    marker = torch.empty(1, 16, dtype=torch.bfloat16)  # no KV cache: any guard passes
    try:
        for name, jit in originals.items():
            setattr(tq, name, _Recorder(name, jit, launches, marker))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            codes, scale_zeros = (torch.empty(2048, 4096, dtype=torch.uint8),
                                  torch.empty(128, 4096, 2, dtype=dtype))
            for rows in QUANT_ROWS:
                x = torch.empty(rows, 4096, dtype=dtype)
                tq.quant_linear(x, codes, scale_zeros, 4, 32)
                tq.quant_linear(x, torch.empty(4096, 4096, dtype=torch.int8),
                                torch.empty(4096, dtype=dtype), 8)
            for group in (32, 128):
                tq.dequantize_int4(codes, scale_zeros[: 4096 // group], group, dtype)
        for tiles in (2, 4, 8):  # tinygemm's layout (bfloat16 only) in each k-tile packing
            tq.dequantize_tinygemm(torch.empty(512, 4096 // (16 * tiles), 32, tiles // 2,
                                               dtype=torch.int32),
                                   torch.empty(128, 4096, 2, dtype=torch.bfloat16), 32,
                                   torch.bfloat16)
    finally:
        for name, jit in originals.items():
            setattr(tq, name, jit)
    return launches


def specializations(max_num_seqs: int = 256, max_model_len: int = 8192) -> list[Launch]:
    """Every distinct launch the launchers make over the shapes x batches, plus the decode
    steps CUDA graphs capture (each captured batch size, sequence lengths at the static bound
    the graph runner gives them), plus the quantized linears' tilings."""
    found: dict[Launch, None] = {}
    for shape in shapes():
        for query_lens, seq_lens in BATCHES.values():
            found.update(dict.fromkeys(_run_launchers(shape, _metadata(query_lens, seq_lens,
                                                                       shape))))
    base = Shape()
    buffers = _StaticBuffers(max_num_seqs, -(-max_model_len // base.block_size),
                             torch.device("cpu"))
    for size in capture_sizes(max_num_seqs):
        meta = buffers.metadata(size, base.block_size, max_model_len, None, None)
        found.update(dict.fromkeys(_run_launchers(base, meta, max_model_len)))
    found.update(dict.fromkeys(_quant_launches()))
    return list(found)


def guard_allows(launch: Launch, arch: int) -> bool:
    """Whether kvserve's startup guard lets this specialization run on `arch`."""
    dtypes = {v: k for k, v in TRITON_TYPES.items()}
    try:
        check_triton_support(launch.block_size, dtypes[launch.kv_dtype], divmod(arch, 10))
    except ValueError:
        return False
    return True


def _bin(tool: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_launch(launch: Launch, arch: int) -> dict[str, Any]:
    """Compiles one specialization for sm_`arch`: its resources, or the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_attention as ta
    from kernels import triton_quant_linear as tq

    signature = dict(launch.signature)
    names = list(signature)
    constexprs = dict(launch.constexprs)
    # launch options (warps, pipeline stages) travel with the constexprs; Triton takes them apart
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    source = ASTSource(getattr(tq if launch.kernel in QUANT_KERNELS else ta, launch.kernel),
                       {k: v for k, v in signature.items() if k not in options},
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # CompilationError or a backend error, by Triton version
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"ok": True, "shared": int(compiled.metadata.shared),
            **_resources(compiled.asm["cubin"])}


def _resources(cubin: bytes) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([_bin("cuobjdump"), "-res-usage", str(path)],
                              capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", text))
    return {"registers": int(usage["REG"]), "local": int(usage["LOCAL"]),
            "static_shared": int(usage["SHARED"])}


def _compile_job(job: tuple[Launch, int]) -> dict[str, Any]:
    return compile_launch(*job)


def compile_all(workers: int = 2) -> list[dict[str, Any]]:
    """Every specialization on every target: one row each, with the guard's verdict."""
    launches = specializations()
    jobs = [(launch, arch) for launch in launches for arch in ARCHS]
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(_compile_job, jobs, chunksize=4))
    return [{"label": launch.label(), "arch": arch, "allowed": guard_allows(launch, arch),
             **result} for (launch, arch), result in zip(jobs, results, strict=True)]


def within_limits(row: dict[str, Any]) -> list[str]:
    """What a compiled row exceeds on its target (empty when it fits)."""
    problems = []
    if row["registers"] > MAX_REGISTERS:
        problems.append(f"{row['registers']} registers")
    if row["local"] > MAX_SPILL_BYTES:
        problems.append(f"{row['local']} bytes of local memory (spills)")
    if row["shared"] + row["static_shared"] > SHARED_LIMIT[row["arch"]]:
        problems.append(f"{row['shared']} bytes of shared memory")
    return problems


# (KV element type, block size, target) around what the guards decide.
GUARD_CASES = [(torch.bfloat16, 16, 80), (torch.bfloat16, 8, 90), (torch.bfloat16, 1, 80), (torch.bfloat16, 128, 90),
               (torch.float8_e4m3fn, 16, 80), (torch.float8_e4m3fn, 16, 89),
               (torch.float8_e4m3fn, 32, 90), (torch.float8_e5m2, 16, 80)]


def guard_case_rows() -> list[dict[str, Any]]:
    """For each GUARD_CASE, the decode attention launch of a bfloat16 model with that cache:
    whether it compiles, and whether the guard lets it run."""
    rows = []
    for kv_dtype, block_size, arch in GUARD_CASES:
        shape = Shape(kv_dtype=kv_dtype, block_size=block_size)
        query_lens, seq_lens = BATCHES["decode"]
        (launch,) = [launch for launch in _run_launchers(shape, _metadata(query_lens, seq_lens,
                                                                          shape))
                     if launch.kernel == "_attention_kernel"]
        rows.append({"arch": arch, "allowed": guard_allows(launch, arch),
                     **compile_launch(launch, arch)})
    return rows


def run_in_fresh_process(function: str) -> list[dict[str, Any]]:
    """Calls this module's `function` in a new interpreter without TRITON_INTERPRET (the kernel
    tests put this one's Triton in interpreter mode) and returns the rows it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json; from tests.support import triton_targets as t; print(json.dumps(t.{function}()))"
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    """Prints the rows as JSON (last line) after a readable table."""
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    rows = compile_all()
    for row in rows:
        verdict = "refused by the guard" if not row["allowed"] else (
            "ok" if row["ok"] else "COMPILE ERROR")
        figures = (f"regs {row['registers']:3d} local {row['local']:4d} shared "
                   f"{row['shared']:6d}") if row["ok"] else row["error"][:60]
        print(f"sm_{row['arch']} {figures:36s} {verdict:22s} {row['label']}", file=sys.stderr)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
