"""`python -m loadtest.benchmarks`: every benchmark, one after another, into docs/benchmarks.md.

Each benchmark states its target and whether this run met it; a missed target is reported,
never hidden, and one that failed to run says why. Plots go to docs/benchmarks/. Run on a
quiet machine: other processes change every figure (each section notes contention it saw).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.bench_machine import cpu_model
from loadtest.bench_report import format_table
from loadtest.benchmarks.common import DOCS, ROOT, SuiteContext, verdict

# (key, module, attribute or None for the module itself), in the order
REGISTRY = [
    ("offline", "loadtest.benchmarks.offline", "Throughput"),
    ("batch1", "loadtest.benchmarks.offline", "Batch1"),
    ("serving", "loadtest.benchmarks.serving", None),
    ("kv_waste", "loadtest.benchmarks.kv_waste", None),
    ("prefix_cache", "loadtest.benchmarks.prefix_cache", None),
    ("chunked_prefill", "loadtest.benchmarks.chunked_prefill", None),
    ("overhead", "loadtest.benchmarks.overhead", None),
]


def load(module: str, attr: str | None) -> Any:
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads of every engine")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run")
    p.add_argument("--only", nargs="+", choices=[k for k, _, _ in REGISTRY], default=None)
    p.add_argument("--markdown", type=Path, default=DOCS / "benchmarks.md")
    p.add_argument("--json", type=Path, default=DOCS / "benchmarks.json")
    return p.parse_args(argv)


def run_one(key: str, bench: Any, ctx: SuiteContext) -> dict[str, Any]:
    """Runs one benchmark; a crash becomes a result that says so."""
    print(f"== {bench.NAME}", flush=True)
    start = time.perf_counter()
    try:
        result = bench.run(ctx)
    except Exception as exc:  # one broken benchmark must not lose the others' figures
        traceback.print_exc()
        result = {"target": "-", "met": None, "error": f"{type(exc).__name__}: {exc}",
                  "summary": "failed to run"}
    result["seconds"] = time.perf_counter() - start
    print(f"== {bench.NAME}: {verdict(result['met'])} ({result['summary']}) in "
          f"{result['seconds']:.0f} s", flush=True)
    return result


def environment(ns: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    import torch
    import transformers

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "cores": os.cpu_count(), "threads": ns.threads,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "command": "python -m loadtest.benchmarks " + " ".join(argv)}


def render_section(index: int, bench: Any, result: dict[str, Any]) -> str:
    head = f"## {index}. {bench.NAME}"
    if "error" in result:
        body = f"Failed to run: `{result['error']}`. **Verdict: not measured.**"
    else:
        body = bench.render(result)
    return f"{head}\n\n{body}\n\nCommand (alone): `{bench.COMMAND}`; took " \
           f"{result['seconds']:.0f} s in this run."


def render(env: dict[str, Any], sections: list[tuple[Any, dict[str, Any]]], quick: bool) -> str:
    rows = [(f"{i}. {b.NAME}", r["target"], r["summary"], verdict(r["met"]))
            for i, (b, r) in enumerate(sections, 1)]
    parts = [
        "# kvserve benchmarks",
        f"Measured {env['date']} on {env['cpu']}, {env['cores']} cores (servers, engines and "
        f"load clients share them); torch threads {env['threads']} (OMP_NUM_THREADS set to "
        f"match); torch {env['torch']}, transformers {env['transformers']}, Python "
        f"{env['python']}. Model: SmolLM2-135M-Instruct unless a section says otherwise.",
        f"Produced by `{env['command']}`." + (" QUICK RUN: smoke-test sizes, not figures "
                                              "to quote." if quick else ""),
        format_table(("benchmark", "target", "measured", "verdict"), rows),
        *(render_section(i, b, r) for i, (b, r) in enumerate(sections, 1)),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    ctx = SuiteContext(threads=ns.threads, quick=ns.quick)
    ctx.apply_threads()
    env = environment(ns, argv)
    sections = []
    for key, module, attr in REGISTRY:
        if ns.only is None or key in ns.only:
            bench = load(module, attr)
            sections.append((bench, run_one(key, bench, ctx)))
    text = render(env, sections, ns.quick)
    print(text)
    ns.markdown.parent.mkdir(parents=True, exist_ok=True)
    ns.markdown.write_text(text)
    ns.json.write_bytes(orjson.dumps({"env": env, "results": [
        {"name": b.NAME, **r} for b, r in sections]}, option=orjson.OPT_INDENT_2,
        default=str))
    print(f"wrote {ns.markdown.relative_to(ROOT) if ns.markdown.is_relative_to(ROOT) else ns.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
