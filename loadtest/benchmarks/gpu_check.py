"""One-command GPU check: `python -m loadtest.benchmarks.gpu_check [--out results/gpu_check.json]`.

On a CUDA machine, in one run (budget: under 8 minutes on one H200):
1. the kernel tests compiled for CUDA (not the interpreter):
   `pytest tests/kernels/test_triton_attention.py tests/kernels/test_triton_quant_linear.py
   tests/kernels/test_tinygemm.py --kernel-device cuda`;
2. the device's copy bandwidth, then the decode attention kernel's achieved bandwidth (KV bytes
   read / median time from `triton.testing.do_bench`) at batch 1/16/64/256 x context 1k/4k/16k,
   and prefill chunks, as a share of the copy bandwidth (target: >= 80% at batch >= 64, 4k);
2b. the weight-only int8/int4 linears of the Llama-3-8B shapes through the Triton kernel
   against bfloat16 and the dequantizing path, and a sweep of int4 tiles (gpu_check_quant.py);
3. greedy parity on the GPU against transformers (a divergence allowed only where each side's
   token is in the other's top 5): the tiny model in bfloat16 eager, with CUDA graphs, with
   fp8 e4m3 and e5m2 KV caches and with int8 and int4 weights; SmolLM2 too where its package
   is installed (gpu_check_parity.py);
4. offline throughput of a Llama-3.2-1B-shaped model (random weights): `LLM.generate` against
   transformers' `generate_batch` on the same device (gpu_check_offline.py);
5. decode throughput of a Llama-3-8B-shaped model with random bfloat16 weights at batch 1, 32
   and 128, with and without CUDA graphs, beside transformers' `generate`;
then prints one summary table, writes it as markdown (`--out` with .md) and every number to the
JSON file. A section that fails is a FAIL row and the rest still run; `--budget` seconds cap
the run (later sections are skipped and say so).

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
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loadtest.benchmarks.common import ROOT, SuiteContext, format_table, target_line
from loadtest.benchmarks.gpu_check_report import Report, release

NAME = "GPU check"
COMMAND = "python -m loadtest.benchmarks.gpu_check"
TARGET = ("kernel tests and greedy parity pass on the GPU; decode attention at batch >= 64, "
          "4k context reads KV at >= 80% of the copy bandwidth")
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
RECORDED = ROOT / "docs" / "gpu_check.json"  # the last run on a GPU, committed by hand
SECTIONS = ("tests", "bandwidth", "quant", "parity", "offline", "throughput")
KERNEL_TESTS_TIMEOUT_S = 240


def run_kernel_tests(report: Report, device: torch.device) -> None:
    """The kernel tests against their torch twins, compiled for this device (no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/kernels/test_triton_attention.py", "tests/kernels/test_triton_quant_linear.py",
           "tests/kernels/test_tinygemm.py",
           "--kernel-device", device.type,
           "--timeout", "120"]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=KERNEL_TESTS_TIMEOUT_S)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        output, code = f"{partial}\ntimed out after {KERNEL_TESTS_TIMEOUT_S} s", -1
    lines = output.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    report.sections["kernel_tests"] = {"returncode": code, "tail": lines[-1:],
                                       "failed": failed, "seconds": time.perf_counter() - started}
    if failed or code != 0:
        print("\n".join(lines[-60:]), flush=True)
    report.add("kernel tests on " + device.type, lines[-1] if lines else "no output",
               "PASS" if code == 0 else "FAIL")


def bandwidth(report: Report, device: torch.device, small: bool) -> None:
    """Copy bandwidth, then attention's KV bandwidth against it."""
    from loadtest.benchmarks.gpu_check_kernels import (
        attention_bandwidth,
        copy_bandwidth,
        tile_sweep,
    )

    copy_gbs = copy_bandwidth(device, 2**24 if small else 2**31)
    report.sections["copy_gbs"] = copy_gbs
    report.add("copy bandwidth", f"{copy_gbs:.0f} GB/s")
    batches, contexts = ([1, 4], [64, 256]) if small else ([1, 16, 64, 256], [1024, 4096, 16384])
    heads = (4, 2, 64) if small else (32, 8, 128)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    attention_bandwidth(report, device, batches, contexts, heads, dtype, copy_gbs)
    if device.type == "cuda":  # the tile is a Triton launch parameter
        tile_sweep(report, device, heads, dtype, copy_gbs, small)


