"""`python -m loadtest.benchmarks`: every benchmark, one after another, into docs/benchmarks.md
and docs/benchmarks.json (its figures), nothing else; plots go to docs/benchmarks/.

Each benchmark states its target and whether this run met it; a missed target is reported,
never hidden, and one that failed to run says why. `--only KEY...` reruns some and keeps the
other sections of the existing JSON (each section says when it was measured); `--render-only`
rewrites the page from the JSON without measuring. Run on a quiet machine: other processes
change every figure (each section notes contention it saw).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import itertools
import multiprocessing as mp
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.benchmarks import suite_child
from loadtest.benchmarks.common import DOCS, ROOT, SuiteContext, format_table, verdict
from loadtest.benchmarks.machine import environment

# (key, module, attribute or None for the module itself), in the order
REGISTRY = [
    ("offline", "loadtest.benchmarks.offline", "Throughput"),
    ("batch1", "loadtest.benchmarks.offline", "Batch1"),
    ("serving", "loadtest.benchmarks.serving", None),
    ("kv_waste", "loadtest.benchmarks.kv_waste", None),
    ("prefix_cache", "loadtest.benchmarks.prefix_cache", None),
    ("chunked_prefill", "loadtest.benchmarks.chunked_prefill", None),
    ("overhead", "loadtest.benchmarks.overhead", None),
    ("fp8_quality", "loadtest.benchmarks.fp8_quality", None),
    ("quantization", "loadtest.benchmarks.quantization", None),
    ("structured_output", "loadtest.benchmarks.structured_output", None),
    ("gpu_check", "loadtest.benchmarks.gpu_check", None),
    ("llamacpp", "loadtest.benchmarks.llamacpp_peer", None),
    ("distributed", "loadtest.benchmarks.distributed", None),
]
Results = dict[str, dict[str, Any]]  # registry key -> result


def load(module: str, attr: str | None) -> Any:
    """The benchmark object of a registry entry (a module or a class)."""
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m loadtest.benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads of every engine")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run")
    p.add_argument("--only", nargs="+", choices=[k for k, _, _ in REGISTRY], default=None,
                   help="run these; the other sections keep their figures from --json")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite --markdown from --json without measuring anything")
    p.add_argument("--in-process", action="store_true",
                   help="run every benchmark in this process (by default each benchmark "
                        "module runs in a fresh one, so none inherits another's threads)")
    p.add_argument("--markdown", type=Path, default=DOCS / "benchmarks.md")
    p.add_argument("--json", type=Path, default=DOCS / "benchmarks.json")
    return p.parse_args(argv)


def failed(error: str) -> dict[str, Any]:
    """The result of a benchmark that did not run to its end."""
    return {"target": "-", "met": None, "error": error, "summary": "failed to run"}


def stamp(result: dict[str, Any], ctx: SuiteContext, env: dict[str, Any],
          seconds: float) -> None:
    """Adds how long a result took, when and where it was measured."""
    result.update(seconds=seconds, date=env["date"], machine=env["cpu"], quick=ctx.quick)


def run_one(bench: Any, ctx: SuiteContext, env: dict[str, Any]) -> dict[str, Any]:
    """Runs one benchmark; a crash becomes a result that says so."""
    print(f"== {bench.NAME}", flush=True)
    start = time.perf_counter()
    try:
        result = bench.run(ctx)
    except Exception as exc:  # one broken benchmark must not lose the others' figures
        traceback.print_exc()
        result = failed(f"{type(exc).__name__}: {exc}")
    stamp(result, ctx, env, time.perf_counter() - start)
    print(f"== {bench.NAME}: {verdict(result['met'], bool(result.get('skipped')))} "
          f"({result['summary']}) in {result['seconds']:.0f} s", flush=True)
    return result


def load_previous(path: Path) -> tuple[dict[str, Any] | None, Results]:
    """The env and the results (by key) of an earlier run's JSON; older files name results
    only, and their date is the file's."""
    if not path.is_file():
        return None, {}
    saved = orjson.loads(path.read_bytes())
    key_of = {load(m, a).NAME: k for k, m, a in REGISTRY}
    results: Results = {}
    for result in saved.get("results", []):
        key = result.get("key") or key_of.get(result.get("name", ""))
        if key is not None:
            results[key] = {"date": saved["env"]["date"], "machine": saved["env"]["cpu"],
                            **result}
    return saved.get("env"), results


def merge(previous: Results, fresh: Results) -> Results:
    """Fresh results replace earlier ones, except that a skip never hides a measurement."""
    merged = dict(previous)
    for key, result in fresh.items():
        if not (result.get("skipped") and key in previous
                and not previous[key].get("skipped")):
            merged[key] = result
    return merged


def render_section(index: int, bench: Any, result: dict[str, Any]) -> str:
    """One benchmark's section: its body (or why it failed) and how to rerun it."""
    head = f"## {index}. {bench.NAME}"
    if "error" in result:
        body = f"Failed to run: `{result['error']}`. **Verdict: not measured.**"
    else:
        body = bench.render(result)
    quick = " (quick run: smoke-test sizes)" if result.get("quick") else ""
    machine = f" on {result['machine']}" if result.get("machine") else ""
    return (f"{head}\n\n{body}\n\nCommand (alone): `{bench.COMMAND}`; measured "
            f"{result['date']}{machine}{quick}, took {result['seconds']:.0f} s.")


