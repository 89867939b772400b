"""`python -m loadtest run ...` drives a server; `python -m loadtest compare A.json B.json`
sets results side by side. `python -m loadtest.benchmarks` runs the benchmark suite."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m loadtest {run,compare} ...

  run       send a dataset to an OpenAI-compatible server (SSE or WebSocket) on an arrival
            schedule; print TTFT / TPOT / ITL / E2E percentiles, throughput and goodput;
            --result-json and --plot write the details
  compare   python -m loadtest compare A.json B.json ... [--labels ...] [--plot cmp.png]

`python -m loadtest run --help` lists every flag."""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to `run` or `compare`; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        from loadtest.cli import run_main

        return run_main(rest)
    if command == "compare":
        from loadtest.compare import compare_main

        return compare_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
