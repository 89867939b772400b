"""The page section of the parallelism and routing benchmark (loadtest/benchmarks/distributed.py):
one block per part that ran (tables, commands, how to read them), then the target line."""

from __future__ import annotations

from typing import Any

from loadtest.benchmarks.common import format_table, target_line
from loadtest.benchmarks.machine import QUIET_CORES


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.1%}"


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _cores(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


def _failed(title: str, part: dict[str, Any]) -> str:
    return f"**{title}** failed to run: `{part['error']}`."


def render_dp(dp: dict[str, Any]) -> str:
    """DP=2 x 1 thread vs one engine x 2 threads."""
    title = "Data parallel: 2 replicas x 1 thread vs one engine x 2 threads"
    if "error" in dp:
        return _failed(title, dp)
    cfg = dp["config"]
    rows = [(s["name"], f"c={lv['concurrency']}", f"{lv['ok']}/{lv['failed']}",
             lv["output_tok_s"], lv["ttft_p50_ms"], lv["ttft_p99_ms"], lv["itl_p50_ms"],
             lv["itl_p99_ms"], _cores(lv["server_cores"]), _cores(lv["other_cores"]))
            for s in dp["servers"] for lv in s["levels"]]
    ratios = [(f"c={r['concurrency']}", _x(r["tok_s_ratio"]), _x(r["ttft_p99_ratio"]))
              for r in dp["ratios"]]
    busy = [f"{s['name']} c={lv['concurrency']}" for s in dp["servers"] for lv in s["levels"]
            if (lv["other_cores"] or 0.0) > QUIET_CORES]
    return "\n\n".join([
        f"**{title}.** The embedded SmolLM2-135M-Instruct GGUF; streamed chat completions, "
        f"user messages {cfg['min_input']}..{cfg['max_input']} tokens plus the chat template, "
        f"{cfg['max_tokens']} output tokens (EOS ignored), greedy, the same seeded prompts for "
        f"both; concurrency C sends 2 x C requests with C in flight, after {cfg['warmup']} "
        f"warm-up requests. One engine: {dp['threads']} threads and a {cfg['kv_gib']:g} GiB KV "
        f"cache; DP=2: `--num-threads {dp['threads']}` split into {dp['replica_threads']} "
        f"thread(s) per replica, {cfg['kv_gib'] / 2:g} GiB each, behind the front (which "
        "routes by load with prefix affinity). Server and client share the machine's cores."
        + _when(dp),
        format_table(("server", "load", "ok/failed", "output tok/s", "TTFT p50 (ms)",
                      "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)", "server CPU (cores)",
                      "others' CPU (cores)"), rows),
        format_table(("load", "output tok/s (DP=2 / one engine)",
                      "TTFT p99 (DP=2 / one engine)"), ratios) if ratios else "",
        "On a 2-core CPU both setups have the same compute; DP trades one engine's batched "
        "matmuls over 2 threads for two smaller batches of 1 thread each, plus the front's "
        "extra HTTP hop and process. "
        + (f"WARNING: other processes were busy during {', '.join(busy)}." if busy else ""),
        "```\n" + "\n".join(s["command"] for s in dp["servers"]) + "\n```"])


def render_tp(tp: dict[str, Any]) -> str:
    """Step time and communication share, TP=1 vs TP=2."""
    title = "Tensor parallel: decode step time and its communication share"
    if "error" in tp:
        return _failed(title, tp)
    cfg, m = tp["config"], tp["model"]
    rows = [(r["tp"], r["threads_per_rank"], r.get("collectives", "gloo") if r["tp"] > 1
             else "-", r["sequences"], r["step_ms"],
             r["comm_ms"] if r["tp"] > 1 else None, _pct(r["comm_share"]) if r["tp"] > 1
             else None, r["collectives_per_step"] or None,
             r["comm_kib_per_step"] if r["tp"] > 1 else None, r["tok_s"]) for r in tp["rows"]]
    speed = [(size, _x(s["speedup"]), _pct(s["comm_share"]), _pct(s.get("gloo_comm_share")),
              _x(s.get("shm_vs_gloo")))
             for size, s in sorted(tp.get("speedups", {}).items(), key=lambda kv: int(kv[0]))]
    return "\n\n".join([
        f"**{title}.** SmolLM2-135M has 9 heads and 3 KV heads, which 2 ranks cannot split, so "
        f"this part runs a SmolLM2-like Llama whose heads divide 2: {m['num_hidden_layers']} "
        f"layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads / "
        f"{m['num_key_value_heads']} KV heads of 64, MLP {m['intermediate_size']}, vocab "
        f"{m['vocab_size']:,} (SmolLM2's tokenizer), tied embeddings, random weights "
        f"(config.json only, `load_format=\"dummy\"`), {tp['dtype']}. Each step is an "
        f"all-decode batch of N sequences at context {cfg['context']}, handed to the engine's "
        f"worker (forward + sampling, timed on its thread); medians of {cfg['steps']} steps "
        f"after {cfg['warmup_s']:g} s of warm-up. Threads: TP=2 runs 1 thread per rank (2 "
        "processes, 2 threads in all; rank 0's worker thread is set to 1 here, since the "
        "engine leaves it at --num-threads, the total of all ranks); TP=1 runs with 1 thread "
        "(the same per-rank compute) and with 2 (the same cores)."
        + _when(tp),
        format_table(("TP", "threads per rank", "collectives", "sequences", "step (ms)",
                      "comm (ms)", "comm share", "collectives/step", "KiB moved/step",
                      "tokens/s"), rows),
        format_table(("sequences", "TP=1 (1 thread) step / TP=2 step (shm)",
                      "TP=2 comm share (shm)", "TP=2 comm share (gloo)",
                      "gloo step / shm step"), speed) if speed else "",
        "Collectives: `shm` is the stage's shared-memory all-reduce and all-gather "
        "(engine/distributed/shm_collectives.py: each rank writes its slot of a /dev/shm "
        "mapping and spins until the other's counter catches up; tensors over 4 MiB still go "
        "through gloo), the default on one host's CPU; `gloo` is the same engine with "
        "`KVSERVE_SHM_COLLECTIVES=0` (loopback TCP). "
        "Comm is rank 0's wall time inside its collectives: the all-reduce after "
        "each attention output and MLP down projection, the vocab-parallel embedding's "
        "all-reduce, the LM head's all-gather, and the broadcast of each step's inputs and "
        "hidden rows to rank 1. It is measured by a hook this benchmark installs on rank 0's "
        "process group, and it includes waiting for rank 1 to reach the collective, so it "
        "bounds the transfer from above. A speed-up over TP=1 with both threads is not expected "
        "on 2 cores: the two ranks share the cores TP=1 already uses, and each collective "
        "costs a wait for the other rank (with gloo also a loopback round trip and thread "
        "wake-ups). The share is the figure that matters on GPUs, where the "
        "same collectives per step (count and bytes above) run over NVLink in microseconds "
        "each next to the step's compute." + _busy(tp["rows"])])


def _busy(rows: list[dict[str, Any]]) -> str:
    """A warning naming the rows during which other processes kept cores busy."""
    busy = [f"TP={r['tp']} x {r['threads_per_rank']}, {r['sequences']} seqs" for r in rows
            if (r.get("other_cores") or 0.0) > QUIET_CORES]
    return f" WARNING: other processes were busy during {'; '.join(busy)}." if busy else ""


def render_routing(rt: dict[str, Any]) -> str:
    """Hit rate and TTFT per routing setup and level."""
    title = "Cache-aware routing vs round robin"
    if "error" in rt:
        return _failed(title, rt)
    cfg = rt["config"]
    rows = []
    for s in rt["setups"]:
        for i, lv in enumerate(s["levels"]):
            shares = " / ".join(_pct(r["query_share"]) or "-" for r in lv["per_replica"])
            rows.append((s["name"], lv["concurrency"], f"{lv['ok']}/{lv['failed']}",
                         _pct(lv["hit_rate"]), _pct(rt["best_hit_rates"][i]),
                         lv["ttft_mean_ms"], lv["ttft_p50_ms"], lv["ttft_p99_ms"],
                         lv["output_tok_s"], shares, int(lv.get("preemptions") or 0)))
    compare = [(row["concurrency"], *(x for name in ("ours", "vllm-router cache_aware")
                                      for x in (_pct(row[name]["hit_rate"]),
                                                _x(row[name]["ttft_vs_rr"]))),
                _pct(row["round robin"]["hit_rate"])) for row in rt.get("compare", [])]
    levels = ", ".join(f"concurrency {c} with {n} requests" for c, n in cfg["levels"])
    return "\n\n".join([
        f"**{title}.** 2 replicas of the embedded SmolLM2-135M-Instruct GGUF, "
        f"{rt['threads_per_replica']} thread each. Prompts: one of {cfg['documents']} shared "
        f"documents (random pseudo-words, about {cfg['document_tokens']} tokens each) plus its "
        f"own question of about {cfg['question_tokens']} tokens; each request picks its "
        f"document at random (seeded), so the prefixes interleave; {cfg['max_tokens']} output "
        f"tokens, greedy, EOS ignored, streamed text completions. Levels: {levels}, each with "
        "its own documents, the same prompts for every setup. Each replica's KV cache holds "
        f"{rt['kv_tokens_per_replica']:,} tokens: {cfg['cache_fraction']:.0%} of all the "
        "documents plus its share of the requests in flight, so one replica cannot keep every "
        "document and two can; with unbounded caches round robin would lose only one extra "
        "miss per document and replica. Setups, one after the other: ours (`-dp 2`: least "
        "requests in flight, prompt-prefix affinity), vllm-router 0.1's `cache_aware` policy "
        "and its `round_robin` in front of two separate `kvserve serve` (their prefix caches "
        "flushed between the two)." + (f" {rt['skipped']}." if rt.get("skipped") else ""),
        format_table(("setup", "concurrency", "ok/failed", "hit rate", "best possible",
                      "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p99 (ms)", "output tok/s",
                      "looked-up tokens per replica", "preemptions"), rows),
        format_table(("concurrency", "hit rate ours", "mean TTFT ours / round robin",
                      "hit rate vllm-router", "mean TTFT vllm-router / round robin",
                      "hit rate round robin"), compare) if compare else "",
        "Hit rate: prompt tokens found in the prefix cache over prompt tokens looked up, "
        "summed over both replicas' /metrics during the level. Best possible: one cache that "
        "never evicts, each prompt hitting (in whole 16-token blocks) the longest prefix it "
        "shares with an earlier prompt, so each document misses once in all. Looked-up tokens "
        "per replica show how the work split (a cache-aware router may pile documents onto "
        "one replica). Our front keys a prompt's affinity on its prefixes of 64, 128, 256, ... "
        "characters and follows the longest one an earlier prompt had (server/dp_routing.py)."
        + _when(rt),
        "```\n" + "\n".join(rt["commands"]) + "\n```"])


def render_plan(plan: dict[str, Any]) -> str:
    """The 70B per-GPU arithmetic, with both plans' full text."""
    title = "70B-class model on 8x H200: KV arithmetic per GPU from `kvserve plan`"
    if "error" in plan:
        return _failed(title, plan)
    lays = plan["layouts"]
    rows = [(lay["name"], lay["gpus"], lay["layers_per_gpu"], lay["kv_heads_per_gpu"],
             f"{lay['weight_gib']:.2f}", f"{lay['activation_gib']:.2f}",
             f"{lay['kv_gib']:.2f}", f"{lay['kv_bytes_per_token']:,}",
             f"{lay['kv_tokens']:,}", f"{lay['fp8_kv_tokens']:,}",
             lay["max_concurrency_32k"]) for lay in lays]
    blocks = [f"```\n$ {lay['command']}\n{lay['text']}\n```" for lay in lays]
    return "\n\n".join([
        f"**{title}.** Llama-3.1-70B's config.json alone (no weights; 80 layers, hidden 8192, "
        "64 heads / 8 KV heads of 128, MLP 28672, vocab 128256, untied embeddings) in a folder "
        f"the benchmark writes; bfloat16; --memory {plan['memory']} per GPU (an H200, NVIDIA's "
        "141 GB, shows about 140 GiB to the driver; on the GPU itself `kvserve plan` measures "
        "it), default --gpu-memory-utilization 0.9 and max-num-seqs 256.",
        format_table(("layout", "GPUs", "layers per GPU", "KV heads per GPU",
                      "weights per GPU (GiB)", "activation reserve (GiB)",
                      "KV cache per GPU (GiB)", "KV bytes per token per GPU",
                      "KV tokens (bf16)", "KV tokens (fp8)", "32k requests at once"), rows),
        _plan_notes(lays), *blocks])


def _plan_notes(lays: list[dict[str, Any]]) -> str:
    """What the two layouts' figures say (numbers from the plans)."""
    def desc(lay: dict[str, Any]) -> str:
        return (f"{lay['name']}: {lay['kv_heads_per_gpu']} of 8 KV heads in "
                f"{lay['layers_per_gpu']} layers, {lay['kv_bytes_per_token']:,} B per token")

    ratio = lays[1]["kv_tokens"] / lays[0]["kv_tokens"] if len(lays) > 1 else None
    return (f"Per GPU ({'; '.join(desc(lay) for lay in lays)}). Both layouts put 1/8 of the "
            "weights on each GPU (TP=8: 1/8 of every layer and of both vocab matrices; TP=4 x "
            "PP=2: 1/4 of half the layers and of one vocab matrix) and 1/8 of every token's KV, "
            "so the cache holds about the same number of tokens"
            + (f" ({ratio:.3f}x)" if ratio else "") + ": TP=4 x PP=2 reserves a little more "
            "for activations, its per-GPU slices of heads and MLP being twice as wide. TP=8 "
            "already gives each GPU a single KV head: a larger TP would replicate KV heads. "
            "`kvserve plan -tp 4 -pp 2` prints this arithmetic, and `kvserve serve -tp 4 -pp 2` "
            "runs that layout (8 ranks).")


def render_pp(pp: dict[str, Any]) -> str:
    """Offline tokens/s of PP=2 with and without the batch queue, and of one process."""
    title = "Pipeline parallel: the batch queue"
    if "error" in pp:
        return _failed(title, pp)
    cfg = pp["config"]
    rows = [(r["setup"], r["tok_s"]) for r in pp["rows"]]
    when = _when(pp)
    busy = [r["setup"] for r in pp["rows"] if (r.get("other_cores") or 0.0) > QUIET_CORES]
    return "\n\n".join([
        f"**{title}.** The TP part's SmolLM2-like Llama (30 layers, random weights), 15 layers "
        f"per stage, offline: {cfg['requests']} requests of {cfg['prompt_len']} prompt tokens, "
        f"{cfg['max_tokens']} output tokens each (`ignore_eos`), best of {cfg['repeats']}. "
        "PP=2 runs 1 thread per stage (2 processes, 2 threads in all). With the batch queue "
        "rank 0 launches a batch (half the requests) to the first stage and finishes the one "
        "before on the last stage meanwhile; switched off on the same engine, the same "
        "half-batches run through both stages one after the other." + when,
        format_table(("setup", "output tokens/s"), rows),
        f"Batch queue over one batch at a time: {_x(pp.get('batch_queue_gain'))}; over one "
        f"process with 2 threads: {_x(pp.get('vs_one_process'))}. On one machine PP splits "
        "the same cores, so it is not expected to beat one process; the queue's gain is the "
        "idle stage it puts to work, which on GPUs is a whole device per stage."
        + (f" WARNING: other processes were busy during {'; '.join(busy)}." if busy else "")])


def _when(part: dict[str, Any]) -> str:
    """" Measured DATE, in a run of this part alone." for a part rerun on its own, else ""."""
    return f" Measured {part['date']}, in a run of this part alone." if part.get("date") else ""


def render_all(result: dict[str, Any]) -> str:
    """Every part that ran, then the target line."""
    parts = []
    if result.get("quick"):
        parts.append("*Quick run: smoke-test sizes, not figures to quote.*")
    left_out = [p for p in ("dp", "tp", "routing", "plan", "pp") if p not in result]
    if left_out:
        parts.append(f"*Parts not run in this measurement: {', '.join(left_out)} (all five run "
                     "with `python -m loadtest.benchmarks --only distributed`).*")
    for key, fn in (("dp", render_dp), ("tp", render_tp), ("routing", render_routing),
                    ("plan", render_plan), ("pp", render_pp)):
        if key in result:
            parts.append(fn(result[key]))
    parts.append(target_line(result["target"], result["met"], result["summary"]))
    return "\n\n".join(p for p in parts if p)