def header(env: dict[str, Any], results: Results) -> list[str]:
    """The title, the machine of the latest run and how the page was produced."""
    dates = {r["date"] for r in results.values()}
    lines = [
        "# kvserve benchmarks",
        f"Measured {env['date']} on {env['cpu']}, {env['cores']} cores (servers, engines and "
        f"load clients share them); torch threads {env['threads']} (OMP_NUM_THREADS set to "
        f"match); torch {env['torch']}, transformers {env['transformers']}, Python "
        f"{env['python']}. Model: SmolLM2-135M-Instruct unless a section says otherwise.",
        f"Produced by `{env['command'].strip()}`." + (
            " Each section gives the date and machine it was measured on: sections this run did "
            "not include keep the figures of earlier runs." if dates != {env["date"]} else "")]
    if any(r.get("quick") for r in results.values()):
        lines.append("QUICK RUN sections hold smoke-test sizes, not figures to quote.")
    return lines


def render(env: dict[str, Any], results: Results) -> str:
    """The whole page: header, summary table, one section per benchmark with a result."""
    sections = [(load(m, a), results[k]) for k, m, a in REGISTRY if k in results]
    rows = [(f"{i}. {b.NAME}", r["target"], r["summary"],
             verdict(r["met"], bool(r.get("skipped")))) for i, (b, r) in enumerate(sections, 1)]
    parts = [*header(env, results),
             format_table(("benchmark", "target", "measured", "verdict"), rows),
             *(render_section(i, b, r) for i, (b, r) in enumerate(sections, 1))]
    return "\n\n".join(parts) + "\n"


def run_group(entries: list[tuple[str, str, str | None]], ctx: SuiteContext,
              env: dict[str, Any]) -> Results:
    """Runs the benchmarks of `entries` one after another in this process."""
    ctx.apply_threads()
    return {key: run_one(load(module, attr), ctx, env) for key, module, attr in entries}


def run_isolated(entries: list[tuple[str, str, str | None]], ctx: SuiteContext,
                 env: dict[str, Any]) -> Results:
    """run_group in a fresh (spawned) process. Benchmarks that run engines in their own
    process are slowed by what an earlier one left there: an OpenMP team on the main thread
    halves the engine worker's speed (engine/worker/worker.py), and after the serving
    benchmark the llama.cpp peer's batch-1 decode measured 75.8 tok/s where a fresh process
    gives 241."""
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    try:
        return pool.submit(suite_child.run_group, entries, ctx, env).result()
    except Exception as exc:  # the child died (a crash in native code): say so per benchmark
        traceback.print_exc()
        results: Results = {}
        for key, _, _ in entries:
            results[key] = failed(f"the benchmark's process died: {type(exc).__name__}: {exc}")
            stamp(results[key], ctx, env, 0.0)
        return results
    finally:
        pool.shutdown()


def measure(ns: argparse.Namespace, env: dict[str, Any]) -> Results:
    """Runs the selected benchmarks in registry order, those of one module (which may share a
    measurement) in one fresh process each unless --in-process; plots go beside the page."""
    ctx = SuiteContext(threads=ns.threads, quick=ns.quick,
                       plot_dir=ns.markdown.parent / "benchmarks")
    ctx.apply_threads()
    selected = [entry for entry in REGISTRY if ns.only is None or entry[0] in ns.only]
    results: Results = {}
    for _, group in itertools.groupby(selected, key=lambda entry: entry[1]):
        entries = list(group)
        results.update(run_group(entries, ctx, env) if ns.in_process
                       else run_isolated(entries, ctx, env))
    return results


def write(ns: argparse.Namespace, env: dict[str, Any], results: Results) -> None:
    """The page and its JSON (results in registry order, each with its key and name)."""
    ordered = [{"key": k, "name": load(m, a).NAME, **results[k]} for k, m, a in REGISTRY
               if k in results]
    text = render(env, results)
    print(text)
    ns.markdown.parent.mkdir(parents=True, exist_ok=True)
    ns.markdown.write_text(text)
    ns.json.write_bytes(orjson.dumps({"env": env, "results": ordered},
                                     option=orjson.OPT_INDENT_2, default=str))
    shown = ns.markdown.relative_to(ROOT) if ns.markdown.is_relative_to(ROOT) else ns.markdown
    print(f"wrote {shown}")


def main(argv: Sequence[str] | None = None) -> int:
    """Measures (or only renders), merges with the earlier JSON, writes page and JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    env, previous = load_previous(ns.json)
    if ns.render_only:
        if env is None:
            print(f"--render-only needs {ns.json}", file=sys.stderr)
            return 2
        write(ns, env, previous)
        return 0
    env = environment(ns.threads, " ".join(["python -m loadtest.benchmarks", *argv]))
    write(ns, env, merge(previous, measure(ns, env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
