"""One-command GPU check: `python -m kernels.gpu_check [--out results/gpu_check.json]`.

On a CUDA machine, in one run (budget: under 8 minutes on one H200):
1. the kernel tests compiled for CUDA (not the interpreter): `pytest tests/test_triton_attention.py
   --kernel-device cuda`;
2. the device's copy bandwidth, then the decode attention kernel's achieved bandwidth (KV bytes
   read / median time from `triton.testing.do_bench`) at batch 1/16/64/256 x context 1k/4k/16k,
   and prefill chunks, as a share of the copy bandwidth (target: >= 80% at batch >= 64, 4k);
3. greedy parity on the GPU: the tiny model and SmolLM2 in bfloat16 against transformers, a
   divergence allowed only where each side's token is in the other's top 5;
4. decode throughput of a Llama-3-8B-shaped model with random bfloat16 weights at batch 1, 32
   and 128, with and without CUDA graphs, beside transformers' `generate`;
then prints one summary table and writes every number to the JSON file.

`--smoke` runs the same plumbing on CPU with tiny shapes and the torch kernels, so the script is
tested in CI even where no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.metadata import AttentionMetadata

REPO = Path(__file__).resolve().parent.parent
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


@dataclass
class Report:
    """Everything measured, and the summary rows printed last."""

    device: str
    sections: dict[str, Any] = field(default_factory=dict)
    summary: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, name: str, value: str, verdict: str = "") -> None:
        """One summary row."""
        self.summary.append((name, value, verdict))
        print(f"[gpu_check] {name}: {value} {verdict}", flush=True)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of fn: Triton's do_bench on CUDA, a short loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[1]


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device)
    return 2 * num_bytes / (ms / 1000) / 1e9


def decode_metadata(num_seqs: int, ctx: int, block_size: int, device: torch.device
                    ) -> tuple[AttentionMetadata, int]:
    """A decode batch: each sequence at `ctx` tokens over its own shuffled blocks."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * blocks_per_seq
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    pos = ctx - 1
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32,
                                                         device=device),
        seq_lens=torch.full((num_seqs,), ctx, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32), query_lens_list=[1] * num_seqs,
        seq_lens_list=[ctx] * num_seqs, block_size=block_size)
    return meta, num_blocks


def prefill_metadata(q_len: int, ctx: int, block_size: int, device: torch.device
                     ) -> tuple[AttentionMetadata, int]:
    """One prefill chunk of q_len tokens ending at ctx (so ctx - q_len are cached)."""
    num_blocks = -(-ctx // block_size)
    table = torch.randperm(num_blocks, device=device)[None, :]
    pos = torch.arange(ctx - q_len, ctx, device=device)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, q_len], dtype=torch.int32,
                                                         device=device),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=device),
        block_tables=table.to(torch.int32), query_lens_list=[q_len], seq_lens_list=[ctx],
        block_size=block_size)
    return meta, num_blocks


