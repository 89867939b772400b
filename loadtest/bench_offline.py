"""Offline benchmark: kvserve vs. transformers on SmolLM2-135M, with a CPU roofline.

Run as `python -m loadtest.bench_offline [--threads 2] [--quick] [--json PATH] [--markdown PATH]`.
It prints tables and target met/missed lines; nothing here asserts on time. Both engines load
the same embedded GGUF (dequantized to float32), so they compute on identical weights.

Sections, all measured in one run so the machine rates and the engines see the same load:
1. throughput of 64 random-token prompts (kvserve vs. `generate_batch` vs. one-at-a-time);
2. the 64-sequence decode step against max(FLOPs / matmul rate, weight bytes / bandwidth);
3. batch-1 decode against the memory-bandwidth floor;
4. float32 vs. bfloat16 for kvserve, to back the `dtype=auto` choice on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from loadtest.bench_config import BenchConfig
from loadtest.bench_engines import run_hf, run_kvserve
from loadtest.bench_machine import cpu_model, measure_machine
from loadtest.bench_report import build_report, render


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """Reads the command line into a BenchConfig."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads for every engine")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="kvserve dtype of sections 1-3")
    p.add_argument("--skip-hf-sequential", action="store_true")
    p.add_argument("--hf-sequential-prompts", type=int, default=8,
                   help="prompts for transformers' one-at-a-time generate (64 take ~7 min)")
    p.add_argument("--hf-page-size", type=int, default=256, help="generate_batch page_size")
    p.add_argument("--hf-max-batch-tokens", type=int, default=512,
                   help="generate_batch max_batch_tokens")
    p.add_argument("--skip-bf16", action="store_true", help="skip the bfloat16 engine")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each timing, wait up to this long for other processes to idle")
    p.add_argument("--profile-decode", action="store_true",
                   help="print torch.profiler's top ops over a few decode steps")
    p.add_argument("--quick", action="store_true", help="small everything, for a smoke run")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--markdown", dest="markdown_path")
    ns = vars(p.parse_args(argv))
    quick = ns.pop("quick")
    cfg = BenchConfig(**ns)
    return cfg.quick() if quick else cfg


# ---- workloads (unit-tested) --------------------------------------------------------------


def spread_lengths(num: int, lo: int, hi: int, seed: int) -> list[int]:
    """`num` lengths evenly spaced over [lo, hi] (both ends included), shuffled by `seed`.

    Even spacing rather than uniform draws keeps the mean at (lo + hi) / 2 for any seed.
    """
    if num == 1:
        return [(lo + hi) // 2]
    lengths = [lo + round(i * (hi - lo) / (num - 1)) for i in range(num)]
    random.Random(seed).shuffle(lengths)
    return lengths


def random_prompts(lengths: Sequence[int], vocab_size: int, excluded_ids: set[int],
                   seed: int) -> list[list[int]]:
    """Random token ids of the given lengths, never drawing an id from `excluded_ids`."""
    allowed = [i for i in range(vocab_size) if i not in excluded_ids]
    rng = random.Random(seed)
    return [rng.choices(allowed, k=n) for n in lengths]


# ---- main ---------------------------------------------------------------------------------


def environment(threads: int) -> dict[str, Any]:
    """Versions and hardware printed with the results."""
    import transformers
    return {"threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu_model(),
            "python": platform.python_version()}


def make_workloads(cfg: BenchConfig, mc: ModelConfig) -> dict[str, Any]:
    """The throughput prompts, the short decode prompts and the batch-1 prompt."""
    from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer
    from engine.model_loader.gguf.weights import default_model_path

    tok = load_gguf_tokenizer(default_model_path())
    excluded = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    lengths = spread_lengths(cfg.num_prompts, cfg.min_input, cfg.max_input, cfg.seed)
    decode = random_prompts([cfg.decode_input] * cfg.decode_seqs, mc.vocab_size, excluded,
                            cfg.seed + 1)
    return {"prompts": random_prompts(lengths, mc.vocab_size, excluded, cfg.seed),
            "decode": decode, "batch1": random_prompts([16], mc.vocab_size, excluded,
                                                       cfg.seed + 2)[0]}


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Measures everything in order: machine, kvserve (dtype, then bf16), transformers."""
    from engine.model_loader.gguf.weights import default_model_path, read_gguf_config

    torch.set_num_threads(cfg.threads)
    mc = read_gguf_config(default_model_path())
    work = make_workloads(cfg, mc)
    env = environment(cfg.threads)
    print(f"threads={cfg.threads} torch={env['torch']} cpu={env['cpu']}", flush=True)
    rates = measure_machine(cfg, mc.hidden_size, mc.intermediate_size)
    kv = run_kvserve(cfg, cfg.dtype, work["prompts"], work["decode"], work["batch1"])
    gc.collect()
    bf16 = None
    if not cfg.skip_bf16 and cfg.dtype != "bfloat16":
        bf16 = run_kvserve(cfg, "bfloat16", None, work["decode"], work["batch1"])
        gc.collect()
    hf = run_hf(cfg, work["prompts"], work["batch1"])
    return build_report(cfg, env, mc, rates, kv, bf16, hf)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run, print, and write JSON / markdown when asked."""
    cfg = parse_args(argv)
    report = run(cfg)
    text = render(report)
    print(text)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=2, default=str))
    if cfg.markdown_path:
        Path(cfg.markdown_path).write_text(text)


if __name__ == "__main__":
    main()
