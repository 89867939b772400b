"""The llama.cpp peer's batch-1 decode on other GGUF types of the same model: the embedded
SmolLM2 file requantized by llama.cpp's own `llama-quantize` (Q8_0, and Q4_K_M, which on
SmolLM2's 576-wide rows falls back to Q5_0 and keeps Q4_K/Q6_K/Q8_0 elsewhere), each run by
`llama-bench` and by kvserve (`--quantization auto`: the file's blocks in place) with the same
thread count. Informational beside the section's target, which is on the embedded file."""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.benchmarks import llamacpp
from loadtest.benchmarks.common import format_table, ratio

KINDS = ("Q8_0", "Q4_K_M")


def file_types(path: Path) -> str:
    """The file's tensor types by count, most first (`Q5_0 x166, ...`)."""
    from engine.model_loader.gguf.format import read_gguf_header

    counts = Counter(t.tensor_type.name for t in read_gguf_header(path).tensors)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())


def rows(model: Path, threads: int, w: dict[str, Any], vocab: int, excluded: set[int],
         batch1: Any, bench: Any) -> list[dict[str, Any]]:
    """One llama.cpp and one kvserve row per requantized copy (`batch1` and `bench`: the
    section's kvserve_batch1 and llamacpp_batch1)."""
    out = []
    for kind in KINDS:
        path = llamacpp.quantized_copy(model, kind)
        peer = bench(path, threads, w)
        ours = batch1("auto", "auto", threads, w, vocab, excluded, path)
        gc.collect()
        out.append({"kind": kind, "file": path.name, "types": file_types(path),
                    "file_mib": path.stat().st_size / 2**20, "llama.cpp": peer, "kvserve": ours})
    return out


def table(result: dict[str, Any]) -> str:
    """tg (and pp) of both engines on each copy, with kvserve's ratio."""
    w = result["workload"]
    tests = [f"tg{w['n_gen']}", f"pp{w['n_prompt']}"]
    lines = []
    for r in result["files"]:
        mib = r["kvserve"].get("weights_mib")
        cells: list[Any] = [r["kind"], f"{r['file_mib']:.1f}", "-" if mib is None else f"{mib:.1f}"]
        for t in tests:
            ours, peer = r["kvserve"].get(t), r["llama.cpp"].get(t)
            cells += [f"{ours['tokens_per_s']:.1f} ± {ours['stddev']:.1f}" if ours else "-",
                      f"{peer['tokens_per_s']:.1f} ± {peer['stddev']:.1f}" if peer else "-",
                      _x(ratio(ours and ours["tokens_per_s"], peer and peer["tokens_per_s"]))]
        lines.append(cells)
    heads = [h for t in tests for h in (f"{t} kvserve", f"{t} llama.cpp", "ratio")]
    return format_table(["llama-quantize type", "file (MiB)", "kvserve weights (MiB)", *heads],
                        lines)


def section(result: dict[str, Any]) -> list[str]:
    """The paragraph and table of this part ([] for a result stored before it existed)."""
    if not result.get("files"):
        return []
    types = "; ".join(f"{r['kind']}: {r['types']}" for r in result["files"])
    return ["The same model in other GGUF types, made from the embedded file by llama.cpp's own "
            "`llama-quantize --allow-requantize` (batch 1 as above, kvserve at `--quantization "
            "auto`, which keeps each file's blocks in place; informational, the target is on "
            f"the embedded file). Tensor types: {types}.", table(result)]


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
