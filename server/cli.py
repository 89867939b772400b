"""`kvserve` command line: `serve` (the OpenAI-compatible server), `plan` (capacity planner)
and `generate` (offline generation of one prompt)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.config import EngineArgs, add_engine_flags, engine_args_from_flags
from engine.planner import add_plan_arguments, run_plan
from server.config import add_server_arguments, server_config


def run_generate(ns: argparse.Namespace) -> int:
    """Offline generation of one chat turn or prompt, printed with its throughput."""
    from engine import LLM, SamplingParams

    args = engine_args_from_flags(ns, "generate")
    llm = LLM(args.model, **{f.name: getattr(args, f.name) for f in EngineArgs.flags("generate")})
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.seed)
    started = time.perf_counter()
    if ns.raw:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    else:
        outs = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    completion = outs[0].outputs[0]
    print(completion.text)
    print(f"[{len(completion.token_ids)} tokens in {elapsed:.2f} s, "
          f"finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows each flag's default unless its help already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or \
                not action.option_strings:
            return text
        return f"{text} (default: {action.default})"


def build_parser() -> argparse.ArgumentParser:
    """The `kvserve` parser with its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"], help="log verbosity")
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__, parents=[common],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API",
                           parents=[common], formatter_class=_DefaultsFormatter)
    add_engine_flags(serve, "serve")
    add_server_arguments(serve)
    plan = sub.add_parser("plan", help="KV cache capacity plan from a model's config alone",
                          parents=[common], formatter_class=_DefaultsFormatter)
    add_plan_arguments(plan)
    gen = sub.add_parser("generate", help="generate offline from one prompt", parents=[common],
                         formatter_class=_DefaultsFormatter)
    add_engine_flags(gen, "generate")
    gen.add_argument("--prompt", default="What is a KV cache, in two sentences?")
    gen.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvserve` console script."""
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S")
    try:
        if ns.command == "plan":
            if ns.pipeline_parallel_size > 1:  # per-stage figures
                from engine.distributed.pipeline_plan import run_pipeline_plan

                return run_pipeline_plan(ns)
            return run_plan(ns)
        if ns.command == "serve":
            config = server_config(ns)
            engine_args = engine_args_from_flags(ns, "serve")  # flags checked before any start
            if config.data_parallel_size > 1:
                from server.data_parallel import run_data_parallel

                return run_data_parallel(config, config.data_parallel_size, argv,
                                         engine_args.num_threads)
            from server.serve import run_serve

            return run_serve(config, engine_args)
        return run_generate(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