def check(device: torch.device, small: bool, skip: Sequence[str] = (),
          out: Path | None = None, budget_s: float = 420.0) -> Report:
    """Runs every section not in `skip` on `device`; `small` = tiny shapes (the smoke run).

    A section that raises is recorded as a FAIL row with its error and the next one runs; the
    JSON is rewritten after each section (a run cut short still leaves its findings); sections
    that would start after `budget_s` are skipped and say so.
    """
    from loadtest.benchmarks.gpu_check_e2e import llama8b_throughput
    from loadtest.benchmarks.gpu_check_offline import offline_throughput
    from loadtest.benchmarks.gpu_check_parity import greedy_parity
    from loadtest.benchmarks.gpu_check_quant import quant_linears

    report = Report(torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)")
    sections = {"tests": lambda: run_kernel_tests(report, device),
                "bandwidth": lambda: bandwidth(report, device, small),
                "quant": lambda: quant_linears(report, device, small),
                "parity": lambda: greedy_parity(report, device, small),
                "offline": lambda: offline_throughput(report, device, small),
                "throughput": lambda: llama8b_throughput(report, device, small, LLAMA3_8B)}
    if device.type != "cuda":
        del sections["tests"]  # compiled kernels need a GPU; the smoke runs the torch twins
    started = time.perf_counter()
    for name, section in sections.items():
        if name in skip:
            continue
        if time.perf_counter() - started > budget_s:
            report.add(f"section {name}", f"skipped: the {budget_s:.0f} s budget was spent",
                       "SKIPPED")
            continue
        section_started = time.perf_counter()
        try:
            section()
        except Exception as exc:  # record it and go on: the other sections still tell
            traceback.print_exc()
            report.add(f"section {name}", f"{type(exc).__name__}: {exc}"[:200], "FAIL")
            release(device)
        report.sections.setdefault("seconds", {})[name] = time.perf_counter() - section_started
        if out is not None:
            write_json(report, out)
    return report


def write_json(report: Report, out: Path) -> None:
    """Every number measured so far."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": report.device, **report.sections,
                               "summary": report.summary}, indent=2, default=str))


def finish(report: Report, out: Path) -> int:
    """Writes the JSON and a markdown table beside it, prints the table last, and returns the
    exit code (1 when a correctness check failed)."""
    write_json(report, out)
    table = markdown(report)
    out.with_suffix(".md").write_text(table + "\n")
    print(f"\n== gpu_check summary; full numbers in {out} ==\n{table}", flush=True)
    return 1 if any(v == "FAIL" for _, _, v in report.summary) else 0


def markdown(report: Report) -> str:
    """The summary rows as a markdown table, and the throughput rows as a second one."""
    lines = [f"Device: {report.device}; torch {torch.__version__}, Python "
             f"{sys.version.split()[0]}.", "", format_table(["check", "value", "verdict"],
                                                           report.summary)]
    decode = report.sections.get("llama8b_decode", [])
    if decode:
        keys = sorted({k for row in decode for k in row if k != "batch"})
        lines += ["", "Decode tok/s of the Llama-3-8B shape (random bfloat16 weights):", "",
                  format_table(["batch", *keys], [[row["batch"], *(
                      f"{row[k]:.0f}" if k in row else "" for k in keys)] for row in decode])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs every check; returns 1 when a correctness check failed."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu_check.json")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU plumbing check with tiny shapes (what CI runs)")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which the remaining sections are skipped")
    ns = parser.parse_args(argv)
    if not ns.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu" if ns.smoke else "cuda")
    out = Path(ns.out)
    return finish(check(device, ns.smoke, ns.skip, out, ns.budget), out)


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
        text = ("Not run: no CUDA GPU on the machine that ran the suite. On one, this runs the "
                "kernel tests compiled for CUDA, the attention kernel's KV bandwidth against the "
                "copy bandwidth, greedy parity with transformers in bfloat16 (eager, CUDA "
                "graphs, fp8 KV, int8/int4 weights), offline tok/s against `generate_batch`, and "
                "decode tok/s of a Llama-3-8B-shaped model with and without CUDA graphs. `" +
                COMMAND + " --smoke` runs the same code on CPU with tiny shapes (CI runs it).")
        if RECORDED.is_file():
            last = json.loads(RECORDED.read_text())
            text += (f"\n\nLast run on a GPU ({last['measured']}; every table in "
                     f"[docs/gpu_check.md](gpu_check.md)):\n\n" +
                     format_table(["check", "value", "verdict"], last["summary"]))
        return text
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
