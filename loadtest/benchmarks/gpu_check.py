"""One-command GPU check: `python -m loadtest.benchmarks.gpu_check [--out results/gpu_check.json]`.

On a CUDA machine, in one run (budget: under 8 minutes on one H200):
1. the kernel tests compiled for CUDA (not the interpreter):
   `pytest tests/kernels/test_triton_attention.py --kernel-device cuda`;
2. the device's copy bandwidth, then the decode attention kernel's achieved bandwidth (KV bytes
   read / median time from `triton.testing.do_bench`) at batch 1/16/64/256 x context 1k/4k/16k,
   and prefill chunks, as a share of the copy bandwidth (target: >= 80% at batch >= 64, 4k);
3. greedy parity on the GPU: the tiny model and SmolLM2 in bfloat16 against transformers, a
   divergence allowed only where each side's token is in the other's top 5;
4. decode throughput of a Llama-3-8B-shaped model with random bfloat16 weights at batch 1, 32
   and 128, with and without CUDA graphs, beside transformers' `generate`;
then prints one summary table and writes every number to the JSON file.

`--smoke` runs the same plumbing on CPU with tiny shapes and the torch kernels, so the script is
tested in CI even where no GPU is lent. In the suite (`python -m loadtest.benchmarks`) it runs
when CUDA is present and is reported as skipped otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loadtest.benchmarks.common import ROOT, SuiteContext, format_table, target_line
from loadtest.benchmarks.gpu_check_report import Report

NAME = "GPU check"
COMMAND = "python -m loadtest.benchmarks.gpu_check"
TARGET = ("kernel tests and greedy parity pass on the GPU; decode attention at batch >= 64, "
          "4k context reads KV at >= 80% of the copy bandwidth")
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
SECTIONS = ("tests", "bandwidth", "parity", "throughput")


def run_kernel_tests(report: Report, device: torch.device) -> None:
    """The kernel tests against their torch twins, compiled for this device."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/kernels/test_triton_attention.py",
           "--kernel-device", device.type, "-x"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    report.sections["kernel_tests"] = {"returncode": proc.returncode, "tail": tail[0],
                                       "seconds": time.perf_counter() - started}
    report.add("kernel tests on " + device.type, tail[0], "PASS" if proc.returncode == 0
               else "FAIL")


def bandwidth(report: Report, device: torch.device, small: bool) -> None:
    """Copy bandwidth, then attention's KV bandwidth against it."""
    from loadtest.benchmarks.gpu_check_kernels import attention_bandwidth, copy_bandwidth

    copy_gbs = copy_bandwidth(device, 2**24 if small else 2**31)
    report.sections["copy_gbs"] = copy_gbs
    report.add("copy bandwidth", f"{copy_gbs:.0f} GB/s")
    batches, contexts = ([1, 4], [64, 256]) if small else ([1, 16, 64, 256], [1024, 4096, 16384])
    heads = (4, 2, 64) if small else (32, 8, 128)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    attention_bandwidth(report, device, batches, contexts, heads, dtype, copy_gbs)


def check(device: torch.device, small: bool, skip: Sequence[str] = ()) -> Report:
    """Runs every section not in `skip` on `device`; `small` = tiny shapes (the smoke run)."""
    from loadtest.benchmarks.gpu_check_e2e import greedy_parity, llama8b_throughput

    report = Report(torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)")
    if "tests" not in skip and device.type == "cuda":
        run_kernel_tests(report, device)
    if "bandwidth" not in skip:
        bandwidth(report, device, small)
    if "parity" not in skip:
        greedy_parity(report, device, small)
    if "throughput" not in skip:
        llama8b_throughput(report, device, small, LLAMA3_8B)
    return report


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


def main(argv: list[str] | None = None) -> int:
    """Runs every check; returns 1 when a correctness check failed."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu_check.json")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU plumbing check with tiny shapes (what CI runs)")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    ns = parser.parse_args(argv)
    if not ns.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu" if ns.smoke else "cuda")
    return finish(check(device, ns.smoke, ns.skip), Path(ns.out))


# ---- suite interface ----------------------------------------------------------------------


def run(ctx: SuiteContext) -> dict[str, Any]:
    """The whole check on the GPU (tiny shapes with --quick), or a skip without CUDA."""
    if not torch.cuda.is_available():
        return {"target": TARGET, "met": None, "skipped": True,
                "summary": "skipped: no CUDA GPU"}
    report = check(torch.device("cuda"), ctx.quick)
    finish(report, ctx.log_dir / "gpu_check.json")
    verdicts = [v for _, _, v in report.summary if v]
    met = bool(verdicts) and not any(v.startswith(("FAIL", "MISSED")) for v in verdicts)
    return {"target": TARGET, "met": met, "device": report.device,
            "summary": "; ".join(f"{n}: {v}" for n, _, v in report.summary if v),
            "rows": report.summary, "sections": report.sections}


def render(result: dict[str, Any]) -> str:
    """The summary table and the decode throughput rows, or why nothing ran."""
    if result.get("skipped"):
        return ("Not run: no CUDA GPU on the machine that ran the suite. On one, this runs the "
                "kernel tests compiled for CUDA, the attention kernel's KV bandwidth against the "
                "copy bandwidth, greedy parity with transformers in bfloat16, and decode tok/s "
                "of a Llama-3-8B-shaped model with and without CUDA graphs. `" + COMMAND +
                " --smoke` runs the same code on CPU with tiny shapes (CI runs it).")
    decode = result["sections"].get("llama8b_decode", [])
    keys = sorted({k for row in decode for k in row if k != "batch"})
    return "\n\n".join([
        f"Device: {result['device']}.",
        format_table(["check", "value", "verdict"], result["rows"]),
        "Decode tok/s of the Llama-3-8B shape (random bfloat16 weights):",
        format_table(["batch", *keys], [[row["batch"], *(row.get(k) for k in keys)]
                                        for row in decode]),
        target_line(result["target"], result["met"], result["summary"])])


if __name__ == "__main__":
    sys.exit(main())