def attention_bandwidth(report: Report, device: torch.device, batches: list[int],
                        contexts: list[int], heads: tuple[int, int, int], dtype: torch.dtype,
                        copy_gbs: float) -> None:
    """Decode and prefill-chunk attention: KV GB/s and its share of the copy bandwidth."""
    attend = _attention_fn(device)
    num_heads, num_kv_heads, head_dim = heads
    rows: list[dict[str, Any]] = []
    for name, builder, shapes in (
            ("decode", decode_metadata, [(b, c) for b in batches for c in contexts]),
            ("prefill", prefill_metadata, [(c // 4, c) for c in contexts])):
        for first, ctx in shapes:
            meta, num_blocks = builder(first, ctx, 16, device)
            k_cache = torch.randn(num_blocks, 16, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)
            v_cache = torch.randn_like(k_cache)
            num_tokens = meta.query_start_loc.shape[0] - 1 if name == "decode" else first
            query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
            ms = timed(lambda q=query, k=k_cache, v=v_cache, m=meta:  # type: ignore[misc]
                       attend(q, k, v, m, head_dim ** -0.5), device)
            kv_tokens = sum(meta.seq_lens_list)
            gbs = kv_tokens * num_kv_heads * head_dim * 2 * k_cache.element_size() / ms / 1e6
            rows.append({"kind": name, "first": first, "ctx": ctx, "ms": ms, "kv_gbs": gbs,
                         "share_of_copy": gbs / copy_gbs})
            print(f"  {name} {first} x {ctx}: {ms:.3f} ms, {gbs:.0f} GB/s "
                  f"({gbs / copy_gbs:.0%} of copy)", flush=True)
    report.sections["attention"] = rows
    best = [r for r in rows if r["kind"] == "decode" and r["first"] >= 64
            and r["ctx"] == contexts[min(1, len(contexts) - 1)]]
    if best:
        share = max(r["share_of_copy"] for r in best)
        report.add("decode attention, batch >= 64, 4k ctx", f"{share:.0%} of copy bandwidth",
                   "MET" if share >= 0.8 else "MISSED (target 80%)")


def _attention_fn(device: torch.device) -> Callable[..., torch.Tensor]:
    if device.type == "cuda":
        from kernels.triton_attention import unified_attention

        return unified_attention
    from kernels.torch_attention import unified_attention as torch_attention

    return torch_attention


def run_kernel_tests(report: Report, device: torch.device) -> None:
    """The kernel tests against their torch twins, compiled for this device."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/test_triton_attention.py",
           "--kernel-device", device.type, "-x"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    report.sections["kernel_tests"] = {"returncode": proc.returncode, "tail": tail[0],
                                       "seconds": time.perf_counter() - started}
    report.add("kernel tests on " + device.type, tail[0], "PASS" if proc.returncode == 0
               else "FAIL")


def main(argv: list[str] | None = None) -> int:
    """Runs every check; returns 1 when a correctness check failed."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu_check.json")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU plumbing check with tiny shapes (what CI runs)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["tests", "bandwidth", "parity", "throughput"])
    ns = parser.parse_args(argv)
    if not ns.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu" if ns.smoke else "cuda")
    report = Report(torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)")
    from loadtest.benchmarks.gpu_check_e2e import greedy_parity, llama8b_throughput

    if "tests" not in ns.skip and not ns.smoke:
        run_kernel_tests(report, device)
    if "bandwidth" not in ns.skip:
        copy_gbs = copy_bandwidth(device, 2**24 if ns.smoke else 2**31)
        report.sections["copy_gbs"] = copy_gbs
        report.add("copy bandwidth", f"{copy_gbs:.0f} GB/s")
        batches, contexts = ([1, 4], [64, 256]) if ns.smoke else ([1, 16, 64, 256],
                                                                  [1024, 4096, 16384])
        heads = (4, 2, 64) if ns.smoke else (32, 8, 128)
        dtype = torch.float32 if ns.smoke else torch.bfloat16
        attention_bandwidth(report, device, batches, contexts, heads, dtype, copy_gbs)
    if "parity" not in ns.skip:
        greedy_parity(report, device, ns.smoke)
    if "throughput" not in ns.skip:
        llama8b_throughput(report, device, ns.smoke, LLAMA3_8B)
    return finish(report, Path(ns.out))


def finish(report: Report, out: Path) -> int:
    """Writes the JSON, prints the summary table last, and returns the exit code."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": report.device, **report.sections,
                               "summary": report.summary}, indent=2, default=str))
    width = max((len(name) for name, _, _ in report.summary), default=10)
    print(f"\n== gpu_check summary ({report.device}); full numbers in {out} ==")
    for name, value, verdict in report.summary:
        print(f"{name:<{width}}  {value}  {verdict}")
    return 1 if any(v in ("FAIL",) for _, _, v in report.summary) else 0


if __name__ == "__main__":
    sys.exit(main())
