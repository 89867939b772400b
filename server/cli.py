"""`kvserve` command line: `serve` (the OpenAI-compatible server), `plan` (capacity planner)
and `generate` (offline generation of one prompt)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.config import EngineArgs
from engine.planner import add_plan_arguments, run_plan
from server.config import add_server_arguments, server_config


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags, spelled and defaulted as vLLM's."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF checkpoint folder or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        help="auto|float32|bfloat16|float16 (default: auto = float32 on CPU, "
                             "bfloat16 on CUDA)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output token limit (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="most requests running at once (default: 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget per step (default: 2048, or max-model-len up to "
                             "8192 when larger)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block (default: 16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of GPU memory kvserve may use (default: 0.9)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size in bytes; overrides the memory-based sizing "
                             "(default: unset)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse KV blocks of shared prefixes (default: on)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache element type: auto (the model dtype), fp8_e4m3 (alias "
                             "fp8) or fp8_e5m2; fp8 stores 1 byte per element (default: auto)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                        help="attention kernels: auto = triton on CUDA, torch on CPU "
                             "(default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run decode steps eagerly instead of replaying captured "
                             "CUDA graphs (default: graphs on with the Triton backend)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice, usually the cores)")


def engine_kwargs(ns: argparse.Namespace) -> dict[str, object]:
    """EngineArgs keyword arguments from parsed flags."""
    names = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
             "gpu_memory_utilization", "kv_cache_memory_bytes", "enable_prefix_caching",
             "kv_cache_dtype", "seed", "num_threads", "enforce_eager",
             "attention_backend")
    return {name: getattr(ns, name) for name in names}


def run_generate(ns: argparse.Namespace) -> int:
    """Offline generation of one chat turn or prompt, printed with its throughput."""
    from engine import LLM, SamplingParams

    llm = LLM(ns.model, **engine_kwargs(ns))
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
    add_engine_arguments(serve)
    add_server_arguments(serve)
    plan = sub.add_parser("plan", help="KV cache capacity plan from a model's config alone",
                          parents=[common])
    add_plan_arguments(plan)
    gen = sub.add_parser("generate", help="generate offline from one prompt", parents=[common],
                         formatter_class=_DefaultsFormatter)
    add_engine_arguments(gen)
    gen.add_argument("--prompt", default="What is a KV cache, in two sentences?")
    gen.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvserve` console script."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S")
    try:
        if ns.command == "plan":
            return run_plan(ns)
        if ns.command == "serve":
            from server.serve import run_serve

            return run_serve(server_config(ns), EngineArgs.from_kwargs(ns.model, **engine_kwargs(ns)))
        return run_generate(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
