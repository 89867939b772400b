"""Batch-1 decode per vector ISA of kvserve's C++ CPU ops, against llama.cpp built for the same
ISA, on the embedded SmolLM2-135M GGUF, with the same thread count, back to back in one run.

`--isa avx2` measures what an AVX2-only CPU (AMD before Zen 4, Intel client chips) gets on a
host with more: kvserve's ops built for x86-64-v3 (KVSERVE_CPU_MARCH), torch's own kernels and
oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), float32 (what `--dtype auto`
picks without native bf16), and llama.cpp built without AVX-512 (build/peers/llamacpp/
build-avx2). `--isa native` runs this CPU's own builds. Each kvserve configuration runs in its
own process (the ops library is loaded once per process). The CPU flags are printed with the
figures.

`--streams` also serves the chat workload of the serving benchmark at 64 streams (2 x 64
requests, 64 in flight, greedy, EOS ignored) from `kvserve serve` and from `llama-server
--parallel 64`, both built for the ISA, one after the other.

    python -m loadtest.benchmarks.cpu_isa --isa avx2 [--threads 2] [--streams] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.cpu_features import read_cpu_flags
from loadtest.benchmarks import llamacpp

ENVS = {"avx2": {"KVSERVE_CPU_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
                 "ONEDNN_MAX_CPU_ISA": "AVX2"}, "native": {}}
DTYPES = {"avx2": "float32", "native": "auto"}
CONFIGS = ("gguf", "int4", "none")  # gguf: the default (the file's Q4_1 blocks in place)
TOKENS, REPS = 128, 5

CHILD = """
import json, sys, time
from engine import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu_ops
quant, dtype, threads, tokens, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM(None, quantization=quant, dtype=dtype, num_threads=threads, max_model_len=1024,
          max_num_seqs=4, kv_cache_memory_bytes=256 * 2**20)
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=8),
             use_tqdm=False)
rates = []
for i in range(reps):
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [5 + i]}], params, use_tqdm=False)
    rates.append(tokens / (time.perf_counter() - start))
ops = cpu_ops.loaded()
print(json.dumps({"rates": rates, "isa": ops.vector_isa() if ops else None,
                  "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
                  "path": llm.engine.runner.cpu_path.path.value}))
llm.engine.shutdown()
"""


def kvserve_row(isa: str, quant: str, threads: int) -> dict:
    """One configuration's tg tokens/s in a child process with the ISA's environment."""
    env = {**os.environ, **ENVS[isa], "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", CHILD, quant, DTYPES[isa], str(threads),
                          str(TOKENS), str(REPS)], env=env, capture_output=True, text=True,
                         check=True, timeout=1800)
    row: dict = json.loads(out.stdout.strip().splitlines()[-1])
    row["median"] = statistics.median(row["rates"])
    return row


def streams(isa: str, threads: int, model: Path) -> list[str]:
    """Table rows: each server's output tok/s and p99 TTFT / ITL at 64 streams."""
    from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer
    from loadtest.benchmarks.serving import parse_args as serving_args
    from loadtest.benchmarks.serving_load import RESULTS, run_server
    from loadtest.serve_process import kvserve_spec

    RESULTS.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENVS[isa])  # the servers' environments are copied from this one
    ns = serving_args(["--concurrency", "64", "--server-threads", str(threads),
                       "--wait-quiet", "0"])
    specs = [kvserve_spec(None, threads, 64, RESULTS, ["--dtype", DTYPES[isa]]),
             llamacpp.server_spec(model, threads, 64, 512, RESULTS, isa=isa)]
    rows = []
    for spec in specs:
        report = run_server(ns, spec, load_gguf_tokenizer(model))
        for lv in report["levels"]:
            rows.append(f"| {spec.name} ({isa}) | {lv['level']} | {lv['ok']} ok, {lv['failed']} "
                        f"failed | {lv['output_tok_s']:.1f} | {lv['ttft_p99_ms']:.0f} | "
                        f"{lv['itl_p99_ms']:.0f} |")
    return ["", "| server | level | requests | output tok/s | p99 TTFT ms | p99 ITL ms |",
            "|---|---|---|---|---|---|", *rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--isa", choices=tuple(ENVS), default="avx2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", action="store_true", help="also serve 64 streams from both")
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    ns = p.parse_args(argv)
    from engine.model_loader.gguf.weights import default_model_path

    model = default_model_path()
    llamacpp.setup(isa=ns.isa)
    flags = sorted(f for f in read_cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
    peer = llamacpp.run_bench(model, ns.threads, 0, TOKENS, 3, isa=ns.isa)[0]
    rows = {q: kvserve_row(ns.isa, q, ns.threads) for q in CONFIGS}
    base = rows["none"]["median"]
    lines = [f"CPU flags: {' '.join(flags)}; target ISA {ns.isa}; {ns.threads} threads; "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             f"| engine | config | tg{TOKENS} tok/s (median of {REPS}) | x llama.cpp | "
             "x unquantized |", "|---|---|---|---|---|",
             f"| llama.cpp ({ns.isa} build) | GGUF Q4_1, -t {ns.threads} | "
             f"{peer['tokens_per_s']:.1f} ± {peer['stddev']:.1f} | 1.00x | |"]
    for quant, row in rows.items():
        lines.append(f"| kvserve ({row['isa']}, {row['dtype']}, {row['path']}) | "
                     f"--quantization {quant} | {row['median']:.1f} "
                     f"({min(row['rates']):.0f}-{max(row['rates']):.0f}) | "
                     f"{row['median'] / peer['tokens_per_s']:.2f}x | {row['median'] / base:.2f}x |")
    if ns.streams:
        lines += streams(ns.isa, ns.threads, model)
    text = "\n".join(lines)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
